"""Run checkpoints: model + optimizer (megatron dist_checkpointing) + step/data position/RNG, atomic.

Layout under the checkpoint root:
    step_00000010/            complete checkpoint (megatron files + qarl_state.pt, written last)
    .tmp-step_00000012/       a save in progress or interrupted: never picked by resume
A checkpoint directory is renamed into place only after every rank finished writing and rank 0 wrote
`qarl_state.pt`, so `resume: auto` can only ever see complete checkpoints.
"""
from __future__ import annotations

import os
import random
import re
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_qarl.lifecycle import install_checkpoint_writer_queue

STATE_FILE = "qarl_state.pt"
_STEP_DIR = re.compile(r"^step_(\d{8})$")


class CheckpointError(ValueError):
    """A checkpoint that cannot be used (incomplete, corrupted, or of another model)."""


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _last_line(err: BaseException) -> str:
    """The innermost message: torch's CheckpointException embeds whole per-rank tracebacks."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    return lines[-1] if lines else type(err).__name__


def _is_complete(path: Path) -> bool:
    return (path / STATE_FILE).is_file() and (path / "metadata.json").is_file()


class RunCheckpoints:
    def __init__(self, root: str | os.PathLike, keep_last: int = 2):
        self.root = Path(root)
        self.keep_last = keep_last

    # -- discovery ----------------------------------------------------------------------------------
    def complete(self) -> list[Path]:
        if not self.root.is_dir():
            return []
        found = [p for p in self.root.iterdir() if _STEP_DIR.match(p.name) and _is_complete(p)]
        return sorted(found, key=lambda p: int(_STEP_DIR.match(p.name).group(1)))

    def latest(self) -> Path | None:
        done = self.complete()
        return done[-1] if done else None

    # -- save ---------------------------------------------------------------------------------------
    def save(self, step: int, ctx) -> Path:
        """Collective: every rank writes its shards; rank 0 finalises and renames into place."""
        from megatron.core import dist_checkpointing

        final = self.root / f"step_{step:08d}"
        tmp = self.root / f".tmp-step_{step:08d}"
        if _rank() == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)  # a stale attempt at this step
            tmp.mkdir()
        _barrier()
        model_sd = ctx.model.module.sharded_state_dict()
        install_checkpoint_writer_queue()
        dist_checkpointing.save(
            {"model": model_sd, "optimizer": ctx.optimizer.sharded_state_dict(model_sd)}, str(tmp)
        )
        _barrier()
        if _rank() == 0:
            state = {
                "step": step,
                "data": ctx.data.state_dict() if ctx.data is not None else None,
                "rng": {"python": random.getstate(), "torch": torch.get_rng_state()},
                "config_name": ctx.cfg.name,
            }
            torch.save(state, tmp / STATE_FILE)  # last file: marks the checkpoint complete
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
            self._prune()
        _barrier()
        return final

    def _prune(self) -> None:
        for old in self.complete()[: -self.keep_last]:
            shutil.rmtree(old, ignore_errors=True)

    # -- load ---------------------------------------------------------------------------------------
    def resume(self, mode: str, ctx) -> int:
        """Load per `checkpoint.resume` (auto | none | <path>) and return the step to start from."""
        if mode == "none":
            return 0
        path = self.latest() if mode == "auto" else Path(mode)
        if path is None:
            return 0
        return self.load(path, ctx)

    def load(self, path: Path, ctx) -> int:
        from megatron.core import dist_checkpointing
        from torch.distributed.checkpoint.api import CheckpointException  # a BaseException, not Exception

        path = Path(path)
        if not path.is_dir():
            raise CheckpointError(f"checkpoint {path} does not exist; set checkpoint.resume=auto|none|<dir>")
        if not _is_complete(path):
            raise CheckpointError(
                f"checkpoint {path} is incomplete (no {STATE_FILE} or metadata.json): it was interrupted while "
                "being written; resume from an earlier step_* directory or checkpoint.resume=none"
            )
        try:
            state = torch.load(path / STATE_FILE, weights_only=False)
            model_sd = ctx.model.module.sharded_state_dict()
            loaded = dist_checkpointing.load(
                {"model": model_sd, "optimizer": ctx.optimizer.sharded_state_dict(model_sd, is_loading=True)},
                str(path),
            )
        except CheckpointError:
            raise
        except (Exception, CheckpointException) as err:  # many types for unreadable files
            raise CheckpointError(
                f"checkpoint {path} is corrupted or does not match this model/layout ({_last_line(err)}). "
                "Remove it to resume from an earlier one, or set checkpoint.resume=none"
            ) from err
        ctx.model.module.load_state_dict(loaded["model"])
        ctx.optimizer.load_state_dict(loaded["optimizer"])
        if ctx.quant is not None:
            ctx.quant.invalidate()
        if ctx.data is not None and state.get("data") is not None:
            ctx.data.load_state_dict(state["data"])
        random.setstate(state["rng"]["python"])
        torch.set_rng_state(state["rng"]["torch"])
        if _rank() == 0:
            print(f"[qarl] resumed from {path} (step {state['step']})", flush=True)
        return int(state["step"])
