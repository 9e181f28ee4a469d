"""What a run can check before it builds a model, beyond its config: the prompt rows (training and held-out, read
and checked by `rl.data`), the reward function smoke-called on a few real rows with its return values checked,
and the tokenizer's coverage of the system prompt, the template, the stop strings and the prompts themselves.

`qarl-train --dry-run` runs these beside the config, layout and memory plan; a real run runs the same on every
rollout-group leader right after reading its prompts, before the model is built (run_context.load_run_data).
A problem is raised as one line naming the key and the fix (RewardError, TokenizerError); what may be fine is
returned as a warning line (a character the tokenizer lacks in a prompt reaches the model as its unknown token).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from megatron_qarl.rl.rewards import REWARD_NAMES, RewardError
from megatron_qarl.tokenizer import CHAR_VOCABULARY, TokenizerError, describe_characters, unknown_characters

SMOKE_ROWS = 4  # rows the reward is called on (each with its own answer as a response, and an empty response)
PROMPT_KEYS = (("data.prompt.system", "system"), ("data.prompt.template", "template"))


@dataclass
class InputReport:
    """What the checks found: informational lines (what was read, what the reward returned) and warnings."""

    notes: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    def lines(self) -> list[str]:
        return self.notes + [f"WARNING: {w}" for w in self.warnings]


def _vocabulary_hint(tokenizer) -> str:
    if len(tokenizer) <= 256 and getattr(tokenizer, "chat_template", None) and "<unk>" in tokenizer.get_vocab():
        return f"the char tokenizer (model.tokenizer=char) knows only {CHAR_VOCABULARY}"
    return "use characters the tokenizer has, or another model.tokenizer"


def tokenizer_coverage(cfg, tokenizer) -> list[str]:
    """Warnings for the system prompt and the template (their unknown characters reach the model as the unknown
    token); a TokenizerError for a stop string with a character the tokenizer lacks: generated text is made of the
    tokenizer's tokens, so it can never contain that string."""
    unk = getattr(tokenizer, "unk_token", None) or "the unknown token"
    warnings = []
    prompt = cfg.data.prompt
    for key, attr in PROMPT_KEYS:
        text = getattr(prompt, attr) or ""
        if attr == "template":
            text = text.replace("{problem}", "")
        chars = unknown_characters(tokenizer, text)
        if chars:
            warnings.append(f"{key}={getattr(prompt, attr)!r}: {describe_characters(chars)} not in the tokenizer's "
                            f"vocabulary: the model sees {unk} in their place; {_vocabulary_hint(tokenizer)}")
    for stop in cfg.rollout.stop:
        chars = unknown_characters(tokenizer, stop)
        if chars:
            raise TokenizerError(
                f"rollout.stop={stop!r} can never match: {describe_characters(chars)} not in the tokenizer's "
                f"vocabulary, so no generated text holds it; write the stop string with characters the tokenizer "
                f"has ({_vocabulary_hint(tokenizer)}), or use rollout.stop_token_ids")
    return warnings


def _model_vocab_size(cfg) -> int | None:
    """The vocab_size of the HF config at model.hf_path (its text config's for a multimodal one); None for a preset
    or an unreadable file (the config check reports that)."""
    import json
    from pathlib import Path

    if not getattr(cfg.model, "hf_path", None):
        return None
    try:
        hf = json.loads((Path(cfg.model.hf_path) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    size = hf.get("vocab_size", (hf.get("text_config") or {}).get("vocab_size"))
    return size if isinstance(size, int) and not isinstance(size, bool) else None


def tokenizer_model_problem(cfg, tokenizer) -> None:
    """TokenizerError when the tokenizer contradicts the model or the run: more tokens than the model's vocab_size
    (their ids index past the embedding), or no EOS token and no stop (no response would end before
    rollout.max_new_tokens, and SFT targets would have no end)."""
    source = cfg.model.tokenizer or cfg.model.hf_path
    vocab = _model_vocab_size(cfg)
    if vocab is not None and len(tokenizer) > vocab:
        raise TokenizerError(
            f"the tokenizer ({source}) has {len(tokenizer)} tokens but the model's vocab_size is {vocab} "
            f"({cfg.model.hf_path}/config.json): ids {vocab}..{len(tokenizer) - 1} would index past its embedding; "
            "use the model's own tokenizer (model.tokenizer=null), or a model whose vocab_size covers it")
    if tokenizer.eos_token_id is None and not cfg.rollout.stop and not cfg.rollout.stop_token_ids:
        raise TokenizerError(
            f"the tokenizer ({source}) has no EOS token and the run sets no stop: no response would end before "
            "rollout.max_new_tokens; set rollout.stop (e.g. ['<|im_end|>']) or rollout.stop_token_ids, or use a "
            "tokenizer with an eos_token")


def prompt_coverage(tokenizer, examples, section: str) -> str | None:
    """A warning when prompts hold characters the tokenizer lacks: how many, and the first such row."""
    unk_id = getattr(tokenizer, "unk_token_id", None)
    if unk_id is None or not examples:
        return None
    hit = [ex for ex in examples if ex.prompt_ids is not None and unk_id in ex.prompt_ids]
    if not hit:
        return None
    first = hit[0]
    chars = unknown_characters(tokenizer, "\n".join(m["content"] for m in first.messages))  # not the template's
    return (f"{section}.path: {len(hit)} of {len(examples)} prompts hold characters the tokenizer lacks (e.g. "
            f"{describe_characters(chars)} in {first.row_id}); the model sees {tokenizer.unk_token} in their place "
            f"(samples.jsonl shows the prompts as the model sees them)")


def _special_token_texts(tokenizer) -> list[str]:
    """The text of every special token of `tokenizer` (its named ones and its added special tokens), longest first."""
    texts = set(getattr(tokenizer, "all_special_tokens", None) or [])
    for added in (getattr(tokenizer, "added_tokens_decoder", None) or {}).values():
        if getattr(added, "special", False):
            texts.add(added.content)
    return sorted((t for t in texts if t), key=len, reverse=True)


def special_token_text(tokenizer, examples, section: str) -> str | None:
    """A warning when the prompts' text holds special-token markup (`<|im_start|>`, `<eos>`, ...). It is encoded as
    the real special tokens, as verl and slime do (and as transformers does by default), so such text in a row can
    forge a conversation turn; a user who did not mean it as markup needs to know. Not an error: prompts that are
    chat-formatted on purpose exist."""
    markers = _special_token_texts(tokenizer)
    if not markers or not examples:
        return None
    hits = []
    for ex in examples:
        text = "\n".join(m["content"] for m in ex.messages if m.get("role") != "system")
        found = next((m for m in markers if m in text), None)
        if found is not None:
            hits.append((ex, found))
    if not hits:
        return None
    first, marker = hits[0]
    return (f"{section}.path: {len(hits)} of {len(examples)} prompts hold the text of a special token of the "
            f"tokenizer (e.g. {marker!r} in {first.row_id}); it is encoded as that token, as verl and slime do, so a "
            "row can forge a turn (e.g. open an assistant turn): remove such text from the rows unless it is "
            "meant as markup")


def reward_smoke(cfg, reward_fn, examples) -> str:
    """Call a reward plug-in on SMOKE_ROWS real rows (each row's answer as its response, then an empty response)
    as the trainer calls it, its return values checked; a problem is one RewardError line. Built-in rewards are
    not called (they are tested); returns what was done."""
    spec = cfg.data.reward
    if spec in REWARD_NAMES:
        return f"reward: built-in {spec!r}"
    rows = list(examples[:SMOKE_ROWS])
    responses = [str(ex.answer) for ex in rows] + ["" for _ in rows]
    answers = [ex.answer for ex in rows] * 2
    try:
        rewards = reward_fn(responses, answers, [ex.row for ex in rows] * 2)
    except RewardError as err:
        raise RewardError(f"data.reward={spec!r} failed its check on {len(rows)} real rows (from "
                          f"{rows[0].row_id}; each row's answer as a response, then an empty response): {err}") from err
    k = len(rows)
    return (f"reward: {spec} called on {k} rows: their answers scored {_fmt(rewards[:k])}, empty responses "
            f"{_fmt(rewards[k:])}")


def _fmt(values) -> str:
    return "[" + ", ".join(f"{v:g}" for v in values) + "]"


def check_run_inputs(cfg, tokenizer, train_examples, eval_examples=None, reward_fn=None) -> InputReport:
    """Every check above on what the run read (the examples `rl.data` loaded and checked): raises the first
    problem, returns the notes and warnings. `reward_fn` is a fresh reward function (the caller closes it); None
    skips the smoke call."""
    report = InputReport()
    tokenizer_model_problem(cfg, tokenizer)
    report.warnings += tokenizer_coverage(cfg, tokenizer)
    for section, examples in (("data", train_examples), ("eval", eval_examples)):
        for warning in (prompt_coverage(tokenizer, examples or [], section),
                        special_token_text(tokenizer, examples or [], section)):
            if warning:
                report.warnings.append(warning)
    if reward_fn is not None:
        report.notes.append(reward_smoke(cfg, reward_fn, list(train_examples) or list(eval_examples or [])))
    return report
