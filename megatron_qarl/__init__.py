"""megatron-qarl: rollout-aligned quantization-aware RL (QaRL) with TBPO on megatron-core."""

__version__ = "0.1.0"

# megatron-core warns on every import that TransformerEngine / Apex are missing and it falls back to torch
# (megatron/core/optimizer/__init__.py:25, optimizer.py:29, clip_grads.py:30, models/backends.py:21, ...): true on
# every CPU machine and said on every command. What the run uses instead is the project's choice (README, "What
# runs where"), so these are silenced here, before any megatron import.
import warnings as _warnings

_warnings.filterwarnings("ignore", message=r"(Transformer Engine and )?Apex (is|are) not installed", category=UserWarning)
_warnings.filterwarnings("ignore", message=r"Transformer Engine and Apex are not installed", category=UserWarning)
