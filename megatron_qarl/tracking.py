"""Metrics sinks for a run: metrics.jsonl (every step; `logging.jsonl`), samples.jsonl (the samples the trainer
hands over), wandb (offline unless a key or online mode is set; WANDB_MODE wins), TensorBoard event files,
a console progress line (every `logging.log_every` steps) and PNG plots (refreshed every `plot_every` steps
and at the end; `logging.plots`).

Only the rank that owns logging (global rank 0) creates a tracker; other ranks pass their numbers to it
through the trainer's reductions.
"""
from __future__ import annotations

import io
import json
import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron_qarl.errors import UserError
from megatron_qarl.fileio import append_text, atomic_write_bytes, atomic_write_text, check_own_file

log = logging.getLogger(__name__)
progress_log = logging.getLogger(f"{__name__}.progress")  # printed as the line alone

# The curves a reader of a QaRL run looks at first: learning progress, response length, the
# sampler<->learner mismatch, how much the trust band masks, and cost. Every metric under one of
# PLOTTED_PREFIXES is plotted too (held-out eval: eval/pass@1, eval/pass@{k}, eval/mean_reward).
PLOTTED_METRICS = (
    ("reward/mean", "reward"),
    ("response/length_mean", "response length (tokens)"),
    ("mismatch/k3", "sampler-learner KL (k3)"),
    ("tbpo/masked_frac", "masked sequence fraction"),
    ("time/step_s", "step time (s)"),
)
PLOTTED_PREFIXES = ("eval/",)
# Settings logged beside the metrics (what a pass meant), neither plotted nor printed on the console line.
UNPLOTTED_METRICS = ("eval/pass_threshold",)


# The console line: the handful of numbers that say whether a QaRL step went well, and what it cost
# (then any eval/ metric of the row; a row with eval metrics is always printed).
PROGRESS_METRICS = (("reward/mean", "reward"), ("loss/value", "loss"), ("mismatch/k3", "k3"),
                    ("tbpo/kept_frac", "kept"), ("publish/code_flip_frac", "flips"),
                    ("publish/quantized_bytes_frac", "sent"), ("time/step_s", "s/step"))

# What wandb.init(mode=...) and the WANDB_MODE variable accept; dryrun is offline, run and shared are online.
WANDB_MODES = ("offline", "online", "disabled", "dryrun", "run", "shared")
_ONLINE_MODES = ("online", "run", "shared")


class TrackingError(ValueError, UserError):
    """A metrics sink that cannot work as configured (e.g. online wandb without credentials)."""


# ------------------------------------------------------------------------------------------------ run dirs

# What an out dir holds of a run that a new run must never replace silently (checkpoints: RESULT_DIRS).
RESULT_FILES = ("metrics.jsonl", "samples.jsonl", "eval_samples.jsonl")


def run_results(out_dir, checkpoint_dir=None, *, checkpoints: bool = True, plots: bool = True) -> list[str]:
    """The results of an earlier run in `out_dir` (and its checkpoint dir, default <out_dir>/checkpoints):
    non-empty metrics / samples files, plots, TensorBoard events, step checkpoints; [] for a missing or fresh dir."""
    out = Path(out_dir)
    found = [name for name in RESULT_FILES if (out / name).is_file() and (out / name).stat().st_size > 0]
    if out.is_dir():
        pngs = sorted(p.name for p in out.glob("*.png")) if plots else []
        if pngs:
            found.append(f"{len(pngs)} plot(s)")
        if any((out / "tensorboard").glob("events.out.tfevents.*")):
            found.append("tensorboard/")
    ckpts = Path(checkpoint_dir or out / "checkpoints")
    steps = sorted(p.name for p in ckpts.glob("step_*")) if checkpoints and ckpts.is_dir() else []
    if steps:
        found.append(f"{len(steps)} checkpoint(s) in {ckpts}")
    return found


def moved_aside_name(path) -> Path:
    """`<path>.old-<YYYYmmdd-HHMMSS>` (then -2, -3, ... if taken): where an overwritten run's dir goes."""
    import time

    path = Path(path)
    base = path.with_name(f"{path.name}.old-{time.strftime('%Y%m%d-%H%M%S')}")
    candidate, n = base, 1
    while candidate.exists():
        n += 1
        candidate = base.with_name(f"{base.name}-{n}")
    return candidate


def prepare_run_dir(out_dir, checkpoint_dir=None, *, continuing: bool, overwrite: bool, why_fresh: str = "") -> list[Path]:
    """Make `out_dir` ready for a run without losing an earlier run's results (rank 0, before anything is written).

    continuing (the run resumes this dir's checkpoint, or re-runs this experiment's own interrupted start): the
    results stay, and the tracker appends / truncates them as the resume defines. Otherwise, results there are
    refused with one line naming the choices (TrackingError), unless `overwrite` (logging.overwrite=true): then
    the dir (and an outside checkpoint dir holding checkpoints) is renamed to `<dir>.old-<timestamp>`, never
    deleted. Returns the dirs moved aside."""
    results = [] if continuing else run_results(out_dir, checkpoint_dir)
    if not results:
        return []
    if not overwrite:
        raise TrackingError(
            f"logging.out_dir={str(out_dir)!r} holds an earlier run's results ({', '.join(results)}) and this run "
            f"would start fresh{f' ({why_fresh})' if why_fresh else ''}; choose one: resume it "
            f"(checkpoint.resume=auto), write to a new logging.out_dir, or set logging.overwrite=true to move the "
            f"old results to {Path(out_dir).name}.old-<timestamp> (nothing is deleted)")
    moved = []
    dirs = [Path(out_dir)]
    if checkpoint_dir is not None and Path(out_dir).resolve() not in Path(checkpoint_dir).resolve().parents \
            and any(Path(checkpoint_dir).glob("step_*")):
        dirs.append(Path(checkpoint_dir))
    for d in dirs:
        if d.exists():
            dest = moved_aside_name(d)
            d.rename(dest)
            moved.append(dest)
            log.info(f"logging.overwrite=true: moved the earlier run's {d} to {dest} (nothing deleted)")
    return moved


@dataclass
class TrackerConfig:
    out_dir: str
    project: str = "megatron-qarl"
    run_name: str = "run"
    # offline | online | disabled (or another WANDB_MODES value); WANDB_MODE in the environment wins.
    # Without it: online when asked for or when WANDB_API_KEY is set, else this mode.
    wandb_mode: str = "offline"
    entity: str | None = None  # wandb entity (team or user); None: the account's default
    wandb_run_id: str | None = None  # the wandb run to continue (resume); None: a new run with a new id
    config: dict | None = None
    jsonl: bool = True  # write <out_dir>/metrics.jsonl, one row per step
    samples: bool = True  # write <out_dir>/samples.jsonl from log_samples(), one line per sample
    tensorboard: bool = False  # write TensorBoard event files (every numeric metric) to <out_dir>/tensorboard
    plots: bool = True  # write one PNG per plotted curve, every `plot_every` steps and at finish()
    plot_every: int = 10  # refresh the plots every N steps; 0: only at finish()
    log_every: int = 1  # print the progress line every N steps (and at the last step)
    total_steps: int | None = None  # for "step k/N" and the last-step line

    def __post_init__(self):
        if self.wandb_mode not in WANDB_MODES:
            raise ValueError(f"wandb_mode={self.wandb_mode!r}: expected one of {', '.join(WANDB_MODES)}")
        if self.log_every < 1:
            raise ValueError(f"log_every={self.log_every}: must be >= 1")
        if self.plot_every < 0:
            raise ValueError(f"plot_every={self.plot_every}: must be >= 0 (0: plots only at finish)")


class MetricsTracker:
    def __init__(self, cfg: TrackerConfig, *, resume: bool = False, start_step: int | None = None):
        """resume: keep metrics.jsonl, samples.jsonl and eval_samples.jsonl, minus their rows of steps >=
        `start_step` (the steps this run re-runs), so every step has one row, continue the wandb run
        `cfg.wandb_run_id` and hide the TensorBoard points of steps >= `start_step`. Otherwise the dir must hold
        no earlier run's results (prepare_run_dir moves them aside first): a TrackingError, never a deletion."""
        self.cfg = cfg
        self.out_dir = Path(cfg.out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.jsonl_path = self.out_dir / "metrics.jsonl"
        self.samples_path = self.out_dir / "samples.jsonl"
        self.eval_samples_path = self.out_dir / "eval_samples.jsonl"
        self.tensorboard_dir = self.out_dir / "tensorboard"
        if not resume:
            # (plots are redrawn from this run's rows; checkpoints are the run's resume decision)
            found = run_results(self.out_dir, checkpoints=False, plots=False)
            if found:
                raise TrackingError(f"{self.out_dir} holds an earlier run's results ({', '.join(found)}); a fresh "
                                    "run does not replace them: resume it, or use another out dir (qarl-train: "
                                    "logging.overwrite=true moves them aside)")
        for path in (self.jsonl_path, self.samples_path, self.eval_samples_path):
            check_own_file(path)  # a planted link: refused before it is read, rewritten or appended to
            if resume and start_step is not None and path.exists():
                _truncate_jsonl(path, start_step)
        self._rows: list[dict] = []  # what summary() and the plots read when there is no metrics.jsonl
        self._plot_warned = False  # a failing plot warns once, until plots are written again
        self._wandb = _init_wandb(cfg, self.out_dir)
        self._tb = None
        if cfg.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(self.tensorboard_dir), purge_step=start_step if resume else None)

    @property
    def wandb_run_id(self) -> str | None:
        """The wandb run's id (to store in a checkpoint and pass back as `wandb_run_id` on resume); None
        when wandb is off."""
        return None if self._wandb is None else self._wandb.id

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        metrics = {k: _plain(v) for k, v in metrics.items()}
        row = {"step": step, **{k: _json_safe(v) for k, v in metrics.items()}}
        if self.cfg.jsonl:
            append_text(self.jsonl_path, json.dumps(row) + "\n")  # never through a link (fileio.open_own_file)
        else:
            self._rows.append(row)
        if self._wandb is not None:
            self._wandb.log(row, step=step)
        if self._tb is not None:
            for key, value in metrics.items():
                if _is_number(value):
                    self._tb.add_scalar(key, value, step)
        last = self.cfg.total_steps is not None and step + 1 == self.cfg.total_steps
        has_eval = any(k.startswith("eval/") for k in metrics)
        if (step + 1) % self.cfg.log_every == 0 or last or has_eval:
            progress_log.info(progress_line(step, self.cfg.total_steps, metrics))
        every = self.cfg.plot_every
        if self.cfg.plots and every and (step + 1) % every == 0 and not last:  # the last step's: finish()
            self._plot()

    def log_samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        """Append one JSON line per sample, {"step": step, **row} (prompt, response, reward, answer, ...), to
        <out_dir>/samples.jsonl; nothing when `samples` is off."""
        if self.cfg.samples:
            _append_jsonl(self.samples_path, step, rows)

    def log_eval_samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        """Append every response of a held-out evaluation, {"step": step, **row}, to <out_dir>/eval_samples.jsonl
        (`step` is the metrics row the evaluation is logged in)."""
        _append_jsonl(self.eval_samples_path, step, rows)

    def restore_row(self, record: dict) -> list[str]:
        """Log what a checkpoint recorded of its step's row (run_context.logged_row: {"step", "metrics", "samples",
        "eval_samples"}) where the files lack it: the run that wrote the checkpoint was killed before it logged the
        row (the publish runs between the two). Returns the files the row was restored to (and says so)."""
        step, restored = record["step"], []
        if not any(r.get("step") == step for r in self.rows()):
            self.log(step, {**record["metrics"], "restored_from_checkpoint": 1.0})
            restored.append(self.jsonl_path.name if self.cfg.jsonl else "metrics")
        for rows, path, write in ((record.get("samples"), self.samples_path, self.log_samples),
                                  (record.get("eval_samples"), self.eval_samples_path, self.log_eval_samples)):
            if rows and (path != self.samples_path or self.cfg.samples) and step not in _steps_of(path):
                write(step, rows)
                restored.append(path.name)
        if restored:
            log.info(f"step {step}'s row was checkpointed but never logged (the run was killed during the publish "
                     f"after its checkpoint): restored to {', '.join(restored)} from the checkpoint")
        return restored

    def rows(self) -> list[dict]:
        """Every logged row; with metrics.jsonl that includes the rows of the run this one resumed."""
        if not self.cfg.jsonl:
            return list(self._rows)
        if not self.jsonl_path.exists():
            return []
        return [json.loads(line) for line in self.jsonl_path.read_text().splitlines() if line.strip()]

    def summary(self, key: str = "reward/mean", window: int = 5) -> str | None:
        """'first-window mean -> last-window mean' of a metric: the one-line answer to "did it learn?"."""
        values = [r[key] for r in self.rows() if _is_number(r.get(key))]
        if len(values) < 2:
            return None
        k, first, last = first_last_means(values, window)
        return f"{key}: first {k} steps {first:.3f} -> last {k} steps {last:.3f} ({last - first:+.3f})"

    def _plot(self) -> list[Path]:
        """The plots, best effort: a failure (a full disk) prints one warning line (then none until plots
        are written again) and leaves no temp file; it never becomes the run's error."""
        try:
            written = plot_metrics(self.rows(), self.out_dir)
        except Exception as exc:  # noqa: BLE001 - plots are a convenience; the metrics are in the jsonl
            if not self._plot_warned:
                log.info(f"plots not written to {self.out_dir}: {exc}")
            self._plot_warned = True
            return []
        self._plot_warned = False
        return written

    def finish(self, *, failed: bool = False) -> list[Path]:
        """Close the sinks; returns the files the run's metrics are in (metrics.jsonl, samples.jsonl, the
        TensorBoard dir, plots).

        Plots are best effort (see `_plot`). A failed run (`failed`) draws none: the error that stopped it is
        the one to report, and the disk may be the reason. Closing wandb or TensorBoard is best effort too."""
        written = [self.jsonl_path] if self.cfg.jsonl and self.jsonl_path.exists() else []
        if self.cfg.samples and self.samples_path.exists():
            written.append(self.samples_path)
        if self.eval_samples_path.exists():
            written.append(self.eval_samples_path)
        if self._tb is not None:
            try:
                self._tb.close()  # flushes
                written.append(self.tensorboard_dir)
            except Exception as exc:  # noqa: BLE001 - never the run's error
                log.info(f"tensorboard not closed cleanly: {exc}")
            self._tb = None
        if self.cfg.plots and not failed:
            written += self._plot()
        if self._wandb is not None:
            try:
                self._wandb.finish(exit_code=1 if failed else 0)
            except Exception as exc:  # noqa: BLE001 - same: never the run's error
                log.info(f"wandb not closed cleanly: {exc}")
        return written


def plain_row(row: dict[str, Any]) -> dict[str, Any]:
    """A row's values as the JSONL files hold them (plain numbers and strings)."""
    return {k: _json_safe(_plain(v)) for k, v in row.items()}


def _steps_of(path: Path) -> set:
    """The steps a {"step": ...} jsonl holds rows of (a torn line is skipped)."""
    steps = set()
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                steps.add(json.loads(line).get("step"))
            except (ValueError, AttributeError):
                continue
    return steps


def _append_jsonl(path: Path, step: int, rows: list[dict[str, Any]]) -> None:
    if not rows:
        return
    text = "".join(json.dumps({"step": step, **{k: _json_safe(_plain(v)) for k, v in r.items()}}) + "\n"
                   for r in rows)
    append_text(path, text)  # one write: a kill tears at most the last line, which a resume drops


def _truncate_jsonl(path: Path, start_step: int) -> None:
    """Rewrite a jsonl of {"step": ...} rows (atomically) without the rows of steps >= start_step."""
    lines = path.read_text().splitlines()
    kept = []
    for line in lines:
        if not line.strip():
            continue
        try:
            step = json.loads(line).get("step")
        except (json.JSONDecodeError, AttributeError):
            continue  # a row torn by a kill mid-write
        if isinstance(step, int) and step < start_step:
            kept.append(line)
    if len(kept) != len(lines):
        atomic_write_text(path, "".join(line + "\n" for line in kept))
        log.info(f"{path.name}: dropped {len(lines) - len(kept)} row(s) of step {start_step} and later "
                 "(re-run after the resume)")


def progress_line(step: int, total: int | None, metrics: dict[str, Any]) -> str:
    """'step k/N' (row `step` is the k = step + 1-th RL step) and the PROGRESS_METRICS it has, then its eval/
    metrics, labelled with the weights they measured: a row's evaluation ran before its step, on the weights
    after `step` steps ('eval at start' for row 0). A row with only eval metrics (the final evaluation, row N)
    is 'eval after step N/N'."""
    # NaN = not measured this step (e.g. code flips of a full-mode publisher that does not count them)
    parts = [f"{label} {metrics[k]:.4g}" for k, label in PROGRESS_METRICS
             if _is_number(metrics.get(k)) and not math.isnan(metrics[k])]
    evals = [f"{k} {v:.4g}" for k, v in sorted(metrics.items())
             if k.startswith("eval/") and k not in UNPLOTTED_METRICS and _is_number(v)]
    of = total if total is not None else "?"
    when = "eval at start" if step == 0 else f"eval after step {step}/{of}"
    if evals and not parts:
        return f"[qarl] {when}:  " + "  ".join(evals)
    line = f"[qarl] step {step + 1}/{of}  " + "  ".join(parts)
    return line + (f"  | {when}:  " + "  ".join(evals) if evals else "")


def first_last_means(values: list[float], window: int = 5) -> tuple[int, float, float]:
    """(k, mean of the first k, mean of the last k) with k = window, or fewer so the two do not overlap."""
    k = max(1, min(window, len(values) // 2))
    return k, sum(values[:k]) / k, sum(values[-k:]) / k


def resolve_wandb_mode(requested: str) -> str:
    """WANDB_MODE from the environment wins (any mode wandb accepts); without it, online only when asked for
    or when an API key is present, else the requested mode (offline or disabled)."""
    env = os.environ.get("WANDB_MODE", "").strip()
    if env:
        if env not in WANDB_MODES:
            raise ValueError(f"WANDB_MODE={env!r}: expected one of {', '.join(WANDB_MODES)}")
        return env
    if requested == "disabled":
        return "disabled"
    if requested in _ONLINE_MODES:
        return requested
    return "online" if os.environ.get("WANDB_API_KEY") else "offline"


def _unreachable_wandb_server(timeout_s: float = 5.0) -> str | None:
    """Why the wandb server ($WANDB_BASE_URL, else api.wandb.ai) cannot be reached, or None: one TCP connect, at
    most `timeout_s`. Behind a proxy ($HTTPS_PROXY / $ALL_PROXY) nothing is tried (wandb goes through it)."""
    import socket
    from urllib.parse import urlsplit

    if any(os.environ.get(v) for v in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy", "HTTP_PROXY",
                                       "http_proxy")):
        return None
    url = os.environ.get("WANDB_BASE_URL") or "https://api.wandb.ai"
    parts = urlsplit(url if "://" in url else f"https://{url}")
    port = parts.port or (80 if parts.scheme == "http" else 443)
    try:
        socket.create_connection((parts.hostname or "", port), timeout=timeout_s).close()
    except OSError as err:
        return f"the server {url} cannot be reached ({err.strerror or type(err).__name__})"
    return None


def _init_wandb(cfg: TrackerConfig, out_dir: Path):
    mode = resolve_wandb_mode(cfg.wandb_mode)
    if mode == "disabled":
        return None  # before any `import wandb`
    import wandb

    try:
        logged_in = mode not in _ONLINE_MODES or wandb.login(prompt=False, verify=False)
    except Exception as exc:  # noqa: BLE001 - e.g. wandb's service process did not answer in time (a busy machine)
        raise TrackingError(f"wandb mode {mode!r}: looking for credentials failed ({str(exc).splitlines()[0][:200]});"
                            " set WANDB_API_KEY or run `wandb login`, or log offline (WANDB_MODE=offline)") from exc
    if not logged_in:
        # never block on wandb's login prompt (nor start hours of training that cannot be logged as asked)
        raise TrackingError(f"wandb mode {mode!r} needs credentials and none were found: set WANDB_API_KEY or "
                           "run `wandb login`, or log offline (WANDB_MODE=offline, `wandb sync` later)")
    unreachable = _unreachable_wandb_server() if mode in _ONLINE_MODES else None
    if unreachable:  # wandb would retry for minutes, then raise: it is a view of metrics.jsonl, log it offline
        log.info(f"wandb: {unreachable}; logging offline to {out_dir}/wandb instead (`wandb sync` it later)")
        mode = "offline"
    kw = dict(project=cfg.project, entity=cfg.entity, name=cfg.run_name, mode=mode, dir=str(out_dir),
              config=cfg.config or {}, settings=wandb.Settings(silent=True, console="off"))
    if cfg.wandb_run_id is None:
        return wandb.init(**kw)
    try:
        return wandb.init(id=cfg.wandb_run_id, resume="allow", **kw)
    except Exception as exc:  # noqa: BLE001 - e.g. "run ID is in use" while a killed run's wandb service lingers
        # wandb is a view of metrics.jsonl: a resume must not fail because wandb cannot continue its run
        log.info(f"wandb could not continue run {cfg.wandb_run_id} ({str(exc).splitlines()[0]}); logging "
                 "this run's steps to a new wandb run (metrics.jsonl holds them all)")
        return wandb.init(**kw)


def _plain(value: Any) -> Any:
    if hasattr(value, "item"):
        value = value.item()
    return value


def _json_safe(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _plotted(rows: list[dict]) -> list[tuple[str, str]]:
    """(key, label) of every curve to draw: PLOTTED_METRICS, then each key under PLOTTED_PREFIXES."""
    keys = sorted({k for r in rows for k in r if k.startswith(PLOTTED_PREFIXES) and k not in UNPLOTTED_METRICS})
    return [*PLOTTED_METRICS, *((k, k) for k in keys)]


def plot_metrics(rows: list[dict], out_dir: Path) -> list[Path]:
    """One PNG per plotted metric present in the rows; written atomically."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    for key, label in _plotted(rows):
        points = [(r["step"], r[key]) for r in rows if _is_number(r.get(key))]
        if not points:
            continue
        fig, ax = plt.subplots(figsize=(5, 3.2))
        try:
            ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", markersize=3)
            ax.set_xlabel("step")
            ax.set_ylabel(label)
            ax.grid(alpha=0.3)
            fig.tight_layout()
            png = io.BytesIO()
            fig.savefig(png, format="png", dpi=100)  # in memory: only the atomic write below touches disk
        finally:
            plt.close(fig)
        written.append(atomic_write_bytes(out_dir / f"{key.replace('/', '_')}.png", png.getvalue()))
    return written
