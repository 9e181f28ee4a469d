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
from megatron_qarl.tokenizer import build_char_tokenizer

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
    with pytest.raises(DatasetError, match="raise data.max_prompt_len"):
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


def test_chain_problems_write_every_operand_and_running_sum_checked_by_hand():
    rows = generate_arithmetic_rows(ArithmeticTaskConfig(num_rows=200, min_digits=2, max_digits=2, style="chain",
                                                         terms=4, digit_order="lsd_first", seed=3))
    for row in rows:
        operands = [int(v) for v in row["prompt"].rstrip("=").split("+")]
        assert len(operands) == 4 and all(10 <= v <= 99 for v in operands)
        steps = [step.split(":") for step in row["answer"].split(",")]
        assert [int(v) for v, _ in steps] == operands[1:]
        assert [int(s[::-1]) for _, s in steps] == [sum(operands[:i + 1]) for i in range(1, 4)]  # LSD first
    assert generate_arithmetic_rows(ArithmeticTaskConfig(num_rows=1, min_digits=2, max_digits=2, style="chain",
                                                         terms=3, seed=0))[0]["answer"].count(":") == 2
    # responses of 16+ tokens (one per character, with EOS): what the Table 1 runs need
    assert min(len(r["answer"]) for r in rows) >= 17
    assert reward_kind_for_style("chain") == "exact_match"


@pytest.mark.parametrize("kwargs, match", [
    (dict(style="chain", terms=2), "terms >= 3"),
    (dict(style="chain", terms=4, operations=("+", "*")), "operations"),
    (dict(style="plain", terms=3), "need style 'chain'"),
])
def test_chain_settings_that_cannot_work_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ArithmeticTaskConfig(**kwargs)


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


# ---------------------------------------------------------------- bring your own data: sources

def _save_to_disk(path, rows=None, splits=None):
    import datasets

    datasets.disable_progress_bars()
    if splits is not None:
        datasets.DatasetDict({k: datasets.Dataset.from_list(v) for k, v in splits.items()}).save_to_disk(str(path))
    else:
        datasets.Dataset.from_list(rows).save_to_disk(str(path))
    return path


def test_a_list_of_files_and_globs_is_read_in_order(tmp_path):
    d = tmp_path / "data"
    d.mkdir()
    write_rows(d / "b.parquet", [{"prompt": "b0", "answer": "1"}, {"prompt": "b1", "answer": "2"}])
    write_rows(d / "a.parquet", [{"prompt": "a0", "answer": "3"}])
    _write_jsonl(tmp_path / "extra.jsonl", [json.dumps({"prompt": "j0", "answer": "4"})])
    arr = tmp_path / "arr.json"  # a .json file may hold one JSON array (pretty-printed) instead of JSON Lines
    arr.write_text(json.dumps([{"prompt": "r0", "answer": "5"}, {"prompt": "r1", "answer": "6"}], indent=2))
    ds = PromptDataset(PromptDataConfig(path=[str(tmp_path / "extra.jsonl"), str(d / "*.parquet"), str(arr)]))
    assert [e.prompt_text for e in ds.examples] == ["j0", "a0", "b0", "b1", "r0", "r1"]  # glob matches sorted
    assert [(Path(e.source).name, e.index) for e in ds.examples] == [
        ("extra.jsonl", 0), ("a.parquet", 0), ("b.parquet", 0), ("b.parquet", 1), ("arr.json", 0), ("arr.json", 1)]
    assert ds.examples[3].row_id == f"{d / 'b.parquet'}:row 1"
    assert ds.report.sources == [str(tmp_path / "extra.jsonl"), str(d / "a.parquet"), str(d / "b.parquet"), str(arr)]
    only_glob = PromptDataset(PromptDataConfig(path=str(d / "*.parquet")))
    assert [e.answer for e in only_glob.examples] == ["3", "1", "2"]


def test_bad_sources_name_the_path_and_the_fix(tmp_path):
    _write_jsonl(tmp_path / "ok.jsonl", [json.dumps({"prompt": "1+1=", "answer": "2"})])
    with pytest.raises(DatasetError, match=r"pattern '.*\*\.parquet' matches no files.*fix the pattern"):
        PromptDataset(PromptDataConfig(path=[str(tmp_path / "ok.jsonl"), str(tmp_path / "*.parquet")]))
    with pytest.raises(DatasetError, match=r"missing\.jsonl does not exist; fix data\.path"):
        PromptDataset(PromptDataConfig(path=[str(tmp_path / "ok.jsonl"), str(tmp_path / "missing.jsonl")]))
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(DatasetError, match=r"unsupported prompt dataset type '\.txt'.*narrow the pattern"):
        PromptDataset(PromptDataConfig(path=str(tmp_path / "*")))
    with pytest.raises(DatasetError, match=r"not one written by datasets' save_to_disk.*glob such as '.*\*\.jsonl'"):
        PromptDataset(PromptDataConfig(path=str(tmp_path)))
    with pytest.raises(DatasetError, match="data.path is empty"):
        PromptDataConfig(path=[])
    broken = tmp_path / "broken.json"
    broken.write_text('[\n  {"prompt": "1+1=", "answer": "2"},\n  {"prompt": \n]')
    with pytest.raises(DatasetError, match=r"broken\.json is not valid JSON .* at line 4"):
        PromptDataset(PromptDataConfig(path=str(broken)))


def test_datasets_save_to_disk_dirs(tmp_path):
    rows = [{"problem": "1+1=", "sol": {"answer": "2"}}, {"problem": "2+2=", "sol": {"answer": "4"}}]
    one = _save_to_disk(tmp_path / "one", rows)
    ds = PromptDataset(PromptDataConfig(path=str(one), prompt_key="problem", answer_key="sol.answer"))
    assert [e.answer for e in ds.examples] == ["2", "4"] and ds.examples[1].row == rows[1]
    assert ds.examples[1].source == str(one) and ds.examples[1].row_id == f"{one}:row 1"

    dd = _save_to_disk(tmp_path / "dd", splits={"train": rows, "test": [{"problem": "3+3=", "sol": {"answer": "6"}}]})
    cfg = dict(prompt_key="problem", answer_key="sol.answer")
    assert [e.answer for e in PromptDataset(PromptDataConfig(path=str(dd), **cfg)).examples] == ["2", "4"]
    test = PromptDataset(PromptDataConfig(path=str(dd), split="test", **cfg))
    assert [e.answer for e in test.examples] == ["6"] and test.examples[0].source == f"{dd}[test]"
    with pytest.raises(DatasetError, match=r"DatasetDict with splits \['train', 'test'\] and no split 'validation'; "
                                           r"set data.split"):
        PromptDataset(PromptDataConfig(path=str(dd), split="validation", **cfg))
    both = PromptDataset(PromptDataConfig(path=[str(one), str(dd)], split="test", **cfg))  # dirs mix with lists
    assert [e.answer for e in both.examples] == ["2", "4", "6"]


# ---------------------------------------------------------------- bring your own data: validation

def _bad_sources(d):
    """One source of each kind whose row 1 is malformed, with what the error names."""
    jsonl = _write_jsonl(d / "p.jsonl", [json.dumps({"prompt": "1+1=", "answer": "2"}), "{oops"])
    arr = d / "p.json"
    arr.write_text(json.dumps([{"prompt": "1+1=", "answer": "2"}, {"prompt": "2+2="}]))
    pq = write_rows(d / "p.parquet", [{"prompt": "1+1=", "answer": "2"}, {"prompt": None, "answer": "4"}])
    saved = _save_to_disk(d / "saved", [{"prompt": "1+1=", "answer": "2"}, {"prompt": "  ", "answer": "4"}])
    dd = _save_to_disk(d / "dd", splits={"train": [{"prompt": "1+1=", "answer": "2"}, {"prompt": "x", "answer": None}]})
    return [(jsonl, str(jsonl), "invalid JSON"), (arr, str(arr), "missing 'answer' (the row's fields: 'prompt')"),
            (pq, str(pq), "'prompt' must be a string or a list of {role, content} messages, got null"),
            (saved, str(saved), "empty 'prompt'"), (dd, f"{dd}[train]", "missing or invalid 'answer' (got null")]


def test_a_bad_row_is_an_error_naming_the_source_and_row_for_every_format(tmp_path):
    for path, name, problem in _bad_sources(tmp_path):
        with pytest.raises(DatasetError) as err:
            PromptDataset(PromptDataConfig(path=str(path)))
        msg = str(err.value)
        assert msg.startswith(f"{name}:row 1: {problem}"), msg
        assert msg.endswith("or set data.bad_rows=skip to drop such rows"), msg


def test_skip_mode_drops_counts_and_warns_for_every_format(tmp_path, caplog):
    sources = _bad_sources(tmp_path)
    with caplog.at_level("WARNING", logger="megatron_qarl.rl.data"):
        ds = PromptDataset(PromptDataConfig(path=[str(p) for p, _, _ in sources], bad_rows="skip"))
    assert len(ds) == 5 and ds.stats["malformed_rows"] == 5 and ds.stats["total_rows"] == 10
    assert [e.index for e in ds.examples] == [0] * 5
    assert [err.split(": ", 1)[0] for err in ds.report.first_errors] == [f"{n}:row 1" for _, n, _ in sources]
    assert any("skipped 5 malformed rows" in r.getMessage() for r in caplog.records)


def test_missing_key_error_lists_the_row_fields(tmp_path):
    path = _write_jsonl(tmp_path / "o.jsonl", [json.dumps({"problem": "1+1=", "solution": "2"})])
    with pytest.raises(DatasetError, match=r"row 0: missing 'prompt' \(the row's fields: 'problem', 'solution'\)\. "
                                           r"Check data.prompt_key='prompt' / data.answer_key='answer' against the "
                                           r"file's fields; set data.prompt_key / data.answer_key"):
        PromptDataset(PromptDataConfig(path=str(path)))
    # the held-out set's messages name eval.* (issue #35): its keys, its path
    with pytest.raises(DatasetError, match=r"Check eval.prompt_key='prompt' / eval.answer_key='answer'"):
        PromptDataset(PromptDataConfig(path=str(path), section="eval"))
    with pytest.raises(DatasetError, match=r"does not exist.*; fix eval.path$"):
        PromptDataset(PromptDataConfig(path=str(tmp_path / "nope.jsonl"), section="eval"))


def test_config_refuses_settings_that_cannot_work():
    with pytest.raises(DatasetError, match=r"has no \{problem\} placeholder"):
        PromptDataConfig(template="Solve it. Put the answer in \\boxed{}.")
    with pytest.raises(DatasetError, match="bad_rows='ignore' is not one of"):
        PromptDataConfig(bad_rows="ignore")
    with pytest.raises(DatasetError, match=r"may not set \['tokenize'\]"):
        PromptDataConfig(chat_template_kwargs={"tokenize": True})


# ---------------------------------------------------------------- bring your own data: prompt construction

def test_template_and_system_prompt_build_the_messages(tmp_path, tok):
    path = _write_jsonl(tmp_path / "p.jsonl", [
        json.dumps({"prompt": "1+1=", "answer": "2"}),
        json.dumps({"prompt": [{"role": "user", "content": "2+2="}], "answer": "4"}),
        json.dumps({"prompt": [{"role": "system", "content": "own"}, {"role": "user", "content": "3+3="}],
                    "answer": "6"}),
    ])
    cfg = PromptDataConfig(path=str(path), system_prompt="Be brief.", template="Q: {problem} Use \\boxed{}.")
    a, b, c = PromptDataset(cfg, tok).examples
    user = "Q: 1+1= Use \\boxed{}."
    assert a.messages == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": user}]
    assert a.prompt_text == "<bos>Be brief.\n" + user  # the char tokenizer's chat template
    assert a.prompt_ids == [tok.bos_token_id] + tok("Be brief.\n" + user, add_special_tokens=False)["input_ids"]
    # message lists are used as they are: no template; the system prompt only where they have none
    assert b.messages == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2="}]
    assert c.messages == [{"role": "system", "content": "own"}, {"role": "user", "content": "3+3="}]
    plain = PromptDataset(PromptDataConfig(path=str(path), system_prompt="Be brief.", apply_chat_template=False), tok)
    assert plain.examples[0].prompt_text == "Be brief.\n1+1="
    assert plain.examples[0].prompt_ids == tok("Be brief.\n1+1=")["input_ids"]
    assert a.row == {"prompt": "1+1=", "answer": "2"} and json.loads(json.dumps(c.row)) == c.row


def test_chat_template_kwargs_reach_the_template(tmp_path, tok, caplog):
    thinking = build_char_tokenizer()
    thinking.chat_template = ("{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
                              "{% if enable_thinking is defined and not enable_thinking %} no think{% endif %}")
    path = _write_jsonl(tmp_path / "p.jsonl", [json.dumps({"prompt": "1+1=", "answer": "2"})])
    on = PromptDataset(PromptDataConfig(path=str(path)), thinking).examples[0]
    off = PromptDataset(PromptDataConfig(path=str(path), chat_template_kwargs={"enable_thinking": False}),
                        thinking).examples[0]
    assert (on.prompt_text, off.prompt_text) == ("<bos>1+1=", "<bos>1+1= no think")
    assert off.prompt_ids == [thinking.bos_token_id] + thinking("1+1= no think", add_special_tokens=False)["input_ids"]
    with caplog.at_level("WARNING", logger="megatron_qarl.rl.data"):  # the char template has no such variable
        PromptDataset(PromptDataConfig(path=str(path), chat_template_kwargs={"enable_thinking": False}), tok)
    assert any("never mentions them" in r.getMessage() and "enable_thinking" in r.getMessage() for r in caplog.records)
    with pytest.raises(DatasetError, match="would have no effect: data.prompt.apply_chat_template is false"):
        PromptDataset(PromptDataConfig(path=str(path), apply_chat_template=False,
                                       chat_template_kwargs={"enable_thinking": False}), thinking)


def test_a_template_that_refuses_the_messages_names_the_row(tmp_path):
    strict = build_char_tokenizer()
    strict.chat_template = ("{% for m in messages %}{% if m['role'] == 'system' %}"
                            "{{ raise_exception('System role not supported') }}{% endif %}"
                            "{{ m['content'] }}{% endfor %}")
    path = _write_jsonl(tmp_path / "p.jsonl", [json.dumps({"prompt": "1+1=", "answer": "2"})])
    with pytest.raises(DatasetError, match=r"row 0: the tokenizer's chat template failed on it .*System role not "
                                           r"supported.*data.prompt.system"):
        PromptDataset(PromptDataConfig(path=str(path), system_prompt="Be brief."), strict)


def test_too_long_prompts_are_dropped_not_errors_in_strict_mode(tmp_path, tok):
    path = _write_jsonl(tmp_path / "l.jsonl", [json.dumps({"prompt": "1+1=", "answer": "2"}),
                                               json.dumps({"prompt": "123456+654321=", "answer": "777777"})])
    ds = PromptDataset(PromptDataConfig(path=str(path), max_prompt_length=8, bad_rows="error"), tok)
    assert len(ds) == 1 and ds.stats["too_long_rows"] == 1 and ds.stats["malformed_rows"] == 0
