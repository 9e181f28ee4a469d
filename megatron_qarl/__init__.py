"""megatron-qarl: rollout-aligned quantization-aware RL (QaRL) with TBPO on megatron-core."""

__version__ = "0.1.0"

# megatron-core warns on every import that TransformerEngine / Apex are missing and it falls back to torch
# (megatron/core/optimizer/__init__.py:25, optimizer.py:29, clip_grads.py:30, models/backends.py:21, ...): true on
# every CPU machine and said on every command. What the run uses instead is the project's choice (README, "What
# runs where"), so these are silenced here, before any megatron import.
import warnings as _warnings

_warnings.filterwarnings("ignore", message=r"(Transformer Engine and )?Apex (is|are) not installed", category=UserWarning)
_warnings.filterwarnings("ignore", message=r"Transformer Engine and Apex are not installed", category=UserWarning)

# The package's one console voice is Python logging: every module logs to `logging.getLogger(__name__)`, and the
# package logger (here, so that a run, a test calling a function, a torchrun worker and a helper process all have it
# without an entry point setting it up) writes each record as one line `[tag] message` to the stdout of the moment
# (pytest's capture, a worker's pipe, a terminal). INFO and above; a warning says "warning:". The tag is the
# component the user knows (qarl, publish); a record still propagates, so an application's own
# logging configuration (or pytest's caplog) sees it too.
import logging as _logging
import sys as _sys

# logger-name prefix -> (tag, stream name); the longest prefix wins; tag "" prints the message alone
_CONSOLE_TAGS = {
    "megatron_qarl": ("qarl", "stdout"),
    "megatron_qarl.sft": ("sft", "stdout"),
    "megatron_qarl.weights.publish": ("publish", "stdout"),
    "megatron_qarl.weights.convert": ("qarl-convert", "stderr"),  # stdout is the command's result (inspect)
    "megatron_qarl.weights.tokenizer_plan": ("qarl-convert", "stderr"),
    "megatron_qarl.rollout.sglang_readback": ("", "stdout"),  # its messages carry their own "[publish]"
    "megatron_qarl.tracking.progress": ("", "stdout"),  # the per-step progress line is the line itself
}


class _ConsoleHandler(_logging.Handler):
    def emit(self, record: _logging.LogRecord) -> None:
        try:
            name = max((p for p in _CONSOLE_TAGS if record.name == p or record.name.startswith(p + ".")), key=len)
            tag, stream = _CONSOLE_TAGS[name]
            message = record.getMessage()
            if record.levelno >= _logging.WARNING:
                message = f"warning: {message}"
            print(f"[{tag}] {message}" if tag else message, file=getattr(_sys, stream), flush=True)
        except Exception:  # noqa: BLE001 - logging must never end the run; the stdlib's own fallback reports it
            self.handleError(record)


_console = _logging.getLogger(__name__)
if not any(isinstance(h, _ConsoleHandler) for h in _console.handlers):
    _console.addHandler(_ConsoleHandler())
    _console.setLevel(_logging.INFO)
