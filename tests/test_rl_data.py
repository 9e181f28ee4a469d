"""Prompt data: JSONL and Parquet, malformed rows, empty dataset error, length filter, resume position;
the char tokenizer and the synthetic task."""

import json
import re
from pathlib import Path

import pytest

from megatron_qarl.rl.data import DatasetError, PromptDataConfig, PromptDataset, PromptSampler
from megatron_qarl.rl.rewards import exact_match_reward, math_verify_score
from megatron_qarl.rl.synthetic import (
    ArithmeticTaskConfig,
    generate_arithmetic_rows,
    main as synthetic_main,
    reward_kind_for_style,
    write_rows,
)
from megatron_qarl.rl.tokenizer import build_char_tokenizer

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


def _write_jsonl(path, lines):
    path.write_text("".join(line + "\n" for line in lines))
    return path


def test_jsonl_malformed_rows_are_skipped_on_request_and_reported(tmp_path):
    path = _write_jsonl(tmp_path / "p.jsonl", [
        json.dumps({"prompt": "1+1=", "answer": "2"}),
        "{not json",
        json.dumps({"prompt": "", "answer": "3"}),
        json.dumps({"answer": "4"}),
        json.dumps(["a", "list"]),
        json.dumps({"prompt": "2+2=", "answer": None}),
        json.dumps({"prompt": 5, "answer": "5"}),
        json.dumps({"prompt": "3+3=", "answer": 6}),  # numeric answers are fine
    ])
    ds = PromptDataset(PromptDataConfig(path=str(path), max_reported_errors=3, bad_rows="skip"))
    assert [e.answer for e in ds.examples] == ["2", "6"]
    assert [e.index for e in ds.examples] == [0, 7]
    assert ds.report.total_rows == 8 and ds.report.malformed_rows == 6 and ds.report.usable_rows == 2
    assert len(ds.report.first_errors) == 3
    assert ds.report.first_errors[0].startswith(f"{path}:row 1: invalid JSON")
    # strict by default: the first malformed row stops loading, named with its file and row
    with pytest.raises(DatasetError, match=re.escape(f"{path}:row 1: invalid JSON")) as err:
        PromptDataset(PromptDataConfig(path=str(path)))
    assert "fix the row, or set data.bad_rows=skip to drop such rows" in str(err.value).lower()


def test_parquet_with_chat_messages_and_nested_answer(tmp_path, tok):
    rows = [
        {"prompt": [{"role": "user", "content": "12+30="}], "reward_model": {"ground_truth": "42"}},
        {"prompt": [{"role": "user", "content": "1+2="}], "reward_model": {"ground_truth": "3"}},
        {"prompt": None, "reward_model": {"ground_truth": "7"}},
    ]
    path = write_rows(tmp_path / "p.parquet", rows)
    ds = PromptDataset(PromptDataConfig(path=str(path), answer_key="reward_model.ground_truth", bad_rows="skip"), tok)
    assert [e.answer for e in ds.examples] == ["42", "3"] and ds.report.malformed_rows == 1
    assert ds.examples[0].row == rows[0] and ds.examples[0].source == str(path)
    # chat template of the char tokenizer: <bos> + user text
    assert ds.examples[0].prompt_text == "<bos>12+30="
    assert ds.examples[0].prompt_ids == [tok.bos_token_id] + tok("12+30=", add_special_tokens=False)["input_ids"]


def test_openr1_style_problem_field_and_no_chat_template(tmp_path, tok):
    path = _write_jsonl(tmp_path / "o.jsonl", [json.dumps({"problem": "What is 2+2?", "answer": "4", "solution": "..."})])
    cfg = PromptDataConfig(path=str(path), prompt_key="problem", apply_chat_template=False,
                           template="{problem} Put the answer in \\boxed{}.")
    ex = PromptDataset(cfg, tok).examples[0]
    assert ex.prompt_text == "What is 2+2? Put the answer in \\boxed{}."
    assert ex.answer == "4"


def test_max_prompt_length_filter_counts_dropped(tmp_path, tok):
    path = _write_jsonl(tmp_path / "l.jsonl", [json.dumps({"prompt": "1+1=", "answer": "2"}),
                                               json.dumps({"prompt": "123456+654321=", "answer": "777777"})])
    ds = PromptDataset(PromptDataConfig(path=str(path), max_prompt_length=8), tok)  # <bos>1+1= is 5 tokens
    assert [e.answer for e in ds.examples] == ["2"] and ds.report.too_long_rows == 1
    with pytest.raises(DatasetError, match="raise max_prompt_length"):
        PromptDataset(PromptDataConfig(path=str(path), max_prompt_length=2), tok)


def test_empty_or_unusable_dataset_is_a_clear_error(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(DatasetError, match="no usable rows"):
        PromptDataset(PromptDataConfig(path=str(empty)))
    wrong_key = _write_jsonl(tmp_path / "w.jsonl", [json.dumps({"question": "1+1=", "answer": "2"})])
    with pytest.raises(DatasetError, match="missing 'prompt'.*prompt_key='prompt'"):
        PromptDataset(PromptDataConfig(path=str(wrong_key)))
    with pytest.raises(DatasetError, match="does not exist"):
        PromptDataset(PromptDataConfig(path=str(tmp_path / "missing.jsonl")))
    csv = tmp_path / "x.csv"
    csv.write_text("prompt,answer\n1+1=,2\n")
    with pytest.raises(DatasetError, match="unsupported"):
        PromptDataset(PromptDataConfig(path=str(csv)))


def test_shuffle_is_deterministic_and_resume_continues_exactly():
    a = PromptSampler(10, seed=3)
    first = a.next_indices(7)
    state = a.state_dict()
    rest = a.next_indices(9)  # crosses into epoch 1
    assert sorted(first + rest[:3]) == list(range(10))  # epoch 0 is a permutation
    b = PromptSampler(10, seed=3)
    assert b.next_indices(7) == first  # same seed, same order
    c = PromptSampler(10, seed=3)
    c.load_state_dict(json.loads(json.dumps(state)))  # survives a JSON checkpoint
    assert c.next_indices(9) == rest
    assert PromptSampler(10, seed=4).next_indices(10) != PromptSampler(10, seed=3).next_indices(10)
    with pytest.raises(DatasetError, match="same data and seed"):
        PromptSampler(11, seed=3).load_state_dict(state)


def test_dataset_state_roundtrip_on_shipped_sample():
    for name in ("arith_sample.jsonl", "arith_sample.parquet"):
        cfg = PromptDataConfig(path=str(REPO / "data" / name), seed=1)
        ds = PromptDataset(cfg)
        assert len(ds) == 200 and ds.report.malformed_rows == 0
        ds.next_batch(150)
        state = ds.state_dict()
        expect = [e.index for e in ds.next_batch(100)]
        resumed = PromptDataset(cfg)
        resumed.load_state_dict(state)
        assert [e.index for e in resumed.next_batch(100)] == expect


def test_char_tokenizer_roundtrip_and_save(tmp_path, tok):
    from transformers import AutoTokenizer

    assert len(tok) < 128 and (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)
    text = "What is 12*3? Put the answer in \\boxed{}."
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(text) and tok.unk_token_id not in ids
    assert tok.decode(ids) == text
    assert tok.decode(tok("579<eos>", add_special_tokens=False)["input_ids"]) == "579<eos>"
    tok.save_pretrained(tmp_path)
    again = AutoTokenizer.from_pretrained(tmp_path)
    assert again(text, add_special_tokens=False)["input_ids"] == ids
    msgs = [{"role": "user", "content": "1+2="}]
    assert again.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False) == "<bos>1+2="


def test_synthetic_rows_are_correct_and_deterministic(tmp_path):
    cfg = ArithmeticTaskConfig(num_rows=300, min_digits=1, max_digits=3, operations=("+", "-", "*"), seed=5)
    rows = generate_arithmetic_rows(cfg)
    assert rows == generate_arithmetic_rows(cfg)
    for r in rows:
        a, op, b = re.fullmatch(r"(\d+)([+\-*])(\d+)=", r["prompt"]).groups()
        assert int(r["answer"]) == {"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b)}[op]
        assert int(r["answer"]) >= 0
        assert exact_match_reward(r["answer"] + "<eos>", r["answer"]) == 1.0
    boxed = generate_arithmetic_rows(ArithmeticTaskConfig(num_rows=3, style="boxed", seed=1))
    assert boxed[0]["prompt"].endswith("Put the answer in \\boxed{}.")
    assert math_verify_score("\\boxed{" + boxed[0]["answer"] + "}", boxed[0]["answer"], 5) == 1.0
    assert reward_kind_for_style("plain") == "exact_match" and reward_kind_for_style("boxed") == "math_verify"
    out = tmp_path / "a.jsonl"
    synthetic_main(["--out", str(out), "--rows", "5", "--seed", "2"])
    assert len(out.read_text().splitlines()) == 5
    with pytest.raises(ValueError, match="operations"):
        ArithmeticTaskConfig(operations=("/",))


def test_lsd_first_answers_are_the_digits_reversed_and_sign_first():
    cfg = ArithmeticTaskConfig(num_rows=300, min_digits=1, max_digits=3, operations=("+", "-", "*"),
                               allow_negative=True, digit_order="lsd_first", seed=5)
    rows = generate_arithmetic_rows(cfg)
    usual = generate_arithmetic_rows(ArithmeticTaskConfig(**{**cfg.__dict__, "digit_order": "msd_first"}))
    assert [r["prompt"] for r in rows] == [r["prompt"] for r in usual]  # same problems, other notation
    for r in rows:
        a, op, b = re.fullmatch(r"(\d+)([+\-*])(\d+)=", r["prompt"]).groups()
        value = {"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b)}[op]
        sign, digits = re.fullmatch(r"(-?)(\d+)", r["answer"]).groups()
        assert int(sign + digits[::-1]) == value
    assert any(r["answer"].startswith("-") for r in rows) and any(len(r["answer"]) > 1 for r in rows)
    with pytest.raises(ValueError, match="digit_order"):
        ArithmeticTaskConfig(digit_order="backwards")


def test_shipped_demo_data_matches_generator():
    """configs/_base_tiny.yaml's RL prompts are the generator's (its comment says how to regenerate)."""
    rows = [json.loads(line) for line in (REPO / "data" / "arith_2digit_lsd.jsonl").read_text().splitlines()]
    assert rows == generate_arithmetic_rows(ArithmeticTaskConfig(
        num_rows=2000, min_digits=2, max_digits=2, operations=("+",), digit_order="lsd_first", seed=0))
    assert rows[0] == {"prompt": "63+43=", "answer": "601"}  # 106, written least-significant digit first


def test_shipped_sample_matches_generator():
    rows = [json.loads(line) for line in (REPO / "data" / "arith_sample.jsonl").read_text().splitlines()]
    assert rows == generate_arithmetic_rows(ArithmeticTaskConfig(num_rows=200, seed=0))


# ---------------------------------------------------------------- issue 19: no silent data changes

def test_dropped_long_prompts_are_logged_with_the_count_and_file(tmp_path, tok, caplog):
    path = tmp_path / "p.jsonl"
    _write_jsonl(path, ['{"prompt": "1+1=", "answer": "2"}', '{"prompt": "123456789+1=", "answer": "123456790"}',
                        '{"prompt": "99999999+99999999=", "answer": "199999998"}'])
    with caplog.at_level("WARNING", logger="megatron_qarl.rl.data"):
        ds = PromptDataset(PromptDataConfig(path=str(path), max_prompt_length=8), tok)
    assert ds.stats["too_long_rows"] == 2 and ds.stats["usable_rows"] == 1 and ds.stats["total_rows"] == 3
    lines = [r.getMessage() for r in caplog.records]
    assert any(str(path) in m and "2 prompts longer than max_prompt_length=8" in m for m in lines), lines


def test_non_utf8_bytes_are_replaced_counted_and_logged(tmp_path, caplog):
    path = tmp_path / "p.jsonl"
    path.write_bytes(b'{"prompt": "caf\xe9 1+1=", "answer": "2"}\n{"prompt": "2+2=", "answer": "4"}\n'
                     b'{"prompt": "\xff\xfe3+3=", "answer": "6"}\n')
    with caplog.at_level("WARNING", logger="megatron_qarl.rl.data"):
        ds = PromptDataset(PromptDataConfig(path=str(path)))
    assert len(ds) == 3 and ds.stats["replaced_rows"] == 2  # kept, with U+FFFD where the bytes were
    assert "\ufffd" in ds.examples[0].prompt_text and ds.examples[1].prompt_text == "2+2="
    lines = [r.getMessage() for r in caplog.records]
    assert any(str(path) in m and "2 rows with non-UTF-8 bytes" in m and "rows 0, 2" in m for m in lines), lines


def test_a_clean_file_logs_nothing_and_counts_zero(tmp_path, caplog):
    path = tmp_path / "p.jsonl"
    _write_jsonl(path, ['{"prompt": "1+1=", "answer": "2"}'])
    with caplog.at_level("WARNING", logger="megatron_qarl.rl.data"):
        ds = PromptDataset(PromptDataConfig(path=str(path)))
    assert (ds.stats["replaced_rows"], ds.stats["too_long_rows"], ds.stats["malformed_rows"]) == (0, 0, 0)
    assert not caplog.records
