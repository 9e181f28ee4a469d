"""What the contract tests need to import SGLang's CPU-runnable modules beside CPU torch, and its CPU runtime."""
import enum
import sys
import types

import pytest


def stub_torchvision() -> None:
    """sglang.srt.configs imports multimodal helpers that import torchvision; PyPI's torchvision is a CUDA
    build that fails beside CPU torch. No contract test calls it: stub the three names it needs."""
    import transformers.utils.import_utils as iu

    iu.is_torchvision_available()  # cache "unavailable" for transformers before the stub exists
    if "torchvision" in sys.modules:
        return
    tv, tr, fn = (types.ModuleType(n) for n in ("torchvision", "torchvision.transforms", "torchvision.transforms.functional"))

    class InterpolationMode(enum.Enum):
        NEAREST = "nearest"
        BILINEAR = "bilinear"
        BICUBIC = "bicubic"

    fn.InterpolationMode = tr.InterpolationMode = InterpolationMode
    tr.functional, tv.transforms = fn, tr
    sys.modules.update({"torchvision": tv, "torchvision.transforms": tr, "torchvision.transforms.functional": fn})


@pytest.fixture(scope="session")
def sglang_runtime():
    """SGLang's CPU runtime (server args, gloo groups), once per process: a test module that imports this
    fixture gets its own instance, so the second one finds the groups there and reuses them."""
    stub_torchvision()
    import socket

    import sglang.srt.layers.rotary_embedding.base as rope_base
    from sglang.srt.distributed import parallel_state as ps
    from sglang.srt.layers.moe.utils import initialize_moe_config
    from sglang.srt.runtime_context import SpawnRanks, get_parallel, publish, reset_context
    from sglang.srt.server_args import ServerArgs

    if ps.model_parallel_is_initialized():
        yield
        return

    rope_base._is_cpu = True  # kernel choice only; otherwise it imports a vllm custom op
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ps.init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                    distributed_init_method=f"tcp://127.0.0.1:{port}")
    reset_context()
    publish(ServerArgs(model_path="dummy", tp_size=1, ep_size=1, pp_size=1, device="cpu", moe_runner_backend="auto"),
            role="test", ranks=SpawnRanks(world_rank=0))
    get_parallel().override_permanently(world_group=ps._WORLD)
    ps.initialize_model_parallel(backend="gloo")
    initialize_moe_config()
    yield
