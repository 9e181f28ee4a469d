"""Which tokenizer a checkpoint records and which one an output gets (qarl-convert mcore-to-hf / export, and the
engine start-up checkpoint a run writes): `--tokenizer PATH|char`, else the checkpoint's recorded tokenizer
source (checkpointing.format.TOKENIZER_SOURCE_KEY), else the tokenizer files it stores; with none of these, one
warning line says how to add one."""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

from megatron_qarl.parallel import is_logging_rank
from megatron_qarl.weights.convert_errors import ConversionError
from megatron_qarl.weights.hf_io import CONFIG_NAME, TOKENIZER_FILES

log = logging.getLogger(__name__)


CHAR_TOKENIZER = "char"
NOT_TOKENIZER = ("generation_config.json",)  # stored with the tokenizer files, kept whichever tokenizer is written


def copy_tokenizer_files(files: dict[str, bytes], out: Path) -> None:
    for name, data in files.items():
        if name != CONFIG_NAME:
            (out / name).write_bytes(data)


def tokenizer_source(model_cfg) -> str:
    """What a run records under TOKENIZER_SOURCE_KEY (checkpointing.format): the tokenizer
    `tokenizer.load_tokenizer` loads for `model_cfg` (model.tokenizer, else model.hf_path, else the char tokenizer),
    a local path made absolute."""
    source = model_cfg.tokenizer or model_cfg.hf_path or CHAR_TOKENIZER
    if source != CHAR_TOKENIZER and Path(source).exists():
        return str(Path(source).resolve())
    return source


TOKENIZER_FIX = (f"pass --tokenizer PATH (an HF dir with tokenizer.json / tokenizer_config.json) or --tokenizer "
                 f"{CHAR_TOKENIZER} (the demo char tokenizer)")


class TokenizerLoadError(ConversionError):
    """A tokenizer source that does not load; `reason` says why, without the fix."""

    def __init__(self, what: str, source: str, reason: str):
        self.reason = f"{what} {source} {reason}"
        super().__init__(f"{self.reason}; {TOKENIZER_FIX}")


def load_tokenizer_source(source: str, what: str):
    """The HF tokenizer `source` names: "char" (the demo char tokenizer) or an HF tokenizer dir / hub name."""
    if source == CHAR_TOKENIZER:
        from megatron_qarl.tokenizer import build_char_tokenizer

        return build_char_tokenizer()
    if (os.path.isabs(source) or source.startswith((".", "~"))) and not Path(source).expanduser().is_dir():
        raise TokenizerLoadError(what, source, "does not exist")
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(source)
    except Exception as exc:  # noqa: BLE001 - transformers raises many kinds for an unloadable tokenizer
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise TokenizerLoadError(what, source, f"cannot be loaded as a tokenizer ({type(exc).__name__}: {first})"
                                 ) from exc


@dataclass
class TokenizerPlan:
    """The tokenizer an output gets: `tokenizer` saved with save_pretrained (None: none to save) and `files`
    copied as they are (stored tokenizer files, generation_config.json)."""

    tokenizer: object | None
    files: dict[str, bytes]

    @classmethod
    def saving(cls, tokenizer, side_files: dict[str, bytes]) -> "TokenizerPlan":
        """Save `tokenizer`, and copy only the side files kept whichever tokenizer is written."""
        return cls(tokenizer, {n: b for n, b in side_files.items() if n in NOT_TOKENIZER})

    def write(self, out: Path) -> None:
        copy_tokenizer_files(self.files, out)
        if self.tokenizer is not None:
            self.tokenizer.save_pretrained(str(out))


def plan_tokenizer(side_files: dict[str, bytes], *, explicit: str | None = None, recorded: str | None = None,
                   out: str | os.PathLike | None = None) -> TokenizerPlan:
    """Which tokenizer an export writes: `explicit` (--tokenizer) if given, else the checkpoint's `recorded`
    source, else the tokenizer files stored in `side_files`. A recorded source that no longer loads falls back
    to the stored files with a warning (an error when there are none); nothing at all is one warning line."""
    stored = {n: b for n, b in side_files.items() if n in TOKENIZER_FILES}
    has_stored = any(n not in NOT_TOKENIZER for n in stored)
    if explicit:
        return TokenizerPlan.saving(load_tokenizer_source(explicit, "--tokenizer"), stored)
    if recorded:
        try:
            return TokenizerPlan.saving(load_tokenizer_source(recorded, "the checkpoint's tokenizer source"), stored)
        except TokenizerLoadError as exc:
            if not has_stored:
                raise
            _warn(f"{exc.reason}; writing the tokenizer files stored in the checkpoint instead (--tokenizer "
                  "PATH|char chooses another)")
    if not has_stored:
        _warn(f"{out or 'the output'} gets no tokenizer: the source records none and no --tokenizer was given, and "
              f"SGLang / vLLM / transformers need one; {TOKENIZER_FIX}")
    return TokenizerPlan(None, stored)


def _warn(message: str) -> None:
    if is_logging_rank():  # global rank 0, as the conversion's other lines
        log.warning(message)
