"""Print the ``sglang.launch_server`` command of one rollout group's server, one argument per line.

qarl_multinode.sbatch runs this on every engine node in separate mode (``SGLANG_MODE=separate``): the servers it
starts get exactly the arguments the trainer gives its own servers for the same config and overrides
(``SGLangEngineConfig.from_run`` + ``sglang_server_command``, megatron_qarl/rollout/sglang_engine_config.py and
sglang_launch.py: MoE runner, CUDA graphs, routed experts, ``rollout.sglang.*``), bound to ``--host:--port``, with the API key in ``--key-file``
(a 0600 YAML ``api-key: "<key>"`` passed as SGLang's ``--config``, never on the command line).

    python launch/slurm/sglang_server_args.py --config C --group G --host ADDR --port P [--base-gpu-id B]
        [--model-path DIR] [--key-file F] [key=value ...]

An attach-mode run (``rollout.sglang.launch=attach``) needs its key in the variable ``rollout.sglang.api_key_env``
names (``QARL_SGLANG_API_KEY``), as for the trainer. Exit status 2 and a message for a config or group the trainer
would refuse.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

# The checkout this script is in, first: the same megatron_qarl the job's `python -m megatron_qarl.cli` runs
# (from the checkout root), whether or not the venv has it installed.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def server_command(argv: list[str] | None = None) -> list[str]:
    p = argparse.ArgumentParser(prog="sglang_server_args.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", required=True, help="run config (YAML), as given to qarl-train")
    p.add_argument("--group", type=int, default=0, help="rollout group (engine) index: rollout.sglang.urls[group]")
    p.add_argument("--host", required=True, help="address the server binds")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--base-gpu-id", type=int, default=0, help="first GPU of the server (of the visible ones)")
    p.add_argument("--model-path", default=None, help="checkpoint the server starts from [rollout.sglang.model_path]")
    p.add_argument("--key-file", default=None, help="0600 YAML holding `api-key: <key>` (SGLang's --config)")
    p.add_argument("overrides", nargs="*", help="key=value overrides, as given to qarl-train")
    args = p.parse_args(argv)

    from megatron_qarl.config import load_config
    from megatron_qarl.rollout.sglang_engine_config import SGLangEngineConfig
    from megatron_qarl.rollout.sglang_launch import sglang_server_command

    cfg = load_config(args.config, args.overrides)
    engine = SGLangEngineConfig.from_run(cfg, group=args.group, base_gpu_id=args.base_gpu_id,
                                         model_path=args.model_path)
    engine.host = args.host
    return sglang_server_command(engine, args.port, args.key_file)


def main(argv: list[str] | None = None) -> int:
    try:
        cmd = server_command(argv)
    except (ValueError, OSError) as err:  # ConfigError is a ValueError, as are from_run's refusals
        print(f"sglang_server_args.py: error: {err}", file=sys.stderr)
        return 2
    if any("\n" in a for a in cmd):
        print(f"sglang_server_args.py: error: an argument contains a newline: {cmd!r}", file=sys.stderr)
        return 2
    print("\n".join(cmd))
    return 0


if __name__ == "__main__":
    sys.exit(main())
