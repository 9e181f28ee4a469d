"""Conversion CLI front; the logic lives in megatron_qarl.weights."""
