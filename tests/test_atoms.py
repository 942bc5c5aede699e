"""stages/atoms helpers against slow references: the drop components of tree atoms and the
samples of a set of atoms."""

from __future__ import annotations

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from microplan.stages.atoms import Atoms, _components


def ref_components(members: np.ndarray, ptr: np.ndarray, codes: np.ndarray) -> list[int]:
    """Per atom, the least rollout code of its component (atoms joined by shared rollouts; int64 max
    for an empty atom, which joins nothing): union-find."""
    A = ptr.size - 1
    up = list(range(A))

    def find(a: int) -> int:
        while up[a] != a:
            a = up[a]
        return a

    seen: dict[int, int] = {}
    for a in range(A):
        for x in members[ptr[a]:ptr[a + 1]].tolist():
            c = int(codes[x])
            if c in seen:
                up[find(a)] = find(seen[c])
            else:
                seen[c] = a
    least: dict[int, int] = {}
    for a in range(A):
        for x in members[ptr[a]:ptr[a + 1]].tolist():
            r = find(a)
            least[r] = min(least.get(r, int(codes[x])), int(codes[x]))
    return [least.get(find(a), np.iinfo(np.int64).max) for a in range(A)]   # an empty atom: no code


@given(seed=st.integers(0, 2 ** 31), n=st.integers(1, 60), per_rollout=st.sampled_from([1, 1, 2, 5]),
       atoms=st.integers(1, 20), empty=st.booleans())
def test_components_equal_union_find(seed, n, per_rollout, atoms, empty):
    """Dense rollout codes (``Batch.rollout_codes``) of one sample each (the one-pass path), of
    several samples kept in one atom or spread over atoms (label propagation), with an empty atom
    or none: the least code of each atom's component."""
    rng = np.random.default_rng(seed)
    codes = np.repeat(np.arange(n), per_rollout)[:n].astype(np.int64)
    rng.shuffle(codes)
    _, codes = np.unique(codes, return_inverse=True)         # dense again, in no particular order
    members = rng.permutation(n).astype(np.int64)
    if rng.random() < 0.5:   # atoms are whole rollouts: sort members by rollout first
        members = members[np.argsort(codes[members], kind="stable")]
    cuts = np.sort(rng.choice(np.arange(1, n), min(atoms, n) - 1, replace=False)) if n > 1 else np.zeros(0, int)
    ptr = np.concatenate([[0], cuts, [n]]).astype(np.int64)
    if empty:
        ptr = np.insert(ptr, int(rng.integers(0, ptr.size)), ptr[int(rng.integers(0, ptr.size))])
        ptr = np.sort(ptr)
    got = _components(members, ptr, codes.astype(np.int64))
    assert got.dtype == np.int64
    assert got.tolist() == ref_components(members, ptr, codes)


@given(seed=st.integers(0, 2 ** 31), n=st.integers(1, 40), atoms=st.integers(1, 12))
def test_samples_of_gathers_each_atoms_members(seed, n, atoms):
    """``Atoms.samples_of``: the members of the given atoms, atom by atom, for every atom in order
    (the members as they are) and for any other selection."""
    rng = np.random.default_rng(seed)
    members = rng.permutation(n).astype(np.int64)
    cuts = np.sort(rng.choice(np.arange(1, n), min(atoms, n) - 1, replace=False)) if n > 1 else np.zeros(0, int)
    ptr = np.concatenate([[0], cuts, [n]]).astype(np.int64)
    A = ptr.size - 1
    z = np.zeros(A, dtype=np.int64)
    a = Atoms(z, z.astype(np.float64), z, members[ptr[:-1]], members, ptr, None, None, True)
    for sel in (np.arange(A), rng.permutation(A), np.sort(rng.choice(A, int(rng.integers(0, A + 1)), replace=False))):
        want = [x for k in sel.tolist() for x in members[ptr[k]:ptr[k + 1]].tolist()]
        got = a.samples_of(sel.astype(np.int64))
        assert got.tolist() == want
        assert got is not members and not np.shares_memory(got, members)
