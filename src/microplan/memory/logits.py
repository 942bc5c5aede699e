"""Logits memory: how many tokens a micro-batch may hold before its logits alone fill the GPU.

Design note. A pass that materialises the logits of a micro-batch of T tokens holds a [T, V]
tensor: T × V × b bytes (b = 4 for float32 logits, V the vocabulary the GPU holds — V / TP under
a vocab-parallel LM head). Computing log-probs adds one more [T, V] temporary (the shifted
logits inside log-softmax / logsumexp), so the peak is 2 × T × V × b. Worked example (slime
#1951): a 205k-token micro-batch with Qwen's 151,936-token vocab split over TP = 2 holds
205,000 × 75,968 × 4 B = 62.3 GB = 58 GiB of float32 logits, twice that with the log-softmax.

The logits scale with the same T as ``max_tokens_per_micro`` (per GPU: a CP rank holds T/c
tokens' logits), so a second cap would be redundant: the token cap of a pass is
``min(activation cap, logits_token_cap(budget, V))`` — one number, as PlanConfig wants. With
chunked log-probs (``microplan.torch.chunked_token_logprobs``) the logits never exceed
2 × chunk × V × b bytes whatever T, and this cap sizes the chunk instead.
"""

from __future__ import annotations

from .._checks import int_field
from ..errors import PlanError

__all__ = ["logits_bytes", "logits_token_cap"]


def _per_token(vocab_size: int, bytes_per_element: int, log_softmax_copy: bool) -> int:
    v = int_field("vocab_size", vocab_size, minimum=1)
    b = int_field("bytes_per_element", bytes_per_element, minimum=1)
    if not isinstance(log_softmax_copy, bool):
        raise PlanError(f"log_softmax_copy={log_softmax_copy!r} must be a bool: True when the log-softmax "
                        "temporary is held beside the logits (the default recipe), False when it is fused.")
    return v * b * (2 if log_softmax_copy else 1)


def logits_bytes(tokens: int, vocab_size: int, *, bytes_per_element: int = 4, log_softmax_copy: bool = True) -> int:
    """Bytes of the logits of ``tokens`` tokens: tokens × vocab_size × bytes_per_element (× 2 with
    the log-softmax copy). ``vocab_size``: the vocabulary one GPU holds (V / TP if vocab-parallel)."""
    t = int_field("tokens", tokens, minimum=0)
    return t * _per_token(vocab_size, bytes_per_element, log_softmax_copy)


def logits_token_cap(memory_bytes: int, vocab_size: int, *, bytes_per_element: int = 4,
                     log_softmax_copy: bool = True) -> int:
    """The most tokens whose logits fit in ``memory_bytes``: ⌊memory / (V · b · copies)⌋.

    Args:
        memory_bytes: the GPU memory you allow the logits (e.g. ``16 * 2**30``).
        vocab_size: the vocabulary one GPU holds (V / TP under a vocab-parallel LM head).
        bytes_per_element: 4 for float32 logits (the usual upcast), 2 for bf16.
        log_softmax_copy: count the [T, V] temporary of log-softmax (True: the unfused recipe).

    Use ``min(activation_cap, logits_token_cap(...))`` as ``max_tokens_per_micro``.
    Raises PlanError when not even one token fits.
    """
    m = int_field("memory_bytes", memory_bytes, minimum=1)
    per = _per_token(vocab_size, bytes_per_element, log_softmax_copy)
    cap = m // per
    if cap < 1:
        raise PlanError(f"memory_bytes={m} holds the logits of no token ({per} bytes per token at "
                        f"vocab_size={vocab_size}); raise the budget or compute log-probs in chunks "
                        "(microplan.torch.chunked_token_logprobs).")
    return cap
