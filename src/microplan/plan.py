"""The Plan: a global, deterministic, JSON-serialisable layout every rank can recompute.

``Plan`` holds the batch and config it was made from, so it can re-check itself
(:meth:`Plan.validate`), round-trip through JSON exactly (:meth:`to_json`/:meth:`from_json`) and
hash itself (:meth:`fingerprint`, SHA-256 of the canonical JSON: identical on every rank and
process that planned the same inputs).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from functools import cached_property
from typing import Any

import numpy as np

from .batch import Batch
from .config import PlanConfig
from .errors import PlanError
from .footprint import footprint_of, micro_footprint
from .plan_json import Where, check_lengths, field, index_array, number_array, rows_of, whole
from .prefix import RowRules, forest_of, micro_tree
from .stats import compute_stats
from .types import KChoice, Micro, PlanStats, Step
from .validate import validate_plan

__all__ = ["Plan", "FORMAT", "VERSION", "PLAN_KINDS"]

FORMAT = "microplan.plan"
VERSION = 2
_READS = (1, 2)  # version 1: no per-step K choice
PLAN_KINDS = ("train", "forward")  # "kind" in the JSON: absent only in plans written before it and the pipeline
#                                   fields (config without "pipeline_stages"), which read as "train"


class Plan:
    """The layout of one batch (binding API).

    Attributes:
        steps: list of :class:`Step`; ``steps[s].micros[rank][m]`` is a :class:`Micro`.
        dropped: int64 sorted global indices of samples that train in no step.
        drop_reasons: ``{sample index: reason}`` for every dropped sample.
        batch, config: the inputs the plan was made from.
        kind: ``"train"`` (:func:`microplan.plan`: loss scales make the gradient exact) or
            ``"forward"`` (:func:`microplan.plan_forward`: a forward-only pass, every loss scale 0).
    """

    def __init__(self, *, batch: Batch, config: PlanConfig, steps: list[Step],
                 dropped: np.ndarray, drop_reasons: dict[int, str], kind: str = "train") -> None:
        if kind not in PLAN_KINDS:
            raise PlanError(f"Plan kind={kind!r} must be one of {', '.join(PLAN_KINDS)}.")
        self.kind = kind
        self.batch = batch
        self.config = config
        self.steps = list(steps)
        d = np.array(sorted(int(i) for i in dropped), dtype=np.int64)
        d.setflags(write=False)
        self.dropped = d
        self.drop_reasons = {int(k): str(v) for k, v in sorted(drop_reasons.items())}

    # -- views ---------------------------------------------------------------------------------
    def rank(self, r: int) -> list[tuple[Micro, ...]]:
        """Rank ``r``'s micro-batches, step by step: ``plan.rank(r)[s][m]``."""
        if not 0 <= r < self.config.dp_size:
            raise PlanError(f"rank {r} is outside 0..{self.config.dp_size - 1} (dp_size={self.config.dp_size}); "
                            "pass this process's data-parallel rank.")
        return [step.micros[r] for step in self.steps]

    @cached_property
    def stats(self) -> PlanStats:
        """Predicted times, bounds and counts (computed once, on first access)."""
        return compute_stats(self.batch, self.config, self.steps, self.dropped, forward=self.kind == "forward")

    def validate(self) -> None:
        """Re-check every invariant of DESIGN.md; raise PlanError naming the first violation."""
        validate_plan(self.batch, self.config, self.steps, self.dropped, self.drop_reasons,
                      forward=self.kind == "forward")

    # -- equality and serialisation --------------------------------------------------------------
    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Plan):
            return NotImplemented
        return (self.kind == other.kind and self.config == other.config and self.batch == other.batch
                and self.steps == other.steps
                and np.array_equal(self.dropped, other.dropped) and self.drop_reasons == other.drop_reasons)

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        """One line that fits a screen; :meth:`summary` has the whole picture."""
        from .summary import short_repr
        return short_repr(self)

    def summary(self) -> str:
        """The readable summary the CLI prints (binding): units named, every term in a legend."""
        from .summary import format_summary
        return format_summary(self)

    def to_dict(self) -> dict[str, Any]:
        return {**self._head(), "steps": [[[m.to_dict() for m in row] for row in step.micros] for step in self.steps]}

    def _head(self) -> dict[str, Any]:
        """Every part of :meth:`to_dict` but the steps' micro-batches."""
        reasons: dict[str, list[int]] = {}
        for i, why in self.drop_reasons.items():
            reasons.setdefault(why, []).append(i)
        return {
            "format": FORMAT, "version": VERSION, "kind": self.kind,
            "batch": self.batch.to_dict(), "config": self.config.to_dict(),
            "choices": [None if step.choice is None else step.choice.to_dict() for step in self.steps],
            "dropped": self.dropped.tolist(),
            "drop_reasons": [[why, idx] for why, idx in reasons.items()],
        }

    def _json_chunks(self) -> Iterator[str]:
        """:meth:`to_json` (compact) in pieces, one rank's micro-batches at a time: their
        concatenation is exactly ``to_json()`` (JSON encodes part by part), without holding every
        micro-batch's dict at once — a plan of dp 1,000,000 would hold ~1M of them."""
        def dumps(v: Any) -> str:
            return json.dumps(v, sort_keys=True, separators=(",", ":"), allow_nan=False)
        head = self._head()
        yield "{"
        for n, key in enumerate(sorted([*head, "steps"])):
            yield ("," if n else "") + dumps(key) + ":"
            if key != "steps":
                yield dumps(head[key])
                continue
            yield "["
            for k, step in enumerate(self.steps):
                yield ("," if k else "") + "["
                for r, row in enumerate(step.micros):
                    yield ("," if r else "") + dumps([m.to_dict() for m in row])
                yield "]"
            yield "]"
        yield "}"

    def to_json(self, *, indent: int | None = None) -> str:
        """Canonical JSON (sorted keys); ``from_json(p.to_json()) == p`` exactly."""
        if indent is None:  # the compact form is the one the fingerprint hashes: one encoder for both
            return "".join(self._json_chunks())
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ": "), indent=indent, allow_nan=False)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Plan:
        """Inverse of :meth:`to_dict`; a damaged plan is a PlanError naming the field and its place
        (``microplan.plan_json``)."""
        if not isinstance(d, dict) or d.get("format") != FORMAT:
            raise PlanError(f"not a microplan plan: expected a JSON object with format={FORMAT!r}.")
        if d.get("version") not in _READS:
            raise PlanError(f"plan format version {d.get('version')!r} is not supported (this microplan reads "
                            f"version {VERSION}); re-plan with this version.")
        top = Where("(top level)")
        # "kind" came with the pipeline fields: a plan whose config has them but no kind was damaged
        cfg_d = d.get("config")
        older = d["version"] < 2 or (isinstance(cfg_d, dict) and "pipeline_stages" not in cfg_d)
        kind = "train" if older and "kind" not in d else field(d, "kind", top)
        if kind not in PLAN_KINDS:
            raise top.fail(f"field 'kind'={kind!r} must be one of {', '.join(map(repr, PLAN_KINDS))}")
        batch_d = field(d, "batch", top)
        for key in ("seq_lens", "loss_tokens"):
            check_lengths(field(batch_d, key, Where("batch")), key, Where("batch"))
        try:
            batch = Batch.from_dict(batch_d)
            config = PlanConfig.from_dict(field(d, "config", top))
        except PlanError:
            raise
        except (KeyError, TypeError, ValueError, IndexError, AttributeError) as exc:
            raise top.fail(f"its 'batch' or 'config' does not read ({type(exc).__name__}: {exc})") from None
        fp = footprint_of(batch, config)
        mfp = micro_footprint(fp)
        rules = fp.row_rules() if config.share_prefixes else None
        step_rows = rows_of(field(d, "steps", top), "steps", top)
        choices = d.get("choices") or [None] * len(step_rows)
        if not isinstance(choices, list) or len(choices) != len(step_rows):
            raise top.fail(f"field 'choices' must be a list of {len(step_rows)} entries, one per step")
        steps = []
        for s, rows in enumerate(step_rows):
            rows = rows_of(rows, "steps", Where(f"step {s}"))
            micros = [[_micro_from_dict(m, batch, rules, mfp,
                                        Where(f"step {s}, rank {r}, micro-batch {k}"))
                       for k, m in enumerate(rows_of(row, "steps", Where(f"step {s}, rank {r}")))]
                      for r, row in enumerate(rows)]
            idx = [m.indices for row in micros for m in row if m.cp_rank == 0]
            samples = np.sort(np.concatenate(idx)) if idx else np.zeros(0, dtype=np.int64)
            choice = None if choices[s] is None else _choice_from_dict(choices[s], Where(f"step {s}"))
            steps.append(Step(s, micros, samples, choice=choice))
        n = batch.num_samples
        dropped = index_array(field(d, "dropped", top), "dropped", top, n)
        reasons: dict[int, str] = {}
        for why, idx in rows_of(field(d, "drop_reasons", top), "drop_reasons", top):
            for i in index_array(idx, "drop_reasons", top, n):
                reasons[int(i)] = str(why)
        return cls(batch=batch, config=config, steps=steps, dropped=dropped, drop_reasons=reasons, kind=kind)

    @classmethod
    def from_json(cls, text: str) -> Plan:
        """Inverse of :meth:`to_json`. Raises PlanError on malformed input."""
        try:
            d = json.loads(text)
        except json.JSONDecodeError as exc:
            raise PlanError(f"plan is not valid JSON: {exc}") from None
        return cls.from_dict(d)

    def fingerprint(self) -> str:
        """SHA-256 hex digest of the canonical JSON (``to_json()``): equal plans give equal
        fingerprints anywhere. Hashed as it is encoded, one rank's micro-batches at a time."""
        h = hashlib.sha256()
        for chunk in self._json_chunks():
            h.update(chunk.encode())
        return h.hexdigest()


def _micro_from_dict(m: Any, batch: Batch, rules: RowRules | None, fp: Any, where: Where) -> Micro:
    lens, lt = batch.seq_lens, batch.loss_tokens
    idx = index_array(field(m, "indices", where), "indices", where, lens.size)
    scale = number_array(field(m, "loss_scale", where), "loss_scale", where, idx.size)
    cp_size = whole(field(m, "cp_size", where), "cp_size", where, minimum=1)
    cp_rank = whole(field(m, "cp_rank", where), "cp_rank", where)
    group = tuple(whole(g, "cp_group", where) for g in rows_of(field(m, "cp_group", where), "cp_group", where))
    tree = None
    if rules is not None and idx.size:  # the row is a pure function of the forest, the samples and the rules
        parent, sh = forest_of(batch)
        tree = micro_tree(parent, sh, lens, idx, rules=rules)
    try:
        return Micro(idx, lens[idx], lt[idx], scale, cp_size=cp_size, cp_rank=cp_rank, cp_group=group,
                     footprint=fp, tree=tree)
    except PlanError as exc:
        raise where.fail(str(exc).rstrip(".")) from None


def _choice_from_dict(c: Any, where: Where) -> KChoice:
    try:
        return KChoice.from_dict(c)
    except (KeyError, TypeError, ValueError) as exc:
        raise where.fail(f"field 'choices' does not read ({type(exc).__name__}: {exc})") from None
