"""microplan inside the trainers people already run: one import or one call, the framework unchanged.

- :mod:`microplan.integrations.verl`: drop-ins for ``verl.utils.seqlen_balancing``
  (``rearrange_micro_batches``, ``prepare_dynamic_batch``, ``restore_dynamic_batch``,
  ``get_seqlen_balanced_partitions``) and ``install()`` to patch a running verl; exact loss
  weights for verl's loss aggregation modes.
- :mod:`microplan.integrations.trl`: a drop-in for TRL's ``split_tensor_dict`` (the GRPO trainer's
  gradient-accumulation split).

Each framework is an optional import: ``import microplan`` never imports it, and these modules
import it only inside the functions that need its types.
"""
