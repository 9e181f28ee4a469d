"""Helpers shared by the torchrun worker scripts in this folder."""
import json
import os

import torch.distributed as dist


def write_result(payload: dict) -> None:
    """Rank 0 writes the JSON the parent pytest reads back."""
    if (not dist.is_initialized() or dist.get_rank() == 0) and os.environ.get("QARL_RESULT"):
        with open(os.environ["QARL_RESULT"], "w") as f:
            json.dump(payload, f)
