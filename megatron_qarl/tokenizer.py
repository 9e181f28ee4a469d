"""A character-level tokenizer for the tiny CPU demo model (vocab 128).

Each character is one token (WordLevel over single characters), so ``123+456=`` is 8 tokens and the
expected response ``579<eos>`` is 4. The vocabulary holds digits, letters, the punctuation the synthetic
prompts use (including ``\\boxed{}``), space and newline: 87 tokens, well below the tiny model's 128.
Unknown characters map to ``<unk>``: a run warns about them in the system prompt, the template and the prompts,
and refuses a stop string it cannot encode (``unknown_characters``, used by ``megatron_qarl.preflight``; ``qarl-train
--dry-run`` shows them). It is a ``transformers.PreTrainedTokenizerFast`` with a chat template,
so ``save_pretrained`` / ``AutoTokenizer.from_pretrained`` round-trip it like any HF tokenizer.
"""

from __future__ import annotations

import string

from megatron_qarl.errors import UserError

SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>", "<unk>")
CHARACTERS = string.digits + string.ascii_lowercase + string.ascii_uppercase + "+-*/=().,?!:{}\\^_$' \n"

# bos, then the conversation; an assistant turn ends with eos. No generation prefix: the model continues
# right after the user text (``123+456=`` -> ``579<eos>``).
CHAR_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ message['content'] }}\n"
    "{% elif message['role'] == 'user' %}{{ message['content'] }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] }}{{ eos_token }}"
    "{% endif %}"
    "{% endfor %}"
)


def char_vocab() -> dict:
    tokens = list(SPECIAL_TOKENS) + list(CHARACTERS)
    if len(set(tokens)) != len(tokens):
        raise AssertionError("duplicate characters in the char vocabulary")
    return {tok: i for i, tok in enumerate(tokens)}


def build_char_tokenizer():
    """The demo tokenizer: ``pad=0, bos=1, eos=2, unk=3``, then one id per character."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.WordLevel(vocab=char_vocab(), unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    core.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
        unk_token="<unk>",
        chat_template=CHAR_CHAT_TEMPLATE,
        padding_side="left",
        clean_up_tokenization_spaces=False,
    )
    return tok


class TokenizerError(ValueError, UserError):
    """No usable tokenizer for the model a run names."""


def load_tokenizer(model_cfg):
    """The tokenizer a `ModelConfig` names (RL and SFT alike): `model.tokenizer` (a path or hub name, or
    "char"), else the one saved at `model.hf_path`. A preset has no tokenizer of its own: it needs
    `model.tokenizer` (never a silent fallback to the demo's char tokenizer)."""
    if model_cfg.tokenizer == "char":
        return build_char_tokenizer()
    source = model_cfg.tokenizer or model_cfg.hf_path
    if source is None:
        raise TokenizerError(
            f"model.preset={model_cfg.preset!r} has no tokenizer of its own: set model.tokenizer to your "
            "tokenizer's directory (e.g. the Qwen3 checkpoint dir), or model.tokenizer=char for the demo's "
            "128-symbol character tokenizer")
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(source)
    except (OSError, ValueError) as exc:
        raise TokenizerError(f"cannot load the tokenizer at {source!r} (model.tokenizer / model.hf_path): "
                             f"{str(exc).splitlines()[0]}") from exc
    except (KeyError, TypeError, AttributeError, IndexError) as exc:  # a tokenizer.json missing a field it must have
        what = f"field {exc.args[0]!r}" if isinstance(exc, KeyError) and exc.args else \
            f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        raise TokenizerError(
            f"cannot load the tokenizer at {source!r} (model.tokenizer / model.hf_path): its files are incomplete "
            f"or not what transformers writes (missing {what}); re-save it with "
            "tokenizer.save_pretrained(dir), or point model.tokenizer at a complete tokenizer directory") from exc


def unknown_characters(tokenizer, text: str) -> list[str]:
    """The characters of `text` that `tokenizer` can only encode as its unknown token (in order, once each);
    [] for a tokenizer without one (byte-level BPE encodes everything)."""
    unk = getattr(tokenizer, "unk_token_id", None)
    if unk is None or not text or unk not in tokenizer.encode(text, add_special_tokens=False):
        return []
    return [c for c in dict.fromkeys(text) if unk in tokenizer.encode(c, add_special_tokens=False)]


def describe_characters(chars: list[str]) -> str:
    """'#', '<', '>' (repr of each: a newline shows as '\\n')."""
    return ", ".join(repr(c) for c in chars)


# What the char tokenizer knows, for messages (its vocabulary is CHARACTERS).
CHAR_VOCABULARY = "digits, letters, space, newline and " + " ".join(c for c in CHARACTERS if not c.isalnum()
                                                                      and not c.isspace())


def split_stops(tokenizer, stop: list[str], stop_token_ids: list[int]) -> tuple[list[int], list[str]]:
    """(stop token ids, multi-token stop strings) for `rollout.stop` / `rollout.stop_token_ids`, with the
    tokenizer's EOS always included. A stop string that is one token (e.g. Qwen's "<|im_end|>") becomes
    its id, which every engine matches exactly; longer strings are matched on the decoded text."""
    ids = [] if tokenizer.eos_token_id is None else [int(tokenizer.eos_token_id)]
    strings = []
    for s in stop:
        enc = tokenizer.encode(s, add_special_tokens=False)
        if len(enc) == 1 and tokenizer.decode(enc, skip_special_tokens=False) == s:
            ids.append(int(enc[0]))
        else:
            strings.append(s)
    vocab = len(tokenizer)
    bad = [t for t in stop_token_ids if not 0 <= int(t) < vocab]
    if bad:
        raise TokenizerError(f"rollout.stop_token_ids {bad} are outside the tokenizer's vocabulary (0..{vocab - 1})")
    ids += [int(t) for t in stop_token_ids]
    return list(dict.fromkeys(ids)), strings
