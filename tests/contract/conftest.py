"""The contract tests' one SGLang CPU runtime (its process groups can be set up once per process)."""
import pytest


@pytest.fixture(scope="session")
def sglang_runtime():
    from sglang_stubs import stub_torchvision

    stub_torchvision()
    import socket

    import sglang.srt.layers.rotary_embedding.base as rope_base
    from sglang.srt.distributed import parallel_state as ps
    from sglang.srt.layers.moe.utils import initialize_moe_config
    from sglang.srt.runtime_context import SpawnRanks, get_parallel, publish, reset_context
    from sglang.srt.server_args import ServerArgs

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
