"""Per-sample loss scales that make a step's summed, reduced gradient exactly ∇J.

Design note. Every loss mode of DESIGN.md is linear in the per-token losses: J = Σ_i c_i Σ_t ℓ_{i,t}
with one coefficient per sample. The training code computes Σ_j loss_scale_j Σ_t ℓ_{j,t} per
micro-batch and calls backward; the engine then (optionally) divides by K and averages over W
ranks. So ``loss_scale = c · W · (K if engine_divides_by_micro_count else 1)`` undoes exactly
what the engine does, whatever the packing. Denominators (|S|, |P|, |R|, Σ n) count the real
samples of the step only — placeholders and dropped samples never enter. A sample with no loss
tokens gets 0; a group whose loss tokens sum to 0 contributes 0 (its term is 0/0) but still
counts in |P| or |R|, as it does in the objective. Cost: O(n) numpy.
"""

from __future__ import annotations

import numpy as np

from ..config import Loss

__all__ = ["loss_coefficients", "loss_scales"]


def _group_mean(codes: np.ndarray, n: np.ndarray) -> np.ndarray:
    """c_i = 1 / (#groups · tokens of i's group) for groups with tokens, else 0."""
    _, inv = np.unique(codes, return_inverse=True)
    tok = np.bincount(inv, weights=n)
    num_groups = tok.size
    with np.errstate(divide="ignore"):
        per = np.where(tok > 0, 1.0 / (num_groups * tok), 0.0)
    return per[inv]


def loss_coefficients(loss: Loss, loss_tokens: np.ndarray, prompt_codes: np.ndarray,
                      rollout_codes: np.ndarray) -> np.ndarray:
    """c_i of J = Σ_i c_i Σ_t ℓ_{i,t} for the real samples of ONE step (arrays aligned)."""
    n = loss_tokens.astype(np.float64)
    S = n.size
    has = n > 0
    mode = loss.mode
    if S == 0:
        return np.zeros(0)
    if mode == "token-mean":
        total = n.sum()
        c = 1.0 / total if total > 0 else 0.0  # one value for every sample (broadcast by the where below)
    elif mode == "token-sum":
        c = np.ones(S)
    elif mode == "seq-mean-token-sum":
        c = np.full(S, 1.0 / S)
    elif mode == "seq-mean-token-mean":
        c = np.divide(1.0, S * n, out=np.zeros(S), where=has)
    elif mode == "seq-mean-token-sum-norm":
        assert loss.norm_constant is not None  # Loss.__post_init__ requires it for this mode
        c = np.full(S, 1.0 / (S * loss.norm_constant))
    elif mode == "prompt-mean":
        c = _group_mean(prompt_codes, n)
    elif mode == "rollout-mean":
        c = _group_mean(rollout_codes, n)
    else:  # pragma: no cover - Loss validates the mode
        raise AssertionError(mode)
    return np.where(has, c, 0.0)


def loss_scales(loss: Loss, coefficients: np.ndarray, *, grad_world: int, micro_count: int) -> np.ndarray:
    """loss_scale = c · W · (K if the engine divides each micro loss by K else 1)."""
    W = grad_world if loss.grad_reduction == "mean" else 1
    k = micro_count if loss.engine_divides_by_micro_count else 1
    return coefficients * float(W * k)
