"""The policy on megatron-core: parallel set-up, log-probs from vocab-parallel logits, the GRPO update.

Importing this package applies the CPU compatibility layer first (a no-op on GPU machines), because it
must run before megatron-core is imported.
"""

from grpo_core import cpu_compat

cpu_compat.apply()
