"""A small transformers Llama on CPU that times micro-batches, for benchmarks/bench_measured.py.

Design note. One float32 Llama with random weights, built from a config (nothing downloaded), runs
forward + backward of a packed micro-batch (``pack_micro`` → ``model(**p.model_inputs())`` →
``token_logprobs`` → ``weighted_loss`` → backward) under one of two attention backends:

- ``"sdpa-packed"``: transformers' sdpa on the packed row (restarting position ids, no attention
  mask). transformers builds a block-diagonal T×T mask, so a micro-batch of several samples costs
  T² attention; a lone sample (no restart) takes sdpa's causal path instead.
- ``"varlen"``: ``microplan.torch.register_attention()`` — sdpa per sample, Σ L².

:meth:`TimedModel.seconds` times one composition (its multiset of lengths; token ids do not
change the time) as the median of ``repeats`` runs with ``perf_counter`` and caches it per
backend, so a composition that several planners produce is run once: the timings a planner is
scored on are the same numbers for everyone. Trade-off: caching hides run-to-run jitter between
planners that share a micro-batch (fair), but each composition's time is one draw of the
machine's noise (median of ``repeats``) — on a shared machine, raise ``repeats``.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

import microplan as mp
from microplan.torch import PackedMicro, pack_micro, register_attention, time_call, token_logprobs, weighted_loss

__all__ = ["BACKENDS", "MODEL_CONFIG", "TimedModel", "SimulatedModel"]

#: The benchmark's model: a 4-layer Llama, hidden 256 (the shape issue 9 measured), GQA 4/2 heads.
MODEL_CONFIG: dict[str, Any] = dict(model_type="llama", vocab_size=2048, hidden_size=256, intermediate_size=704,
                                    num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                                    max_position_embeddings=16384, hidden_act="silu", tie_word_embeddings=False)

#: backend label -> what it is
BACKENDS = {"sdpa-packed": "transformers sdpa over the packed row (block-diagonal mask: T² per micro-batch)",
            "varlen": "microplan.torch.register_attention(): sdpa per sample (Σ L² per micro-batch)"}


class TimedModel:
    """The benchmark's model, its backends and a per-composition timing cache (see the module note)."""

    def __init__(self, *, seed: int = 0, repeats: int = 1, config: dict[str, Any] | None = None) -> None:
        from transformers import LlamaConfig, LlamaForCausalLM

        self.config_dict = dict(MODEL_CONFIG if config is None else config)
        cfg = LlamaConfig(**{k: v for k, v in self.config_dict.items() if k != "model_type"},
                          attn_implementation="sdpa")
        torch.manual_seed(seed)
        self.model = LlamaForCausalLM(cfg).float().train()
        self.vocab = int(cfg.vocab_size)
        self.repeats = repeats
        self.backend = "sdpa-packed"
        self._impl = {"sdpa-packed": "sdpa", "varlen": register_attention()}
        self._cache: dict[tuple[str, tuple[int, ...]], float] = {}
        self._gen = torch.Generator().manual_seed(seed)
        self.runs = 0

    def use(self, backend: str) -> None:
        """Switch the attention backend (same weights)."""
        self.model.set_attn_implementation(self._impl[backend])
        self.backend = backend

    def run(self, p: PackedMicro) -> None:
        """One forward + backward of a packed micro-batch (the ``run_micro`` of ``profile_cost``)."""
        logits = self.model(**p.model_inputs(), use_cache=False).logits
        weighted_loss(-token_logprobs(logits, p), p).backward()
        for q in self.model.parameters():
            q.grad = None
        self.runs += 1

    def pack(self, lens: Sequence[int]) -> PackedMicro:
        """A micro-batch of random tokens with these sample lengths (empty: a 1-token placeholder)."""
        lens = [int(x) for x in lens]
        if not lens:
            return pack_micro(mp.Micro.placeholder(), [])
        toks = [torch.randint(0, self.vocab, (n,), generator=self._gen) for n in lens]
        n = len(lens)
        micro = mp.Micro(np.arange(n), lens, [L - 1 for L in lens], np.ones(n))
        return pack_micro(micro, toks)

    def seconds(self, lens: Sequence[int]) -> float:
        """Measured forward+backward seconds of one composition (median of ``repeats``; cached)."""
        key = (self.backend, tuple(sorted(int(x) for x in lens)))
        if key not in self._cache:
            p = self.pack(lens)
            self._cache[key] = statistics.median(time_call(lambda: self.run(p), device="cpu", clock=time.perf_counter)
                                                 for _ in range(self.repeats))
        return self._cache[key]

    def time_plan(self, lens_plan: Sequence[Sequence[Sequence[int]]]) -> list[list[float]]:
        """``t[r][m]`` for a plan given as the sample lengths of each rank's micro-batches."""
        return [[self.seconds(m) for m in row] for row in lens_plan]

    def warm(self, cap: int) -> None:
        """Untimed runs (allocator, kernels) of the current backend: one cap-long sample and one pack."""
        for lens in ([cap], [max(1, cap // 8)] * 8, [16]):
            self.run(self.pack(lens))

    @property
    def cached(self) -> int:
        return len(self._cache)


class SimulatedModel:
    """A noise-free stand-in for :class:`TimedModel` (``bench_measured --simulate``): no compute.

    Its time is shaped like this model measured on the 2-core CPU (1 thread, docs/cost.md):
    ``linear·T + per_micro`` plus attention — varlen: ``q_causal·Σ L²``; sdpa-packed: ``q_causal·L²``
    for a lone sample (sdpa's causal path) and ``q_masked·T²`` for a pack (the masked path computes
    every pair; ``lone_discount=False`` prices a lone sample like a pack, which is what the
    four-feature cost model can express). It separates what the planners do from a shared
    machine's noise.
    """

    LINEAR, Q_CAUSAL, Q_MASKED, PER_MICRO = 3.3e-4, 1.3e-7, 2.3e-7, 0.015

    def __init__(self, *, config: dict[str, Any] | None = None, lone_discount: bool = True) -> None:
        self.config_dict = dict(MODEL_CONFIG if config is None else config)
        self.lone_discount = lone_discount
        self.vocab = int(self.config_dict["vocab_size"])
        self.backend = "sdpa-packed"
        self.now = 0.0
        self.runs = 0
        self.compute_seconds = 0.0
        self._seen: set[tuple[str, tuple[int, ...]]] = set()

    def use(self, backend: str) -> None:
        self.backend = backend

    def warm(self, cap: int) -> None:
        pass

    def clock(self) -> float:
        return self.now

    def seconds(self, lens: Sequence[int]) -> float:
        m = [int(x) for x in lens] or [1]
        T = sum(m)
        if self.backend == "varlen" or (len(m) == 1 and self.lone_discount):
            att = self.Q_CAUSAL * sum(L * L for L in m)
        else:
            att = self.Q_MASKED * T * T
        t = self.LINEAR * T + att + self.PER_MICRO
        key = (self.backend, tuple(sorted(m)))
        if key not in self._seen:
            self._seen.add(key)
            self.compute_seconds += t
            self.runs += 1  # what a real run of each composition once would take
        return t

    def run(self, p: PackedMicro) -> None:
        t = self.seconds(p.seq_lens)
        self.now += t
        self.compute_seconds += t
        self.runs += 1

    def time_plan(self, lens_plan: Sequence[Sequence[Sequence[int]]]) -> list[list[float]]:
        return [[self.seconds(m) for m in row] for row in lens_plan]

    @property
    def cached(self) -> int:
        return len(self._seen)
