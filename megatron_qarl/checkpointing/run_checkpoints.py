"""A trainer run's checkpoints: `root/step_XXXXXXXX/` directories (save_load's format) of one run, told apart
from another run's in the same root by the run id their marker records; resume picks the newest one that
verifies (trust.py)."""
from __future__ import annotations

import json
import logging
import os
import re
import shutil
from pathlib import Path
from typing import Any

from megatron_qarl.checkpointing import ranks
from megatron_qarl.checkpointing.format import EXTRA_STATE_NAME, is_complete
from megatron_qarl.checkpointing.save_load import load_checkpoint, save_checkpoint
from megatron_qarl.checkpointing.trust import read_marker, verify_checkpoint
from megatron_qarl.errors import CheckpointError
from megatron_qarl.fileio import temp_writer_alive

log = logging.getLogger(__name__)


_STEP_DIR = re.compile(r"^step_(\d{8})$")
# What atomic_dir leaves behind when a save is killed (temp dir, or the replaced one not yet removed).
_STALE_DIR = re.compile(r"^\.step_\d{8}\.(tmp|old)-")
_RESUME_FIX = "resume from an earlier step_* directory, or set checkpoint.resume=auto|none|<dir>"


class RunCheckpoints:
    """`root/step_XXXXXXXX/` checkpoints of one run: model + optimizer + the caller's extra state, whose
    "step" and "run_id" keys this class owns. The caller decides what else the extra state holds and restores
    it. `run_id` names the run (a fresh one per run; a resumed run takes its checkpoint's): pruning removes only
    this run's own checkpoints, never another run's that share the directory."""

    def __init__(self, root: str | os.PathLike, keep_last: int = 2, run_id: str | None = None):
        import uuid

        self.root = Path(root)
        self.keep_last = keep_last
        self.run_id = run_id or uuid.uuid4().hex

    # -- discovery ----------------------------------------------------------------------------------
    def complete(self) -> list[Path]:
        if not self.root.is_dir():
            return []
        found = [p for p in self.root.iterdir() if _STEP_DIR.match(p.name) and is_complete(p)]
        return sorted(found, key=lambda p: int(_STEP_DIR.match(p.name).group(1)))

    def latest(self) -> Path | None:
        done = self.complete()
        return done[-1] if done else None

    def own(self) -> list[Path]:
        """The complete checkpoints this run wrote (their marker records its run id), oldest step first."""
        def run_of(path: Path) -> str | None:
            try:
                return read_marker(path).get("run_id")
            except CheckpointError:
                return None

        return [p for p in self.complete() if run_of(p) == self.run_id]

    def clean_stale(self) -> list[str]:
        """Remove what killed saves left in the root (atomic_dir's `.step_*.tmp-*` / `.old-*` dirs), never a
        live writer's (its pid, in the name, still runs); rank 0 reports each one. Returns the names removed
        (on rank 0). The run holds the run-dir lock (fileio.RunDirLock): no other trainer writes here."""
        removed = []
        if ranks.rank() == 0 and self.root.is_dir():
            for stale in sorted(self.root.iterdir()):
                if _STALE_DIR.match(stale.name) and not temp_writer_alive(stale.name):
                    shutil.rmtree(stale, ignore_errors=True)
                    removed.append(stale.name)
            if removed:
                log.info(f"removed {len(removed)} leftover(s) of an interrupted checkpoint save in {self.root}: "
                         f"{', '.join(removed)}")
        ranks.barrier()
        return removed

    # -- save ---------------------------------------------------------------------------------------
    def save(self, step: int, model, optimizer, extra: dict[str, Any] | None = None) -> Path:
        """Collective: every rank writes its shards; rank 0 renames the checkpoint into place and prunes this
        run's own checkpoints to `keep_last` (another run's in the same root are never removed).
        (A killed earlier run's temp dirs are removed once, at the run's start: `clean_stale`.)"""
        final = save_checkpoint(self.root / f"step_{step:08d}", model, optimizer,
                                {**(extra or {}), "step": step, "run_id": self.run_id},
                                force=True, run_id=self.run_id)  # a step re-run after a resume replaces its checkpoint
        if ranks.rank() == 0 and self.keep_last > 0:
            for old in self.own()[: -self.keep_last]:
                shutil.rmtree(old, ignore_errors=True)
        ranks.barrier()
        return final

    # -- load ---------------------------------------------------------------------------------------
    def resume_path(self, mode: str) -> Path | None:
        """COLLECTIVE. The checkpoint `checkpoint.resume` names (auto | force | none | <path>), verified
        against the sizes and digests recorded at save time (rank 0 reads, every rank gets its answer).
        auto/force: the newest complete checkpoint that verifies; newer ones that fail are named in a warning.
        A named path that fails verification is a CheckpointError. None: start fresh."""
        if mode == "none":
            return None
        answer = ""
        if ranks.rank() == 0:
            try:
                path = self._newest_verified() if mode in ("auto", "force") else self._verified(Path(mode))
                answer = json.dumps({"path": str(path) if path else None})
            except CheckpointError as err:
                answer = json.dumps({"error": str(err)})
        answer = json.loads(ranks.broadcast_str(answer))
        if "error" in answer:
            raise CheckpointError(answer["error"])
        return Path(answer["path"]) if answer["path"] else None

    def _verified(self, path: Path) -> Path:
        if path.is_dir() and is_complete(path):  # otherwise load() names what is wrong
            try:
                problems = verify_checkpoint(path)
            except CheckpointError as err:  # a damaged marker
                raise CheckpointError(f"{err}; {_RESUME_FIX}") from None
            if problems:
                raise CheckpointError(f"checkpoint {path} is corrupted: {'; '.join(problems[:4])}; {_RESUME_FIX}")
        return path

    def _newest_verified(self) -> Path | None:
        failed: list[tuple[Path, list[str]]] = []
        for path in reversed(self.complete()):
            try:
                problems = verify_checkpoint(path)
            except CheckpointError as err:  # a damaged marker: fall back past it like a damaged shard
                problems = [str(err)]
            if not problems:
                for bad, why in failed:
                    log.warning(f"checkpoint {bad} fails verification ({'; '.join(why[:3])}); resuming "
                                f"from the previous complete checkpoint {path} instead")
                return path
            failed.append((path, problems))
        if failed:
            listing = "; ".join(f"{p.name}: {why[0]}" for p, why in failed)
            raise CheckpointError(f"no checkpoint in {self.root} passes verification ({listing}); set "
                                  "checkpoint.resume=none to start over (its checkpoints are replaced), or "
                                  "checkpoint.resume=<dir> with a good copy")
        return None

    def resume(self, mode: str, model, optimizer) -> dict[str, Any] | None:
        """Load per `checkpoint.resume` (auto | force | none | <path>); the loaded extra state, None when starting
        fresh. (A run compares its config with the checkpoint's in between: run_context.resume_run.)"""
        path = self.resume_path(mode)
        return None if path is None else self.load(path, model, optimizer)

    def load(self, path: str | os.PathLike, model, optimizer) -> dict[str, Any]:
        """Model and optimizer loaded; returns the extra state (its "step": the step to start from)."""
        path = Path(path)
        state = load_checkpoint(path, model, optimizer, fix=_RESUME_FIX, digests=False)  # resume_path verified
        if not state or "step" not in state:
            raise CheckpointError(f"checkpoint {path} has no step in its {EXTRA_STATE_NAME}: it is not a run "
                                  f"checkpoint; pass it as model.init_checkpoint instead")
        if isinstance(state.get("run_id"), str):  # the run goes on: its pruning covers what it wrote before
            self.run_id = state["run_id"]
        if ranks.rank() == 0:
            log.info(f"resumed from {path} (step {state['step']})")
        return state
