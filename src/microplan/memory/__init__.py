"""GPU memory: what a micro-batch adds (:class:`MemoryModel`) and what its logits hold.

``model.py``: the memory model (binding ``MemoryModel``); ``hf.py``: its derivation from a
Hugging Face config; ``logits.py``: logits bytes and the token cap they allow; ``check.py``: the
bytes of the planner's micro-batches (the footprint stage's byte side), the byte cap of a plan;
``plan.py``: planning against a byte budget; ``fit.py``: fitting measured peaks;
``meter.py``: the online ``MemoryMeter``; ``config.py``: the PlanConfig fields.
"""

from .logits import logits_bytes, logits_token_cap
from .meter import MemoryMeter
from .model import GiB, MemoryModel, memory_from_dict

__all__ = ["MemoryModel", "MemoryMeter", "memory_from_dict", "logits_bytes", "logits_token_cap", "GiB"]
