"""compressed-tensors ``pack-quantized`` symmetric int group configs, both ways: what every int weight-only scheme
(W4A16, W3A16, W2A16) writes into a checkpoint's quantization_config and reads back from one."""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def int_group_quantization_config(bits: int, group_size: int, ignore: list[str]) -> dict:
    """The quantization_config llm-compressor writes for W<bits>A16 with groups of `group_size` along K."""
    return {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {"num_bits": bits, "type": "int", "symmetric": True, "strategy": "group",
                            "group_size": group_size, "dynamic": False, "actorder": None,
                            "observer": "minmax"},
                "input_activations": None,
                "output_activations": None,
                "format": "pack-quantized",
            }
        },
        "ignore": ignore,
        "kv_cache_scheme": None,
    }


def int_group_config_fields(qc: Mapping[str, Any], bits: int, scheme: str) -> dict | None:
    """{scheme, group_size, ignore} of a quantization_config that is pack-quantized int at `bits`, else None."""
    if qc.get("quant_method") != "compressed-tensors" or qc.get("format") != "pack-quantized":
        return None
    weights = next(iter(qc["config_groups"].values()))["weights"]
    if weights.get("type") != "int" or weights.get("num_bits") != bits:
        return None
    return {"scheme": scheme, "group_size": weights["group_size"], "ignore": list(qc.get("ignore") or [])}
