"""megatron-qarl: rollout-aligned quantization-aware RL (QaRL) with TBPO on megatron-core."""

__version__ = "0.1.0"
