"""Logits memory: peak memory of per-token log-probs, full logits vs chunked, against the arithmetic.

Design note. One packed micro-batch of T tokens (real sample boundaries from ``pack_micro``),
hidden size H, vocabulary V, float32. Two recipes:

- full: ``token_logprobs(hidden @ W.T, packed)`` — the [T, V] logits plus logsumexp's [T, V]
  temporary; predicted peak ``logits_bytes(T, V)`` = 2·T·V·4 bytes;
- chunked: ``chunked_token_logprobs(hidden, W, packed, chunk_tokens=C)`` — predicted
  ``logits_bytes(C, V)`` whatever T.

Each is measured in a fresh process (spawn) as the rise of the peak resident set: VmRSS just
before the call, the kernel's peak counter reset (``/proc/self/clear_refs`` ← 5), VmHWM after;
"fwd" runs under ``torch.no_grad`` (a log-prob pass), "fwd+bwd" runs backward too (training;
the chunked path recomputes each slice in backward). CPU memory, not CUDA: the allocator and
kernels differ, the arithmetic does not. Linux only.

Run: ``python -m benchmarks.bench_logits [--quick]``. Prints the table and writes
``benchmarks/results/logits-<date>-<host>.json``.
"""

from __future__ import annotations

import argparse
import multiprocessing as mproc
import re
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make ``benchmarks`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._results import record  # noqa: E402

V, H = 32000, 256
MiB = 2 ** 20


def _status(key: str) -> int:
    text = Path("/proc/self/status").read_text()
    return int(re.search(rf"{key}:\s+(\d+) kB", text).group(1)) * 1024  # type: ignore[union-attr]


def _measure(args: tuple[int, int | None, bool]) -> dict:
    """In a fresh process: peak RSS rise and time of one log-prob computation."""
    T, chunk, backward = args
    import numpy as np
    import torch

    import microplan as mp
    from microplan.torch import chunked_token_logprobs, pack_micro, token_logprobs

    torch.manual_seed(0)
    torch.set_num_threads(1)
    lens = np.full(T // 512, 512)
    plan = mp.plan(mp.Batch(lens), mp.PlanConfig(dp_size=1, max_tokens_per_micro=T))
    packed = pack_micro(plan.steps[0].micros[0][0], [torch.randint(0, V, (512,)) for _ in lens])
    hidden = torch.randn(T, H, requires_grad=backward)
    weight = torch.randn(V, H, requires_grad=backward) * 0.02

    def run() -> torch.Tensor:
        if chunk is None:
            return token_logprobs(hidden @ weight.T, packed)
        return chunked_token_logprobs(hidden, weight, packed, chunk_tokens=chunk)

    with torch.no_grad():  # warm the kernels and thread pools at a small size first
        chunked_token_logprobs(hidden[:1024].detach(), weight.detach(), pack_micro(
            mp.plan(mp.Batch([512, 512]), mp.PlanConfig(dp_size=1, max_tokens_per_micro=1024)).steps[0].micros[0][0],
            [torch.randint(0, V, (512,))] * 2), chunk_tokens=256)
    base = _status("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")
    t = time.perf_counter()
    if backward:
        run().sum().backward()
    else:
        with torch.no_grad():
            run()
    dt = time.perf_counter() - t
    return dict(T=T, chunk=chunk, backward=backward, peak_bytes=_status("VmHWM") - base, seconds=dt,
                predicted_bytes=mp.logits_bytes(T if chunk is None else min(chunk, T), V))


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="T = 4096 only")
    ap.add_argument("--no-write", action="store_true", help="print only")
    args = ap.parse_args(argv)
    Ts = (4096,) if args.quick else (4096, 8192)
    cases = [(T, c, bw) for T in Ts for bw in (False, True) for c in (None, 2048, 512)]
    ctx = mproc.get_context("spawn")
    rows = []
    for case in cases:
        with ctx.Pool(1) as pool:
            rows.append(pool.apply(_measure, (case,)))
    print(f"V={V}, H={H}, float32; peak = rise of the process's peak RSS during the call (fresh process each)")
    print(f"{'T':>6s} {'pass':>8s} {'recipe':>14s} {'peak MiB':>9s} {'predicted MiB':>14s} {'peak/pred':>9s} {'s':>6s}")
    for r in rows:
        recipe = "full logits" if r["chunk"] is None else f"chunks of {r['chunk']}"
        print(f"{r['T']:6d} {'fwd+bwd' if r['backward'] else 'fwd':>8s} {recipe:>14s} {r['peak_bytes'] / MiB:9.1f} "
              f"{r['predicted_bytes'] / MiB:14.1f} {r['peak_bytes'] / r['predicted_bytes']:9.2f} {r['seconds']:6.2f}")
    return record("logits", write=not args.no_write, quick=args.quick, V=V, H=H, rows=rows)


if __name__ == "__main__":
    main()
