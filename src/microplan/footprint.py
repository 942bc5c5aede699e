"""What a micro-batch occupies on the GPU: ONE function of its samples, used by every stage.

Design note. The cap (``max_tokens_per_micro``) bounds what the GPU holds, not the samples' own
tokens. A :class:`Footprint` turns a set of samples into that number, the shape the cost model
sees and, for the torch layer, where the padding goes. Three layouts (``PlanConfig.layout``):

- ``"varlen"``: one packed row. Each sample occupies ⌈L/m⌉·m tokens (``pad_to_multiple_of=m``:
  zigzag ring CP needs 2·cp, FP8/TE kernels 16) and the row is rounded up to a multiple of r
  (``pad_row_to_multiple_of=r``: sequence-parallel TP needs the row a multiple of tp). The
  footprint of samples S is ⌈Σ_S ⌈L/m⌉·m / r⌉·r.
- ``"padded"``: an ``[n, W]`` tensor, W = max L rounded up to lcm(m, r); footprint n·W.
- ``"padded-2d"``: ``[n, Wp + Wr]`` with prompts left-padded to the longest prompt and
  responses right-padded to the longest response (UniRL's dense 2D layout), the width rounded
  up to lcm(m, r); footprint n·(Wp + Wr). Needs ``Batch(prompt_lens=...)``.

The same footprint is the cap the packer respects, what :meth:`Plan.validate` checks, what
:attr:`Micro.num_tokens` reports and what ``Plan.stats.max_micro_tokens`` maximises (÷ cp_size
per GPU). The cost of a micro-batch is the binding ``micro_cost`` of its *shape*: the sequence
lengths the kernels run (varlen: each sample's padded length, plus the row's trailing pad as one
more sequence; padded: n rows of W). Vision tokens (``Batch(vision_tokens=...)``) are a second
resource with their own cap (``max_vision_tokens_per_micro``) and cost (``VisionCost``).

A row multiple is the same constraint as a lower cap for any additive packer:
⌈S/r⌉·r ≤ cap ⟺ S ≤ ⌊cap/r⌋·r, so varlen layouts reuse the planner's packers on padded sample
lengths under :func:`packing_cap`; padded layouts, whose footprint is not a sum over samples,
have their own stage (``stages/padded.py``). Prefix-shared micro-batches (``stages/atoms.py``)
occupy their trie's unique tokens and are priced from it directly. Trade-off: padded layouts
pay for their padding in tokens and lockstep time on long-tailed steps
(benchmarks/bench_layouts.py measures how much).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from ._intmath import cdiv, round_up
from .config import LAYOUTS, Layout, PlanConfig
from .errors import PlanError
from .fixes import too_long_fixes
from .prefix import RowRules
from .trie_sets import TrieSets

from .cost.models import bin_costs as _bin_costs
from .cost.models import row_costs

if TYPE_CHECKING:  # pragma: no cover
    from .batch import Batch
    from .cost.models import CostModel
    from .prefix import PrefixTree

__all__ = ["LAYOUTS", "Layout", "Padding", "Footprint", "footprint_of", "padding_of", "packing_cap", "round_up",
           "micro_footprint", "check_fits", "bin_footprint", "gpu_tokens"]



@dataclass(frozen=True)
class Padding:
    """The padding rules of a plan (from :class:`PlanConfig`): a value, shared by every Micro.

    Attributes:
        layout: ``"varlen"``, ``"padded"`` or ``"padded-2d"`` (see the module note).
        sample_multiple: ``pad_to_multiple_of``: every sample (varlen) or the row width (padded)
            is a multiple of it.
        row_multiple: ``pad_row_to_multiple_of``: the packed row (varlen) or the row width
            (padded) is a multiple of it.
    """

    layout: Layout = "varlen"
    sample_multiple: int = 1
    row_multiple: int = 1

    @property
    def padded(self) -> bool:
        """True for the ``[n, W]`` layouts."""
        return self.layout != "varlen"

    @property
    def width_multiple(self) -> int:
        """Padded layouts: the row width is a multiple of lcm(sample_multiple, row_multiple)."""
        return math.lcm(self.sample_multiple, self.row_multiple)

    @property
    def trivial(self) -> bool:
        """True for varlen without padding: the footprint is Σ seq_lens."""
        return self == Padding()

    def to_dict(self) -> dict[str, Any]:
        return {"layout": self.layout, "pad_to_multiple_of": self.sample_multiple,
                "pad_row_to_multiple_of": self.row_multiple}


class Footprint:
    """The tokens any set of samples of one batch occupies on the GPU, under one :class:`Padding`.

    Built once per plan (:func:`footprint_of`); every :class:`Micro` of the plan refers to it.
    Methods take GLOBAL sample indices. Vision tokens are reported apart (:meth:`vision`).
    """

    __slots__ = ("padding", "seq_lens", "prompt_lens", "vision_tokens", "vision_costs", "sample_tokens")

    def __init__(self, padding: Padding, seq_lens: np.ndarray, *, prompt_lens: np.ndarray | None = None,
                 vision_tokens: np.ndarray | None = None, vision_costs: np.ndarray | None = None) -> None:
        if padding.layout == "padded-2d" and prompt_lens is None:
            raise PlanError("layout='padded-2d' pads prompts and responses apart, so it needs each sample's "
                            "prompt length: pass Batch(..., prompt_lens=...), or use layout='padded'.")
        self.padding = padding
        self.seq_lens = seq_lens
        self.prompt_lens = prompt_lens if padding.layout == "padded-2d" else None
        self.vision_tokens = vision_tokens
        #: per-sample cost of the vision work (None without vision), added to every bin's cost
        self.vision_costs = vision_costs
        unit = padding.width_multiple if padding.padded else padding.sample_multiple
        st = round_up(seq_lens, unit) if unit > 1 else seq_lens
        st.setflags(write=False)
        #: tokens each sample occupies in a micro-batch of its own (varlen: before the row multiple)
        self.sample_tokens = st

    # -- one micro-batch ----------------------------------------------------------------------
    @property
    def padded(self) -> bool:
        return self.padding.padded

    def width(self, idx: np.ndarray) -> int:
        """Padded layouts: the row width W of a micro-batch holding ``idx`` (0 when empty)."""
        if not idx.size:
            return 0
        if self.prompt_lens is not None:
            p = self.prompt_lens[idx]
            w = int(p.max()) + int((self.seq_lens[idx] - p).max())
        else:
            w = int(self.seq_lens[idx].max())
        return int(round_up(w, self.padding.width_multiple))

    def row_pad(self, idx: np.ndarray) -> int:
        """Varlen: tokens of the trailing pad sequence that rounds the row up (0 when none)."""
        s = int(self.sample_tokens[idx].sum())
        return int(round_up(s, self.padding.row_multiple)) - s

    def tokens(self, idx: np.ndarray) -> int:
        """Tokens the GPU(s) hold for a micro-batch of these samples, padding included."""
        idx = np.asarray(idx, dtype=np.int64)
        if self.padded:
            return int(idx.size) * self.width(idx)
        return int(round_up(int(self.sample_tokens[idx].sum()), self.padding.row_multiple))

    def tree_tokens(self, tree: PrefixTree) -> int:
        """Tokens a tree row holds (``share_prefixes``): each trie segment (a run, or a sample of a
        row laid out flat) padded to the sample multiple, the row to the row multiple."""
        seg = tree.end - tree.start
        m = self.padding.sample_multiple
        body = int(round_up(seg, m).sum()) if m > 1 else int(seg.sum())
        return int(round_up(body, self.padding.row_multiple))

    def row_rules(self) -> RowRules:
        """What decides a tree row's layout (``prefix.flat_wins``): these padding multiples. (Under
        context parallel a GPU holds ⌈row/c⌉ rows, so a row no larger than flat is no larger per GPU.)"""
        return RowRules(self.padding.sample_multiple, self.padding.row_multiple)

    def vision(self, idx: np.ndarray) -> int:
        """Vision tokens (patches) of these samples (0 without vision)."""
        return 0 if self.vision_tokens is None else int(self.vision_tokens[np.asarray(idx, dtype=np.int64)].sum())

    # -- many micro-batches at once ------------------------------------------------------------
    def bin_tokens(self, idx: np.ndarray, bin_of: np.ndarray, num_bins: int) -> np.ndarray:
        """int64 footprint of each bin: samples ``idx[j]`` sit in bin ``bin_of[j]``."""
        count = np.bincount(bin_of, minlength=num_bins)
        if self.padded:
            return count * self._bin_width(idx, bin_of, num_bins)
        s = np.bincount(bin_of, weights=self.sample_tokens[idx], minlength=num_bins).astype(np.int64)
        return round_up(s, self.padding.row_multiple)

    def _bin_width(self, idx: np.ndarray, bin_of: np.ndarray, num_bins: int) -> np.ndarray:
        lens = self.seq_lens[idx]
        if self.prompt_lens is not None:
            p = self.prompt_lens[idx]
            w = _bin_max(p, bin_of, num_bins) + _bin_max(lens - p, bin_of, num_bins)
        else:
            w = _bin_max(lens, bin_of, num_bins)
        return round_up(w, self.padding.width_multiple)

    def sample_costs(self, cost: CostModel, idx: np.ndarray | None = None) -> np.ndarray:
        """Additive cost of each sample as the packer balances it: its occupied tokens, plus vision."""
        st = self.sample_tokens if idx is None else self.sample_tokens[idx]
        out = cost.sample_costs(st)
        if self.vision_costs is not None:
            out = out + (self.vision_costs if idx is None else self.vision_costs[idx])
        return out

    def bin_costs(self, cost: CostModel, idx: np.ndarray, bin_of: np.ndarray, num_bins: int) -> np.ndarray:
        """Predicted cost of each bin's shape (per_micro included; an empty bin costs per_micro)."""
        return self.bin_shape(cost, idx, bin_of, num_bins)[1]

    def bin_shape(self, cost: CostModel, idx: np.ndarray, bin_of: np.ndarray,
                  num_bins: int) -> tuple[np.ndarray, np.ndarray]:
        """(:meth:`bin_tokens`, :meth:`bin_costs`) of the bins, the shared sums taken once (varlen
        without a row multiple: no row pad, so no pad terms)."""
        count = np.bincount(bin_of, minlength=num_bins)
        if self.padded:
            tokens = count * self._bin_width(idx, bin_of, num_bins)
            w = np.where(count > 0, tokens // np.maximum(count, 1), 0)
            out = count * row_costs(cost, w.astype(np.float64), count)
            out = out + float(cost.per_micro)  # each row its own sequence: no packed row (a dense kernel runs every row alone)
        else:
            st = self.sample_tokens[idx]
            held = np.bincount(bin_of, weights=st, minlength=num_bins).astype(np.int64)
            additive = np.bincount(bin_of, weights=cost.sample_costs(st), minlength=num_bins)
            seqs = count
            tokens = held
            if self.padding.row_multiple > 1:  # the row pad runs as one more sequence of the packed row
                tokens = round_up(held, self.padding.row_multiple)
                pad = tokens - held
                additive = additive + np.where(pad > 0, cost.sample_costs(pad), 0.0)
                seqs = count + (pad > 0)
            out = _bin_costs(cost, additive, tokens.astype(np.float64), seqs)
        if self.vision_costs is not None:
            out = out + np.bincount(bin_of, weights=self.vision_costs[idx], minlength=num_bins)
        return tokens, out

    def same_rules(self, other: Footprint | None) -> bool:
        return self.padding == (other.padding if other is not None else Padding())


def _bin_max(values: np.ndarray, bin_of: np.ndarray, num_bins: int) -> np.ndarray:
    out = np.zeros(num_bins, dtype=np.int64)
    np.maximum.at(out, bin_of, values)
    return out


def padding_of(config: PlanConfig) -> Padding:
    """The :class:`Padding` rules of a config."""
    return Padding(config.layout, config.pad_to_multiple_of, config.pad_row_to_multiple_of)


def footprint_of(batch: Batch, config: PlanConfig) -> Footprint:
    """The footprint of ``batch`` under ``config``'s layout, padding rules and vision cost.

    Without ``config.vision_cost`` a patch costs like an LLM token of the cost model, each image
    one sequence: ``num_images · sample_costs(vision_tokens / num_images)``.
    """
    vc = None
    if batch.vision_tokens is not None:
        v, imgs = batch.vision_tokens, batch.num_images
        if config.vision_cost is not None:
            vc = config.vision_cost.sample_costs(v, imgs)
        else:
            per = v / np.maximum(imgs, 1)
            vc = np.where(imgs > 0, imgs * config.cost.sample_costs(per), 0.0)  # type: ignore[union-attr]
    return Footprint(padding_of(config), batch.seq_lens, prompt_lens=batch.prompt_lens,
                     vision_tokens=batch.vision_tokens, vision_costs=vc)


def packing_cap(config: PlanConfig) -> int | None:
    """The cap an additive packer checks Σ sample_tokens against (None for static batching).

    ``max_tokens_per_micro`` × static CP degree c (a GPU of the group computes ⌈U/c⌉ of a row of
    U tokens, :func:`gpu_tokens`), lowered to ⌊c·cap/r⌋·r with a row multiple r in the varlen
    layout (⌈S/r⌉·r ≤ c·cap ⟺ S ≤ ⌊c·cap/r⌋·r). Padded layouts pack with the plain c·cap.
    """
    if config.max_tokens_per_micro is None:
        return None
    cap = config.max_tokens_per_micro * config.static_cp_size
    r = config.pad_row_to_multiple_of
    if config.layout == "varlen" and r > 1:
        cap = cap // r * r
    return cap


def gpu_tokens(row_tokens: Any, cp_size: Any) -> Any:
    """Rows one GPU of a CP group of ``cp_size`` computes for a packed row of ``row_tokens`` tokens
    (flat or tree, its padding included): ⌈U/c⌉, the most the zigzag cut gives a member
    (``cp_cut.zigzag_owner``: counts differ by at most one), and all ``PackedMicro.cp_shard``
    computes — each owned row's logits score the tokens after it, so no row is computed twice.
    U itself when c = 1. Ints or int arrays. ⌈U/c⌉ ≤ cap ⟺ U ≤ c·cap: a group of c GPUs holds
    c × ``max_tokens_per_micro`` tokens.
    """
    c = np.asarray(cp_size)
    out = cdiv(np.asarray(row_tokens), np.maximum(c, 1))
    return int(out) if out.ndim == 0 else out


def micro_footprint(fp: Footprint) -> Footprint | None:
    """What a plan's Micros carry: None for a plain varlen row without vision (Σ seq_lens)."""
    return None if fp.padding.trivial and fp.vision_tokens is None else fp


def check_fits(fp: Footprint, config: PlanConfig, *, tokens: bool = True) -> None:
    """Refuse a sample that fits no micro-batch on its own, counting its padding (PlanError).
    ``tokens=False``: check only the vision cap (prefix trees check their tokens as atoms)."""
    cp = config.context_parallel
    if config.max_tokens_per_micro is None:
        return  # static batching has no token cap
    if not tokens:
        return _check_vision(fp, config)
    dyn = cp is not None and cp.dynamic  # dynamic CP: a sample may take up to max_size GPUs (stages/cp.py)
    width = int(cp.max_size) if dyn else config.static_cp_size  # type: ignore[union-attr]
    cap = config.max_tokens_per_micro * width
    r = fp.padding.row_multiple
    alone = fp.sample_tokens if fp.padded or r == 1 else round_up(fp.sample_tokens, r)
    if alone.size and int(alone.max()) > cap:  # a group of c GPUs holds c × cap: ⌈row/c⌉ ≤ cap (gpu_tokens)
        j = int(np.argmax(alone))
        where = f"max_tokens_per_micro={config.max_tokens_per_micro}" + \
            (f" × {'ContextParallel.max_size' if dyn else 'cp size'} {width} = {cap}" if width > 1 else "")
        pad = "" if int(alone[j]) == int(fp.seq_lens[j]) else \
            f" ({int(fp.seq_lens[j])} tokens padded to {int(alone[j])} by layout={fp.padding.layout!r}, " \
            f"pad_to_multiple_of={fp.padding.sample_multiple}, pad_row_to_multiple_of={fp.padding.row_multiple})"
        raise PlanError(f"sample {j} occupies {int(alone[j])} tokens{pad}, more than one micro-batch may hold "
                        f"({where}); {too_long_fixes(config, padded=bool(pad))}.")
    _check_vision(fp, config)


def _check_vision(fp: Footprint, config: PlanConfig) -> None:
    vcap = config.max_vision_tokens_per_micro
    if vcap is not None and fp.vision_tokens is not None and fp.vision_tokens.size and int(fp.vision_tokens.max()) > vcap:
        j = int(np.argmax(fp.vision_tokens))
        raise PlanError(f"sample {j} has {int(fp.vision_tokens[j])} vision tokens, more than one micro-batch may "
                        f"hold (max_vision_tokens_per_micro={vcap}); raise max_vision_tokens_per_micro or lower the "
                        "sample's image resolution / frame count.")


def bin_footprint(fp: Footprint, cost: CostModel, samples: np.ndarray, bin_of: np.ndarray, num_bins: int, *,
                  forest: tuple[np.ndarray, np.ndarray] | None = None,
                  rules: RowRules | None = None, tries: TrieSets | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(tokens, cost) of every bin of samples: the footprint the cap counts and the predicted cost.

    ``forest`` (``prefix.forest_of``): the bins hold prefix tries (``share_prefixes``) — unique
    tokens, each trie segment padded to the sample multiple, the row to the row multiple, the
    row pad run as one more sequence, attention priced by each token's depth; a row laid out
    flat where that is smaller (``prefix.flat_wins`` under the plan's ``rules``, ``Footprint.row_rules``;
    None: padding only). ``tries``: each bin's row as ``trie.row_tries`` counts it, when the caller
    has it (``stages/atoms.bin_tries``). Without ``forest``: the samples laid out under the
    layout's rules (:meth:`Footprint.bin_shape`).
    """
    if forest is None:
        return fp.bin_shape(cost, samples, bin_of, num_bins)
    if tries is None:
        from .trie import row_tries
        tries = row_tries(forest[0], forest[1], fp.seq_lens, samples, bin_of, num_bins,
                          rules=fp.row_rules() if rules is None else rules)
    U = tries.tokens
    tokens = round_up(U, fp.padding.row_multiple)
    pad = tokens - U
    add = cost.tree_costs(U.astype(np.float64), tries.depth_sq)  # type: ignore[attr-defined]
    add = add + np.where(pad > 0, cost.sample_costs(pad), 0.0)
    seqs = np.bincount(bin_of, minlength=num_bins) + (pad > 0)
    out = _bin_costs(cost, add, tokens.astype(np.float64), seqs)
    if fp.vision_costs is not None:
        out = out + np.bincount(bin_of, weights=fp.vision_costs[samples], minlength=num_bins)
    return tokens.astype(np.int64), out
