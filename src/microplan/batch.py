"""The global batch of one RL training step: per-sample lengths and the group structure.

A :class:`Batch` is what every rank must agree on before planning: the packed length of each
sample, how many of its tokens carry loss, and which prompt (GRPO group) and rollout (the turns
of one step-wise trajectory) it belongs to. Ids are normalised to dense codes in order of first
appearance, so ``[7, 7, 3]`` and ``["b", "b", "a"]`` describe the same structure.

Validation happens once, here: lengths are ints >= 1 (floats, even whole ones like 200.0, and
strings like "200" are refused naming the field and index: they mean a column was read with the
wrong type), ``0 <= loss_tokens <= seq_lens``, arrays agree in length, and a rollout never spans
two prompts. Everything downstream trusts it. Ids are ints or strings; an id array that mixes
the two is normalised to strings (``[1, "1"]`` becomes ``["1", "1"]``: one prompt, as a CSV or
JSON reader that lost the types would see it), so 1 and "1" never silently form two groups.
Cost: O(n) numpy work, no Python loop per sample: int ids are coded with one stable sort, or
taken as they are when already dense codes in first-appearance order (``np.repeat(arange(P),
G)``), and an int id array is listed only when ``prompt_ids``/``rollout_ids`` is read; string ids
take one C-level dict pass. An empty Batch is allowed (a rank's local shard may be empty); planning one is
a PlanError.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from ._checks import int_array
from ._sort import stable_argsort
from .errors import PlanError

__all__ = ["Batch"]


_FIX = {
    "seq_lens": "pass each sample's packed length (prompt + response tokens) as an int >= 1, and leave "
                "empty samples out of the batch.",
    "loss_tokens": "pass each sample's loss-token count (its response-mask sum) as an int from 0 to its seq_lens.",
    "prompt_lens": "pass each sample's prompt token count as an int from 0 to its seq_lens.",
    "vision_tokens": "pass each sample's vision-encoder patches (0 for a text-only sample) as an int >= 0.",
    "num_images": "pass each sample's image/video-clip count (0 for a text-only sample) as an int >= 0.",
    "rank_of": "pass the data-parallel rank (an int >= 0) that holds each sample, or leave rank_of out.",
    "prefix_parent": "pass each sample's prefix parent (an earlier sample's index, or -1) as an int.",
    "shared_prefix_lens": "pass each sample's shared prefix length as an int >= 0.",
}


_MAX_LEN = 2 ** 40  # keeps every sum of lengths far inside int64


def _ints(name: str, values: Any, *, minimum: int) -> np.ndarray:
    """``int_array`` with a fix appended to its message; floats and strings refused by index."""
    try:
        if not isinstance(values, np.ndarray):
            try:
                arr = np.asarray(values)  # once: a list of 16k ints costs ~0.5 ms to convert
            except Exception:  # ragged: int_array says so
                arr = None
            if arr is not None:
                _refuse_non_ints(name, arr, values)
                values = arr
        else:
            _refuse_non_ints(name, values, values)
        if isinstance(values, np.ndarray) and np.issubdtype(values.dtype, np.unsignedinteger) and values.size \
                and int(values.max()) > _MAX_LEN:
            i = int(np.argmax(values))
            raise PlanError(f"{name}[{i}]={int(values[i])} is too large for a token count (at most {_MAX_LEN}).")
        arr = int_array(name, values, minimum=minimum)
        if arr.size and int(arr.max()) > _MAX_LEN:
            i = int(np.argmax(arr))
            raise PlanError(f"{name}[{i}]={int(arr[i])} is too large for a token count (at most {_MAX_LEN}).")
        return arr
    except PlanError as exc:
        raise PlanError(f"{exc} Fix: {_FIX[name]}") from None


def _refuse_non_ints(name: str, arr: np.ndarray, values: Any) -> None:
    """Refuse floats (even whole ones: 200.0) and strings ("200") naming the first such entry.

    DESIGN says lengths are ints: a float or a string usually means a column was read with the
    wrong type, which is better fixed where it was read than guessed at here. NaN, inf and
    fractions keep ``int_array``'s own messages (checked first, so they name their index).
    """
    if arr.ndim != 1 or arr.size == 0 or np.issubdtype(arr.dtype, np.integer) or arr.dtype == np.bool_:
        return
    if np.issubdtype(arr.dtype, np.floating):
        if not np.isfinite(arr).all() or (arr != np.floor(arr)).any():
            return  # int_array names the NaN/inf/fraction
        raise PlanError(f"{name}[0]={arr[0].item()!r} is a float ({arr.dtype} values); {name} holds ints: convert "
                        f"the array with .astype(int) where it is built (a whole-number float usually means the "
                        "column was read with the wrong type).")
    seq = values.tolist() if isinstance(values, np.ndarray) else list(values)
    for i, v in enumerate(seq):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
            raise PlanError(f"{name}[{i}]={v!r} is a {type(v).__name__}, not an int; {name} holds ints: convert "
                            f"it where the value is read (int({v!r}) for a whole number).")


class _Codes(NamedTuple):
    """Dense id codes in order of first appearance (see :func:`_factorize`)."""

    codes: np.ndarray   # int64 code of each sample
    first: np.ndarray   # int64 index of each code's first sample, ascending
    ids: list[Any] | np.ndarray  # each sample's id as a plain Python int or str (JSON-ready); an int
    #                              array stays an array (a private copy) until Batch.prompt_ids/rollout_ids is read


def _factorize(name: str, ids: Any, n: int) -> _Codes:
    """Dense codes in order of first appearance, vectorised (no Python loop per sample).

    An id array that mixes ints and strings is normalised to strings (``str(1) == "1"``: one
    group), never two groups that print alike. Int ids are coded with one stable sort
    (:func:`_int_codes`); string ids with C-level dict passes.
    """
    if isinstance(ids, np.ndarray) and ids.ndim != 1:
        raise PlanError(f"{name} must be 1-D, got shape {ids.shape}; pass one id per sample.")
    if isinstance(ids, (str, bytes)) or not hasattr(ids, "__iter__"):
        raise PlanError(f"{name}={ids!r} is not a sequence; pass one id (int or str) per sample.")
    arr: np.ndarray | None = None
    if isinstance(ids, np.ndarray) and ids.dtype.kind in "iu":  # listed on first read (Batch.prompt_ids)
        values, kind = ids.copy(), "int"
        arr = values
    elif isinstance(ids, np.ndarray) and ids.dtype.kind == "U":
        values, kind = ids.tolist(), "str"
    else:
        values = ids.tolist() if isinstance(ids, np.ndarray) else list(ids)
        types = set(map(type, values))
        kind = _id_kind(name, values, types)
        if types - {int, str} or types == {int, str}:  # numpy ints, str subclasses, a mix: plain values
            values = list(map(str, values)) if kind == "str" else np.asarray(values, dtype=np.int64).tolist()
    if len(values) != n:
        raise PlanError(f"{name} has {len(values)} entries but seq_lens has {n}; pass one id per sample.")
    if kind == "str":  # C-level passes: each id's first sample (later writes win, so feed them reversed)
        first_of = dict(zip(reversed(values), range(n - 1, -1, -1)))
        first = np.fromiter(map(first_of.__getitem__, values), dtype=np.int64, count=n)
        is_first = np.zeros(n, dtype=bool)
        is_first[first] = True
        codes, peak = (np.cumsum(is_first) - 1)[first], None
    else:
        if arr is None:
            try:
                arr = np.asarray(values, dtype=np.int64)
            except OverflowError:
                raise PlanError(f"{name} holds an int outside int64; pass ids within ±2**63, or strings.") from None
        codes, peak = _int_codes(arr)
    new = np.ones(n, dtype=bool)  # codes are dense in first-appearance order: a new code tops all before it
    if n > 1:
        new[1:] = codes[1:] > (np.maximum.accumulate(codes) if peak is None else peak)[:-1]
    return _Codes(codes, np.flatnonzero(new), values)


def _int_codes(arr: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
    """Dense codes of int ids in order of first appearance: the ids themselves when they are such
    codes already (0, then each new id one above all before it: ``np.repeat(arange(P), G)``), else
    one stable sort (``_sort.stable_argsort``; ``np.unique`` with return_index/inverse sorted twice).
    With the codes, their running maximum when it was computed (the ids' own), else None. ``arr`` is
    the caller's own copy: int64 ids that are codes already are returned, not copied again."""
    n = arr.size
    if n and arr[0] == 0:
        peak = np.maximum.accumulate(arr)
        if (arr[1:] <= peak[:-1] + 1).all() and arr.min() >= 0:
            return (arr if arr.dtype == np.int64 else arr.astype(np.int64)), peak
    order = stable_argsort(arr)
    srt = arr[order]
    start = np.ones(n, dtype=bool)
    start[1:] = srt[1:] != srt[:-1]
    group = np.cumsum(start) - 1                   # group of each sorted position
    first = order[start]                           # each group's first sample (the sort is stable)
    rank = np.empty(first.size, dtype=np.int64)
    rank[np.argsort(first)] = np.arange(first.size, dtype=np.int64)  # distinct keys: any sort is stable
    codes = np.empty(n, dtype=np.int64)
    codes[order] = rank[group]
    return codes, None


def _id_kind(name: str, values: list[Any], types: set[type]) -> str:
    """'int' or 'str' (ints mixed with strings count as strings) for a list of ids (``types``:
    their types); anything else is refused naming the first bad entry."""
    ints = {t for t in types if issubclass(t, (int, np.integer)) and not issubclass(t, (bool, np.bool_))}
    strs = {t for t in types if issubclass(t, str)}
    if types == ints | strs:
        return "str" if strs else "int"
    for i, v in enumerate(values):
        if isinstance(v, float) and v != v:
            raise PlanError(f"{name}[{i}] is NaN; ids must be ints or strings: pass one int or str id per sample.")
        if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, str, np.integer)):
            raise PlanError(f"{name}[{i}]={v!r} must be an int or a string: pass one int or str id per sample.")
    raise AssertionError("unreachable: every type was int or str")  # pragma: no cover


class Batch:
    """Per-sample lengths and group ids of one training batch (binding API).

    Args:
        seq_lens: tokens each sample occupies when packed (prompt + response); ints >= 1.
        loss_tokens: tokens of each sample that carry loss (the response-mask sum),
            ``0 <= loss_tokens <= seq_lens``. Default: the tokens a causal LM can predict —
            ``seq_lens - prompt_lens`` when ``prompt_lens`` is given, else ``seq_lens - 1`` (the
            first token of a sample is never predicted), which is what
            ``microplan.torch.pack_micro``'s default mask (the last ``loss_tokens`` positions)
            accepts. With ``prompt_lens`` 0 the first token would carry loss and ``pack_micro``
            refuses it: give such samples ``prompt_lens >= 1``.
        prompt_lens: prompt tokens per sample, ``0 <= prompt_lens <= seq_lens`` (optional).
        prompt_ids: one id (int or str) per sample; samples sharing it come from one prompt
            (a GRPO group). Default: each rollout is its own prompt.
        rollout_ids: one id per sample; samples sharing it are one rollout (the turns of a
            step-wise trajectory). A rollout belongs to exactly one prompt and never spans two
            optimizer steps. Default: every sample is its own rollout.
        vision_tokens: optional, patches each sample's images/videos feed the vision encoder
            (ints >= 0; 0 for text-only samples). Capped per micro-batch by
            ``PlanConfig.max_vision_tokens_per_micro`` and costed by ``PlanConfig.vision_cost``.
            The LLM tokens the patches become are part of ``seq_lens`` as usual.
        num_images: optional, images (or video clips) per sample, each a separate ViT attention
            window of ``vision_tokens / num_images`` patches. Default: 1 where a sample has
            patches, else 0.
        prefix_parent / shared_prefix_lens: shared prefixes (give both or neither): sample i's
            first ``shared_prefix_lens[i]`` tokens equal those of sample ``prefix_parent[i]``,
            an earlier sample (-1: none, with 0 shared). The samples form a forest of prefix
            trees (a GRPO group's prompt, the turns of an append-only trajectory, branching
            agent rollouts); ``PlanConfig(share_prefixes=True)`` packs each shared token once.
            :func:`microplan.find_shared_prefixes` builds the pair from token ids.
        rank_of: the data-parallel rank that already holds each sample (ints >= 0), for
            ``PlanConfig(placement="local")``: such a plan never moves a sample off its rank.
            Ignored by global placement. Default None (no owner known).

    Attributes:
        prompt_codes / rollout_codes: int64 dense codes (0, 1, ...) in order of first appearance.
        num_samples, num_prompts, num_rollouts, total_tokens.
    """

    __slots__ = ("seq_lens", "loss_tokens", "prompt_lens", "prompt_codes", "rollout_codes",
                 "_prompt_ids", "_rollout_ids", "vision_tokens", "num_images", "prefix_parent", "shared_prefix_lens", "rank_of")

    def __init__(self, seq_lens: Sequence[int] | np.ndarray, *,
                 loss_tokens: Sequence[int] | np.ndarray | None = None,
                 prompt_lens: Sequence[int] | np.ndarray | None = None,
                 prompt_ids: Sequence[Any] | np.ndarray | None = None,
                 rollout_ids: Sequence[Any] | np.ndarray | None = None,
                 vision_tokens: Sequence[int] | np.ndarray | None = None,
                 num_images: Sequence[int] | np.ndarray | None = None,
                 prefix_parent: Sequence[int] | np.ndarray | None = None,
                 shared_prefix_lens: Sequence[int] | np.ndarray | None = None,

                 rank_of: Sequence[int] | np.ndarray | None = None) -> None:
        lens = _ints("seq_lens", seq_lens, minimum=1)
        n = lens.size
        plens = None
        if prompt_lens is not None:
            plens = _ints("prompt_lens", prompt_lens, minimum=0)
            _same_length("prompt_lens", plens, n)
            over = plens > lens
            if over.any():
                i = int(np.flatnonzero(over)[0])
                raise PlanError(f"prompt_lens[{i}]={plens[i]} exceeds seq_lens[{i}]={lens[i]}; seq_lens counts "
                                "prompt + response tokens, so lower prompt_lens or fix seq_lens.")
        if loss_tokens is None:
            lt = lens - plens if plens is not None else lens - 1  # a causal LM never predicts token 0
            lt.setflags(write=False)
        else:
            lt = _ints("loss_tokens", loss_tokens, minimum=0)
            _same_length("loss_tokens", lt, n)
            over = lt > lens
            if over.any():
                i = int(np.flatnonzero(over)[0])
                raise PlanError(f"loss_tokens[{i}]={lt[i]} exceeds seq_lens[{i}]={lens[i]}; a sample cannot carry "
                                "loss on more tokens than it has: pass the response-mask sum as loss_tokens, or fix "
                                "seq_lens.")
        if rollout_ids is None:
            rcodes, rfirst, rids = np.arange(n, dtype=np.int64), np.arange(n, dtype=np.int64), None
        else:
            rcodes, rfirst, rids = _factorize("rollout_ids", rollout_ids, n)
        if prompt_ids is None:
            pcodes, pids = rcodes.copy(), None
        else:
            pcodes, _, pids = _factorize("prompt_ids", prompt_ids, n)
            _check_rollouts_in_one_prompt(rcodes, rfirst, pcodes, rids)
        for a in (rcodes, pcodes):
            a.setflags(write=False)
        self.seq_lens = lens
        self.loss_tokens = lt
        self.prompt_lens = plens
        self.prompt_codes = pcodes
        self.rollout_codes = rcodes
        self._prompt_ids = pids
        self._rollout_ids = rids
        self.vision_tokens, self.num_images = _vision(vision_tokens, num_images, n)
        self.prefix_parent, self.shared_prefix_lens = _prefixes(prefix_parent, shared_prefix_lens, lens)
        self.rank_of = _owners(rank_of, n)

    def with_rank_of(self, rank_of: Sequence[int] | np.ndarray | None) -> Batch:
        """This batch with each sample's owner rank set (or cleared with None); nothing else re-checked."""
        out = object.__new__(Batch)
        for name in Batch.__slots__:
            object.__setattr__(out, name, getattr(self, name))
        out.rank_of = _owners(rank_of, self.num_samples)
        return out

    @property
    def prompt_ids(self) -> list[Any] | None:
        """Each sample's prompt id as given, a plain int or str (JSON-ready); None when not given."""
        if isinstance(self._prompt_ids, np.ndarray):  # int ids: listed on first read (16k ids: ~0.4 ms)
            self._prompt_ids = self._prompt_ids.tolist()
        return self._prompt_ids

    @property
    def rollout_ids(self) -> list[Any] | None:
        """Each sample's rollout id as given, a plain int or str (JSON-ready); None when not given."""
        if isinstance(self._rollout_ids, np.ndarray):
            self._rollout_ids = self._rollout_ids.tolist()
        return self._rollout_ids

    # -- derived sizes -------------------------------------------------------------------
    @property
    def num_samples(self) -> int:
        return int(self.seq_lens.size)

    @property
    def num_prompts(self) -> int:
        return int(self.prompt_codes.max()) + 1 if self.num_samples else 0

    @property
    def num_rollouts(self) -> int:
        return int(self.rollout_codes.max()) + 1 if self.num_samples else 0

    @property
    def has_prefixes(self) -> bool:
        """True when the batch declares shared prefixes (``prefix_parent``)."""
        return self.prefix_parent is not None

    @property
    def total_tokens(self) -> int:
        return int(self.seq_lens.sum())

    @property
    def has_vision(self) -> bool:
        """True when the batch carries vision tokens (``vision_tokens`` given)."""
        return self.vision_tokens is not None

    def __len__(self) -> int:
        return self.num_samples

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Batch):
            return NotImplemented
        return (np.array_equal(self.seq_lens, other.seq_lens)
                and np.array_equal(self.loss_tokens, other.loss_tokens)
                and _opt_equal(self.prompt_lens, other.prompt_lens)
                and np.array_equal(self.prompt_codes, other.prompt_codes)
                and np.array_equal(self.rollout_codes, other.rollout_codes)
                and self.prompt_ids == other.prompt_ids
                and self.rollout_ids == other.rollout_ids
                and _opt_equal(self.vision_tokens, other.vision_tokens)
                and _opt_equal(self.num_images, other.num_images)
                and _opt_equal(self.prefix_parent, other.prefix_parent)
                and _opt_equal(self.shared_prefix_lens, other.shared_prefix_lens)

                and _opt_equal(self.rank_of, other.rank_of))

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return (f"Batch(num_samples={self.num_samples}, total_tokens={self.total_tokens}, "
                f"num_prompts={self.num_prompts}, num_rollouts={self.num_rollouts})")

    # -- serialisation -------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict that :meth:`from_dict` turns back into an equal Batch.

        ``rank_of`` appears only when set, so a batch without owners serialises (and fingerprints)
        exactly as before owners existed.
        """
        d = {
            "seq_lens": self.seq_lens.tolist(),
            "loss_tokens": self.loss_tokens.tolist(),
            "prompt_lens": None if self.prompt_lens is None else self.prompt_lens.tolist(),
            "prompt_ids": self.prompt_ids,
            "rollout_ids": self.rollout_ids,
            **({} if self.prefix_parent is None else {
                "prefix_parent": self.prefix_parent.tolist(),
                "shared_prefix_lens": self.shared_prefix_lens.tolist()}),  # type: ignore[union-attr]
        }
        if self.vision_tokens is not None:  # only when present: older readers see the same keys
            d["vision_tokens"] = self.vision_tokens.tolist()
            d["num_images"] = self.num_images.tolist()  # type: ignore[union-attr]
        if self.rank_of is not None:
            d["rank_of"] = self.rank_of.tolist()
        return d

    def fingerprint(self) -> str:
        """SHA-256 hex digest of the canonical JSON of :meth:`to_dict`: equal batches, equal digests."""
        text = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"), allow_nan=False)
        return hashlib.sha256(text.encode()).hexdigest()

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Batch:
        """Inverse of :meth:`to_dict`, checked like the constructor (a float or an out-of-range
        length is a PlanError, never an OverflowError or a silent truncation)."""
        return cls(d["seq_lens"], loss_tokens=d["loss_tokens"],
                   prompt_lens=d.get("prompt_lens"), prompt_ids=d.get("prompt_ids"),
                   rollout_ids=d.get("rollout_ids"), vision_tokens=d.get("vision_tokens"),
                   num_images=d.get("num_images"), prefix_parent=d.get("prefix_parent"),
                   shared_prefix_lens=d.get("shared_prefix_lens"), rank_of=d.get("rank_of"))


def _vision(vision_tokens: Any, num_images: Any, n: int) -> tuple[np.ndarray | None, np.ndarray | None]:
    """Validated (vision_tokens, num_images), or (None, None) for a text-only batch."""
    if vision_tokens is None:
        if num_images is not None:
            raise PlanError("num_images was given without vision_tokens; pass vision_tokens (patches per sample) "
                            "too, or drop num_images.")
        return None, None
    v = _ints("vision_tokens", vision_tokens, minimum=0)
    _same_length("vision_tokens", v, n)
    if num_images is None:
        imgs = (v > 0).astype(np.int64)
        imgs.setflags(write=False)
    else:
        imgs = _ints("num_images", num_images, minimum=0)
        _same_length("num_images", imgs, n)
    bad = (imgs == 0) != (v == 0)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise PlanError(f"sample {i} has vision_tokens={int(v[i])} but num_images={int(imgs[i])}; a sample has "
                        "patches exactly when it has images: pass num_images >= 1 with its patches, or 0 with 0.")
    return v, imgs


def _prefixes(parent: Any, shared: Any, lens: np.ndarray) -> tuple[np.ndarray | None, np.ndarray | None]:
    """Validate the declared prefix forest: parents earlier, shared lengths within both samples."""
    if parent is None and shared is None:
        return None, None
    if parent is None or shared is None:
        given, missing = ("prefix_parent", "shared_prefix_lens") if shared is None else \
            ("shared_prefix_lens", "prefix_parent")
        raise PlanError(f"Batch got {given} without {missing}; pass both (microplan.find_shared_prefixes(token_ids) "
                        "returns the pair), or neither.")
    n = lens.size
    p = _ints("prefix_parent", parent, minimum=-1)
    s = _ints("shared_prefix_lens", shared, minimum=0)
    _same_length("prefix_parent", p, n)
    _same_length("shared_prefix_lens", s, n)
    idx = np.arange(n)
    late = p >= idx
    if late.any():
        i = int(np.flatnonzero(late)[0])
        raise PlanError(f"prefix_parent[{i}]={int(p[i])} is not an earlier sample; a sample's prefix parent must come "
                        f"before it in the batch (or be -1): reorder the batch or point at an earlier sample with "
                        "the same prefix.")
    orphan = (p < 0) & (s > 0)
    if orphan.any():
        i = int(np.flatnonzero(orphan)[0])
        raise PlanError(f"shared_prefix_lens[{i}]={int(s[i])} but prefix_parent[{i}] is -1; a sample with no parent "
                        "shares nothing: set its shared length to 0 or give it a parent.")
    has = p >= 0
    limit = np.where(has, np.minimum(lens, lens[np.where(has, p, 0)]), 0)
    over = s > limit
    if over.any():
        i = int(np.flatnonzero(over)[0])
        raise PlanError(f"shared_prefix_lens[{i}]={int(s[i])} exceeds sample {i} ({int(lens[i])} tokens) or its parent "
                        f"sample {int(p[i])} ({int(lens[p[i]])} tokens); a shared prefix lies within both samples: "
                        "lower it to at most the shorter length.")
    for a in (p, s):
        a.setflags(write=False)
    return p, s


def _owners(rank_of: Any, n: int) -> np.ndarray | None:
    if rank_of is None:
        return None
    arr = _ints("rank_of", rank_of, minimum=0)
    _same_length("rank_of", arr, n)
    return arr


def _same_length(name: str, arr: np.ndarray, n: int) -> None:
    if arr.size != n:
        raise PlanError(f"{name} has {arr.size} entries but seq_lens has {n}; pass one value per sample.")


def _opt_equal(a: np.ndarray | None, b: np.ndarray | None) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return np.array_equal(a, b)


def _check_rollouts_in_one_prompt(rcodes: np.ndarray, rfirst: np.ndarray, pcodes: np.ndarray,
                                  rollout_ids: list[Any] | np.ndarray | None) -> None:
    """``rfirst``: each rollout's first sample (codes are dense in first-appearance order)."""
    bad = pcodes[rfirst][rcodes] != pcodes
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        rid = rollout_ids[i] if rollout_ids is not None else i
        rid = rid.item() if isinstance(rid, np.generic) else rid
        raise PlanError(f"rollout {rid!r} spans two prompts (sample {i} has another prompt id than "
                        "the rollout's first sample); a rollout must belong to exactly one prompt — "
                        "fix prompt_ids or rollout_ids.")
