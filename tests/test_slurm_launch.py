"""launch/slurm/qarl_multinode.sbatch rendered for a 2-node job, without Slurm.

The real batch script runs under bash with the variables a 2-node allocation gives it and stubs first on
PATH: ``srun`` records its arguments (and the environment a step would get) and then runs the step's
command once per node of the step, as that node (``SLURMD_NODENAME``); ``torchrun`` records its arguments;
``scontrol``, ``hostname``, ``getent`` and ``ip`` answer like a cluster whose node names resolve to
10.20.0.x. A fake ``sglang`` package on PYTHONPATH records each server's argv, environment and key file, and
stays up until SIGTERM. The dry-run and launch/slurm/sglang_server_args.py run for real, in this venv.

``QARL_TEST_SBATCH=<file>`` renders another copy of the script (e.g. ``git show HEAD:<path>``) with the same
stubs, to see which checks an older script fails.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SBATCH = Path(os.environ.get("QARL_TEST_SBATCH", ROOT / "launch/slurm/qarl_multinode.sbatch"))
NODE_ADDR_SH = ROOT / "launch/slurm/node_addr.sh"
SERVER_ARGS_PY = ROOT / "launch/slurm/sglang_server_args.py"
CONFIG = "configs/qwen3_30b_a3b_qarl_w4a16_tbpo_multinode.yaml"
# The batch script's dry-run checks the run's dataset and tokenizer, which the 30B config takes from the cluster:
# the repo's arithmetic set and the char tokenizer stand in (no server flag depends on them). They also show that
# OVERRIDES reach the servers' arguments.
# Separate-mode tests run 4-GPU servers: Qwen3-30B-A3B's experts (moe_intermediate_size 768) split 4 ways hold 192
# columns per GPU, no whole W4A16 group of 128 (the config refuses it: SGLang would floor its group count), so those
# servers spread whole experts over their GPUs (SGLang expert parallelism).
SEPARATE_TP4 = ["rollout.engine_tp=4", "rollout.sglang.ep_size=4"]
OVERRIDES = ["model.tokenizer=char", "data.path=data/arith_2digit_lsd.jsonl", "data.prompt_key=prompt",
             "data.answer_key=answer", "rollout.stop=[]"]
NODES = ("gpu-a1", "gpu-a2")
ADDRS = {"gpu-a1": "10.20.0.11", "gpu-a2": "10.20.0.12"}
CPUS_PER_TASK = "16"
GPUS_PER_NODE = 8
RESTART = "3"  # SLURM_RESTART_COUNT: the job's third requeue

pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")

STUBS = {
    # srun: record, then run the step's command once per node of the step (sequentially), as that node.
    "srun": r"""#!/usr/bin/env bash
set -u
rec="$(mktemp "$STUB_REC/srun.XXXXXX")"
{ printf 'ARG %s\n' "$@"
  printf 'ENV SRUN_CPUS_PER_TASK=%s\n' "${SRUN_CPUS_PER_TASK-<unset>}"
} > "$rec"
read -r -a all <<< "$STUB_NODES"
nodes=1; rel=0; only=""
while [ $# -gt 0 ]; do
  case "$1" in
    --nodes=*) nodes="${1#*=}" ;;
    --relative=*) rel="${1#*=}" ;;
    --nodelist=*) only="${1#*=}" ;;
    -*) ;;
    *) break ;;
  esac
  shift
done
if [ -n "$only" ]; then all=("$only"); rel=0; nodes=1; fi
rc=0
for ((k = rel; k < rel + nodes; k++)); do
  SLURMD_NODENAME="${all[$k]}" SLURM_NODEID=$((k - rel)) SLURM_PROCID=$((k - rel)) "$@" || rc=$?
done
echo "RC $rc" >> "$rec"
exit "$rc"
""",
    # torchrun: record; like the trainer, wait (bounded) until the STUB_SERVERS attached servers are up
    "torchrun": r"""#!/usr/bin/env bash
{ echo "NODE ${SLURMD_NODENAME:-?}"; printf 'ARG %s\n' "$@"; } > "$(mktemp "$STUB_REC/torchrun.XXXXXX")"
if [ -n "${STUB_WAIT_STOP:-}" ]; then  # a trainer that runs until asked to stop, then exits 3 like ours
  for ((t = 0; t < 600; t++)); do
    if [ -f "${QARL_STOP_FILE:-/nonexistent}" ]; then echo "$SLURMD_NODENAME" >> "$STUB_REC/saw-stop"; exit 3; fi
    sleep 0.1
  done
  exit 1
fi
for ((t = 0; t < 600; t++)); do
  [ "$(find "$STUB_REC" -name 'sglang.*.json' | wc -l)" -ge "${STUB_SERVERS:-0}" ] && exit 0
  sleep 0.1
done
echo "torchrun stub: the SGLang servers did not come up" >&2; exit 1
""",
    "scontrol": r"""#!/usr/bin/env bash
if [ "$1" = show ] && [ "$2" = hostnames ]; then printf '%s\n' $STUB_NODES; exit 0; fi
if [ "$1" = requeue ]; then echo "$2" >> "$STUB_REC/requeue"; exit 0; fi
echo "scontrol stub: $*" >&2; exit 1
""",
    "hostname": r"""#!/usr/bin/env bash
[ "${1:-}" = -I ] && exit 0
echo "${SLURMD_NODENAME:-${STUB_NODES%% *}}"
""",
    # getent ahostsv4 NAME, as glibc prints it; names map through STUB_ADDRS ("name=addr ...")
    "getent": r"""#!/usr/bin/env bash
for kv in $STUB_ADDRS; do
  if [ "${kv%%=*}" = "$2" ]; then printf '%s STREAM %s\n%s DGRAM\n' "${kv#*=}" "$2" "${kv#*=}"; exit 0; fi
done
exit 2
""",
    "ip": r"""#!/usr/bin/env bash
case "$*" in
  "-4 route get"*) [ -n "${STUB_ROUTE_SRC:-}" ] && echo "1.1.1.1 via 10.0.0.1 dev eth0 src $STUB_ROUTE_SRC uid 0" ;;
  "-4 -o addr show"*) printf '%s\n' "${STUB_IP_ADDRS:-}" ;;
esac
exit 0
""",
}

FAKE_LAUNCH_SERVER = textwrap.dedent("""\
    import json, os, signal, stat, sys, time
    argv = sys.argv[1:]
    key = argv[argv.index("--config") + 1] if "--config" in argv else None
    rec = {"argv": argv, "master_port": os.environ.get("MASTER_PORT"),
           "master_addr": os.environ.get("MASTER_ADDR"),
           "key_mode": stat.S_IMODE(os.stat(key).st_mode) if key and os.path.exists(key) else None,
           "key_text": open(key).read() if key and os.path.exists(key) else None}
    path = os.path.join(os.environ["STUB_REC"], f"sglang.{os.getpid()}.json")
    def stop(*_):
        rec["terminated"] = True
        json.dump(rec, open(path, "w"))
        sys.exit(0)
    signal.signal(signal.SIGTERM, stop)
    json.dump(rec, open(path, "w"))
    time.sleep(30)  # bounded: a server nobody stops still ends
    """)


def _write_exe(path: Path, text: str) -> None:
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)


@pytest.fixture
def cluster(tmp_path):
    """The stubs, a fake venv whose python is this one, a fake SGLang checkpoint, and the job environment."""
    bin_dir, rec, pylib = tmp_path / "bin", tmp_path / "rec", tmp_path / "pylib"
    for d in (bin_dir, rec, pylib / "sglang"):
        d.mkdir(parents=True)
    for name, text in STUBS.items():
        _write_exe(bin_dir / name, text)
    (pylib / "sglang" / "__init__.py").write_text("")
    (pylib / "sglang" / "launch_server.py").write_text(FAKE_LAUNCH_SERVER)
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    _write_exe(venv / "bin" / "python", f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    drop = ("SLURM", "SBATCH", "SRUN", "MASTER_", "SGLANG_", "QARL_", "NCCL_", "GLOO_")
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
    env.pop("CONFIG", None), env.pop("OVERRIDES", None), env.pop("GPUS_PER_NODE", None), env.pop("LOG_DIR", None)
    env.update({
        "PATH": f"{bin_dir}{os.pathsep}{env.get('PATH', '')}",
        "PYTHONPATH": os.pathsep.join([str(pylib), str(ROOT)]),
        "STUB_REC": str(rec), "STUB_NODES": " ".join(NODES),
        "STUB_ADDRS": " ".join(f"{n}={a}" for n, a in ADDRS.items()),
        "QARL_TEST_PROCESS_TAG": os.environ.get("QARL_TEST_PROCESS_TAG", ""),
        "QARL_ROOT": str(ROOT), "QARL_VENV": str(venv), "LOG_DIR": str(tmp_path / "logs"),
        "CONFIG": CONFIG, "OVERRIDES": " ".join(OVERRIDES), "OMP_NUM_THREADS": "1",
        "SLURM_JOB_ID": "4242", "SLURM_JOB_NAME": "qarl", "SLURM_SUBMIT_DIR": str(ROOT),
        "SLURM_JOB_NUM_NODES": "2", "SLURM_NNODES": "2", "SLURM_JOB_NODELIST": "gpu-a[1-2]",
        "SLURM_NODELIST": "gpu-a[1-2]", "SLURM_NTASKS": "2", "SLURM_NPROCS": "2", "SLURM_NTASKS_PER_NODE": "1",
        "SLURM_CPUS_PER_TASK": CPUS_PER_TASK, "SLURM_CPUS_ON_NODE": CPUS_PER_TASK,
        "SLURM_GPUS_PER_NODE": str(GPUS_PER_NODE), "SLURM_GPUS_ON_NODE": str(GPUS_PER_NODE),
        "SLURM_RESTART_COUNT": RESTART, "SLURMD_NODENAME": NODES[0], "SLURM_NODEID": "0",
    })
    return {"env": env, "rec": rec, "logs": tmp_path / "logs", "model": model}


def _render(cluster, **extra) -> subprocess.CompletedProcess:
    env = dict(cluster["env"], **extra)
    p = subprocess.run(["bash", str(SBATCH)], env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    return p


def _records(rec: Path, kind: str) -> list[dict]:
    """srun / torchrun records: {'args': [...], 'env': {...}, 'node': ..., 'rc': ...}."""
    out = []
    for f in sorted(rec.glob(f"{kind}.*")):
        r = {"args": [], "env": {}, "node": None, "rc": None}
        for line in f.read_text().splitlines():
            tag, _, val = line.partition(" ")
            if tag == "ARG":
                r["args"].append(val)
            elif tag == "ENV":
                k, _, v = val.partition("=")
                r["env"][k] = v
            elif tag == "NODE":
                r["node"] = val
            elif tag == "RC":
                r["rc"] = int(val)
        out.append(r)
    return out


def _opts(args: list[str]) -> dict[str, str]:
    """--key=value options before the step's command."""
    opts = {}
    for a in args:
        if not a.startswith("-"):
            break
        k, _, v = a.partition("=")
        opts[k] = v
    return opts


def _step(sruns: list[dict], command: str) -> dict:
    steps = [r for r in sruns if r["args"][-1:] == [command]]
    assert len(steps) == 1, f"expected one srun step running {command}, got {[r['args'] for r in sruns]}"
    return steps[0]


def _check_step(step: dict, *, nodes: int, relative: int) -> dict:
    opts = _opts(step["args"])
    assert opts.get("--nodes") == str(nodes), step["args"]
    # its own task count: srun would otherwise take the job's SLURM_NTASKS (2) for a 1-node step
    assert opts.get("--ntasks") == str(nodes), step["args"]
    assert opts.get("--ntasks-per-node") == "1", step["args"]
    assert opts.get("--relative") == str(relative), step["args"]
    assert opts.get("--export") == "ALL", step["args"]  # a site's --export=<list> must not strip the steps
    # Slurm 22.05-23.02: steps do not inherit --cpus-per-task
    assert step["env"].get("SRUN_CPUS_PER_TASK") == CPUS_PER_TASK, step["env"]
    # a requeued job appends, in files named after its attempt
    assert opts.get("--open-mode") == "append", step["args"]
    assert f"restart{RESTART}" in opts.get("--output", ""), step["args"]
    return opts


def _torchruns(rec: Path) -> dict[str, dict[str, str]]:
    return {r["node"]: _opts(r["args"]) for r in _records(rec, "torchrun")}


def _check_rendezvous(torchruns: dict, head_addr: str, nnodes: int) -> None:
    assert sorted(torchruns) == sorted(NODES[:nnodes])
    for node, opts in torchruns.items():
        assert opts["--nnodes"] == str(nnodes)
        assert opts["--nproc_per_node"] == str(GPUS_PER_NODE)
        assert opts["--rdzv_endpoint"] == f"{head_addr}:29500", opts
        # every node announces a reachable address (the workers' MASTER_ADDR where it gets group rank 0)
        local = opts.get("--local-addr", "")
        assert local == (head_addr if node == NODES[0] else ADDRS[node]), opts
        assert not local.startswith("127.") and local != "localhost"
        assert opts.get("--rdzv_conf") == f"is_host={int(node == NODES[0])}", opts


def test_colocated_two_nodes(cluster):
    p = _render(cluster)
    assert p.returncode == 0, p.stdout + p.stderr
    sruns = _records(cluster["rec"], "srun")
    assert len(sruns) == 1, [r["args"] for r in sruns]
    opts = _check_step(_step(sruns, "node_main"), nodes=2, relative=0)
    assert opts.get("--kill-on-bad-exit") == "1"
    _check_rendezvous(_torchruns(cluster["rec"]), ADDRS["gpu-a1"], 2)
    assert (cluster["logs"] / f"dry-run-restart{RESTART}.txt").exists(), sorted(cluster["logs"].iterdir())
    assert not list(cluster["logs"].glob(".tmp-*")), "the job's scratch directory is left behind"


def _expected_server_argv(cluster, group: int, base_gpu_id: int, port: int, key_file: str) -> list[str]:
    """What the trainer would launch for the same config: sglang_server_command(SGLangEngineConfig.from_run)."""
    from megatron_qarl.config import load_config
    from megatron_qarl.rollout.sglang_engine_config import SGLangEngineConfig
    from megatron_qarl.rollout.sglang_launch import sglang_server_command

    urls = ",".join(f"http://{NODES[1]}:{30000 + i}" for i in range(2))
    cfg = load_config(ROOT / CONFIG, OVERRIDES + [
        "rollout.sglang.mode=separate", "rollout.sglang.launch=attach", f"rollout.sglang.urls=[{urls}]",
        "rollout.engines=2", *SEPARATE_TP4])
    engine = SGLangEngineConfig.from_run(cfg, group=group, base_gpu_id=base_gpu_id, model_path=str(cluster["model"]))
    engine.host = ADDRS[NODES[1]]
    cmd = sglang_server_command(engine, port, key_file)
    assert cmd[1:3] == ["-m", "sglang.launch_server"]
    return cmd[3:]


def test_separate_two_nodes(cluster, monkeypatch):
    monkeypatch.setenv("QARL_SGLANG_API_KEY", "k")  # load_config of an attach-mode run checks it is set
    p = _render(cluster, SGLANG_MODE="separate", SGLANG_NODES="1", ENGINE_TP="4",
                OVERRIDES=" ".join(OVERRIDES + SEPARATE_TP4[1:]),
                SGLANG_MODEL_PATH=str(cluster["model"]), QARL_SGLANG_API_KEY="s3cret-key", ENGINE_STOP_TIMEOUT="120",
                STUB_SERVERS=str(GPUS_PER_NODE // 4))
    assert p.returncode == 0, p.stdout + p.stderr
    sruns = _records(cluster["rec"], "srun")
    assert len(sruns) == 2, [r["args"] for r in sruns]
    engine_opts = _check_step(_step(sruns, "engine_main"), nodes=1, relative=1)
    _check_step(_step(sruns, "node_main"), nodes=1, relative=0)
    assert "engine-node" in engine_opts["--output"]
    # the engine step ended by itself (its servers stopped), not killed by the batch script
    assert _step(sruns, "engine_main")["rc"] == 0, p.stdout + p.stderr
    _check_rendezvous(_torchruns(cluster["rec"]), ADDRS["gpu-a1"], 1)

    servers = sorted((json.loads(f.read_text()) for f in cluster["rec"].glob("sglang.*.json")),
                     key=lambda r: r["argv"][r["argv"].index("--port") + 1])
    assert len(servers) == GPUS_PER_NODE // 4, servers
    for i, server in enumerate(servers):
        argv = server["argv"]
        key_file = argv[argv.index("--config") + 1]
        # the same arguments the trainer gives its own servers for this config (one source of truth)
        assert argv == _expected_server_argv(cluster, group=i, base_gpu_id=4 * i, port=30000 + i, key_file=key_file)
        # the 30B configs run without routing telemetry unless asked (train.routing_telemetry=true): no routes
        assert "--enable-return-routed-experts" not in argv
        assert argv[argv.index("--moe-runner-backend") + 1] == "marlin"
        assert argv[argv.index("--cuda-graph-backend-decode") + 1] == "disabled"
        assert argv[argv.index("--cuda-graph-backend-prefill") + 1] == "disabled"
        assert argv[argv.index("--tp-size") + 1] == "4"
        assert argv[argv.index("--base-gpu-id") + 1] == str(4 * i)
        # bound to the node's routable address, not to whatever `hostname` resolves to
        assert argv[argv.index("--host") + 1] == ADDRS["gpu-a2"]
        assert "s3cret-key" not in " ".join(argv)
        assert server["key_mode"] == 0o600 and "s3cret-key" in server["key_text"]
        assert server["master_port"] is None and server["master_addr"] is None
        assert server.get("terminated"), "the server was not stopped with SIGTERM when the training ended"
        assert not os.path.exists(key_file), "the API-key file outlived the job"
    logs = sorted(f.name for f in cluster["logs"].glob("sglang-*"))
    assert logs == [f"sglang-gpu-a2-{i}-restart{RESTART}.log" for i in range(len(servers))], logs
    assert not list(cluster["logs"].glob(".tmp-*")), "the job's scratch directory is left behind"


def test_head_address_override_and_lookup_on_the_head_node(cluster):
    # MASTER_ADDR from the environment wins
    p = _render(cluster, MASTER_ADDR="10.99.0.1")
    assert p.returncode == 0, p.stdout + p.stderr
    assert {o["--rdzv_endpoint"] for o in _torchruns(cluster["rec"]).values()} == {"10.99.0.1:29500"}
    for f in cluster["rec"].iterdir():
        f.unlink()
    # a batch script that does not run on the head node asks the head node itself
    p = _render(cluster, SLURMD_NODENAME=NODES[1], STUB_ADDRS=f"gpu-a1={ADDRS['gpu-a1']}")
    assert p.returncode == 0, p.stdout + p.stderr
    lookups = [r for r in _records(cluster["rec"], "srun") if r["args"][-1:] == [str(NODE_ADDR_SH)]]
    assert len(lookups) == 1 and _opts(lookups[0]["args"]).get("--nodelist") == NODES[0], lookups
    assert _opts(lookups[0]["args"]).get("--export") == "ALL"
    assert {o["--rdzv_endpoint"] for o in _torchruns(cluster["rec"]).values()} == {f"{ADDRS['gpu-a1']}:29500"}


def test_sbatch_header_output_is_kept_out_of_git():
    header = [ln for ln in SBATCH.read_text().splitlines() if ln.startswith("#SBATCH")]
    out = next(ln.split("=", 1)[1] for ln in header if ln.startswith("#SBATCH --output="))
    assert "#SBATCH --open-mode=append" in header  # a requeue appends to the batch log
    out_dir = (ROOT / out).parent
    assert out_dir != ROOT and out_dir.is_dir(), f"{out}: sbatch needs the directory to exist"
    if shutil.which("git") and (ROOT / ".git").exists():
        probe = os.path.relpath(out_dir / "qarl-1234.out", ROOT)
        assert subprocess.run(["git", "check-ignore", "-q", probe], cwd=ROOT).returncode == 0, probe


def _node_addr(tmp_path, **env) -> str:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name in ("getent", "ip", "hostname"):
        _write_exe(bin_dir / name, STUBS[name])
    e = {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "STUB_NODES": "n1", "STUB_ADDRS": "", **env}
    return subprocess.run(["bash", str(NODE_ADDR_SH)], env=e, capture_output=True, text=True,
                          check=True, timeout=30).stdout.strip()


def test_node_addr_never_loopback_when_a_routable_address_exists(tmp_path):
    assert _node_addr(tmp_path, SLURMD_NODENAME="n1", STUB_ADDRS="n1=10.1.2.3") == "10.1.2.3"
    # Debian's `127.0.1.1 <hostname>`: the route's source address instead
    assert _node_addr(tmp_path, SLURMD_NODENAME="n1", STUB_ADDRS="n1=127.0.1.1",
                      STUB_ROUTE_SRC="10.1.2.4") == "10.1.2.4"
    # an interface named by QARL_ADDR_IFNAME / NCCL_SOCKET_IFNAME (prefix match) wins
    ips = "1: lo    inet 127.0.0.1/8 scope host lo\n3: ib0    inet 10.9.0.5/16 brd 10.9.255.255 scope global ib0"
    assert _node_addr(tmp_path, SLURMD_NODENAME="n1", STUB_ADDRS="n1=10.1.2.3", STUB_IP_ADDRS=ips,
                      NCCL_SOCKET_IFNAME="ib") == "10.9.0.5"
    assert _node_addr(tmp_path, SLURMD_NODENAME="n1", STUB_ADDRS="n1=10.1.2.3", STUB_IP_ADDRS=ips,
                      NCCL_SOCKET_IFNAME="^docker,lo") == "10.1.2.3"
    # nothing better: the lookup's own answer
    assert _node_addr(tmp_path, SLURMD_NODENAME="n1", STUB_ADDRS="n1=127.0.1.1") == "127.0.1.1"


def test_server_args_helper(monkeypatch, capsys):
    """The sbatch's source of server arguments: the trainer's own, one per line; errors as a message and exit 2."""
    import runpy

    helper = runpy.run_path(str(SERVER_ARGS_PY))
    monkeypatch.setenv("QARL_SGLANG_API_KEY", "k")
    args = ["--config", str(ROOT / CONFIG), "--group", "1", "--host", "10.0.0.2", "--port", "30001",
            "--base-gpu-id", "4", "--model-path", "/m", "--key-file", "/k",
            "rollout.sglang.mode=separate", "rollout.sglang.launch=attach",
            "rollout.sglang.urls=[http://a:1,http://a:2]", "rollout.engines=2", *SEPARATE_TP4]
    assert helper["main"](args) == 0
    printed = capsys.readouterr().out.splitlines()
    assert printed[1:3] == ["-m", "sglang.launch_server"]
    for flag, value in {"--host": "10.0.0.2", "--port": "30001", "--base-gpu-id": "4", "--tp-size": "4",
                        "--ep-size": "4", "--config": "/k", "--model-path": "/m", "--moe-runner-backend": "marlin"}.items():
        assert printed[printed.index(flag) + 1] == value, flag
    assert helper["main"](args[:2] + ["--group", "2"] + args[4:]) == 2  # group 2 has no URL
    assert "no engine URL" in capsys.readouterr().err


def test_time_limit_signal_stops_the_trainer_at_a_step_and_requeues(cluster):
    """--signal=B:USR1 reaches the batch shell while training runs: it becomes the trainer's stop file (every
    rank finishes its step, checkpoints and exits 3), the script exits with the trainer's code and requeues."""
    import signal
    import time

    header = SBATCH.read_text()
    assert "#SBATCH --requeue" in header and "#SBATCH --signal=B:USR1@" in header
    proc = subprocess.Popen(["bash", str(SBATCH)], env=dict(cluster["env"], STUB_WAIT_STOP="1"), cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        for _ in range(600):  # until the first node's trainer runs (the dry-run comes first)
            if list(cluster["rec"].glob("torchrun.*")):
                break
            time.sleep(0.1)
        assert not (cluster["rec"] / "saw-stop").exists()
        proc.send_signal(signal.SIGUSR1)
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 3, out + err
    assert (cluster["rec"] / "saw-stop").read_text().split() == list(NODES)  # every node's trainer saw it
    assert (cluster["rec"] / "requeue").read_text().split() == ["4242"]
    for opts in _torchruns(cluster["rec"]).values():
        # torchrun forwards the stop signals to its workers and gives them a step and a checkpoint to finish
        assert set(opts["--signals-to-handle"].split(",")) >= {"SIGTERM", "SIGINT", "SIGUSR1"}, opts
        assert int(opts["--shutdown-timeout"]) >= 600, opts
    assert not list(cluster["logs"].glob(".tmp-*")), "the job's scratch directory is left behind"


def test_sbatch_asks_for_the_memory_the_default_configs_host_plan_needs():
    """#SBATCH --mem (GiB) >= the host plan of the default CONFIG on 2 nodes x 8 GPUs (memory.host_plan, the
    trainer on GPUs), and the job's dry run checks it per node."""
    import re

    from megatron_qarl.config import load_config
    from megatron_qarl.memory import GIB, host_plan

    text = SBATCH.read_text()
    mem = re.findall(r"^#SBATCH --mem=(\d+)G$", text, re.M)
    assert len(mem) == 1, "one #SBATCH --mem=<N>G line"
    cfg = load_config(ROOT / CONFIG, [])
    need = host_plan(cfg, 2 * GPUS_PER_NODE, GPUS_PER_NODE, on_gpu=True)["need"]
    assert int(mem[0]) * GIB >= need, (mem[0], need / GIB)
    assert '--gpus-per-node "$GPUS_PER_NODE"' in text


def test_a_job_with_too_little_memory_stops_at_its_dry_run_in_one_line(cluster):
    """SLURM_MEM_PER_NODE below the plan (a job submitted with a smaller --mem): the dry run refuses it in one line
    before any step starts."""
    p = _render(cluster, SLURM_MEM_PER_NODE=str(64 * 1024))
    assert p.returncode == 2, p.stdout + p.stderr
    errors = [line for line in p.stderr.splitlines() if line.startswith("qarl-train: error:")]
    assert len(errors) == 1 and "host memory: the plan needs" in errors[0], p.stderr
    assert "SLURM_MEM_PER_NODE=65536 MiB) is 64.0 GiB" in errors[0] and "sbatch --mem=" in errors[0]
    assert not _records(cluster["rec"], "srun"), "no step may start"
