"""Every import of SGLang the rollout side makes, in one place (written against sglang 0.5.23).

Each import happens inside a function, so importing this module never imports SGLang: CPU code (the
payload, the tests) can depend on it. A new SGLang release that moves one of these
names is handled here, with a version fallback next to the import, and nowhere else.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any

from megatron_qarl.rollout.protocol import RolloutEngineError

LAUNCH_SERVER_MODULE = "sglang.launch_server"  # run with ``python -m``


class SGLangUnavailableError(RolloutEngineError):
    """SGLang is not installed / cannot be imported or launched here."""


def require_sglang() -> None:
    """Raise SGLangUnavailableError naming the fix when sglang cannot be imported."""
    try:
        import sglang  # noqa: F401
    except Exception as e:  # ImportError, or a broken install failing at import time
        raise SGLangUnavailableError(
            f"SGLang is not importable in {sys.executable} ({type(e).__name__}: {e}). Install the GPU extra "
            "(pip install 'megatron-qarl[gpu]', sglang==0.5.23) on a CUDA machine, or use the 'embedded' "
            "rollout engine on CPU."
        ) from e


def engine_class() -> type:
    """``sglang.Engine``: the in-process engine (colocated trainer + engine)."""
    require_sglang()
    import sglang

    return sglang.Engine


def flattened_tensor_metadata_class() -> type | None:
    """SGLang's ``FlattenedTensorMetadata`` (srt/weight_sync/tensor_bucket.py:8), or None where SGLang is
    not importable."""
    try:
        from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorMetadata
    except ImportError:
        return None
    return FlattenedTensorMetadata


def ipc_serializer() -> Callable[[Any], str]:
    """SGLang's own ``MultiprocessingSerializer`` to a base64 string (CUDA tensors travel as IPC handles).

    The reductions patch names a CUDA tensor's device by UUID instead of index (srt/utils/patch_torch.py:41),
    so an engine process that numbers its GPUs differently opens the handle on the right one; SGLang's
    own sender patches the same way (srt/weight_sync/utils.py:40-42)."""
    require_sglang()
    from sglang.srt.utils.common import MultiprocessingSerializer
    from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions

    monkey_patch_torch_reductions()
    return functools.partial(MultiprocessingSerializer.serialize, output_str=True)


def custom_process_group_init() -> Callable[..., Any]:
    """SGLang's ``init_custom_process_group``: the extra NCCL group the trainer broadcasts weights into,
    which the engine joins through /init_weights_update_group."""
    from sglang.srt.utils.common import init_custom_process_group

    return init_custom_process_group


def check_weights_request(action: str) -> Any:
    """SGLang's ``CheckWeightsReqInput`` (managers/io_struct.py:2217-2223) for the target model: what the in-process
    Engine's tokenizer manager takes for its weight checker (the /weights_checker route builds the same)."""
    require_sglang()
    from sglang.srt.managers.io_struct import CheckWeightsReqInput

    return CheckWeightsReqInput(action=action, selector="target")


def sglang_bucket_dict(bucket) -> dict:
    """A ``payload.FlattenedBucket`` as ``{"flattened_tensor", "metadata"}``, what
    ``update_weights_from_tensor(load_format="flattened_bucket")`` expects. Metadata become SGLang's own dataclass
    when it is importable (the engine process unpickles them and may not import this package), else the bucket's
    own entries stay (same attributes)."""
    meta_class = flattened_tensor_metadata_class()
    if meta_class is None:
        meta = list(bucket.metadata)
    else:
        meta = [meta_class(name=m.name, shape=m.shape, dtype=m.dtype, start_idx=m.start_idx, end_idx=m.end_idx,
                           numel=m.numel) for m in bucket.metadata]
    return {"flattened_tensor": bucket.flattened_tensor, "metadata": meta}
