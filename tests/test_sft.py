"""SFT warm-up: answer-only loss mask, prompt rendering shared with RL, batched decoding, loss decrease,
and the saved dist checkpoint reloading into a fresh model with identical logits."""
import json
import random

import pytest
import torch

from megatron_qarl.models.qwen3_moe import tiny_hf_config
from megatron_qarl.parallel import ParallelLayout, init_distributed
from megatron_qarl.tokenizer import build_char_tokenizer
from megatron_qarl.config import SFTConfig, SFTConfigError
from megatron_qarl.sft import (
    ProblemStream, answer_token_ids, build_sft_model, collate, encode_example, generate, held_out_problems,
    make_batch, prompt_token_ids, run_sft, sft_loss, train_step,
)


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


WORLD_SEED = 0


@pytest.fixture(scope="module", autouse=True)
def _world(world_of_one):
    """Single-process megatron world for every test here (conftest.world_of_one)."""


def _fresh_model(seed: int, **sft_kwargs):
    init_distributed(ParallelLayout(), seed=seed)
    return build_sft_model(tiny_hf_config(), ParallelLayout(), SFTConfig(**sft_kwargs))


def _logits(model, ids):
    pos = torch.arange(ids.shape[1]).unsqueeze(0).expand_as(ids)
    with torch.no_grad():
        return model(input_ids=ids, position_ids=pos, attention_mask=None)


# ---------------------------------------------------------------------------------------------- data


def test_answer_only_loss_mask_by_construction(tok):
    v = tok.get_vocab()
    prompt = prompt_token_ids(tok, "12+3=")
    answer = answer_token_ids(tok, "15")
    assert prompt == [v["<bos>"], v["1"], v["2"], v["+"], v["3"], v["="]]
    assert answer == [v["1"], v["5"], v["<eos>"]]
    inputs, labels, mask = encode_example(prompt, answer)
    assert inputs == [v["<bos>"], v["1"], v["2"], v["+"], v["3"], v["="], v["1"], v["5"]]
    assert labels == [v["1"], v["2"], v["+"], v["3"], v["="], v["1"], v["5"], v["<eos>"]]
    # positions 0..4 predict prompt tokens (no loss); 5..7 predict "1", "5", <eos>
    assert mask == [0, 0, 0, 0, 0, 1, 1, 1]


def test_collate_pads_right_without_loss_and_loss_averages_only_answer_tokens(tok):
    short = encode_example([1, 10], [11, 2])  # 3 inputs, loss on 2 targets
    long = encode_example([1, 10, 12, 13], [14, 2])  # 5 inputs, loss on 2 targets
    batch = collate([short, long], pad_id=0, pad_multiple=4)
    assert batch.input_ids.shape == (2, 8)
    assert batch.loss_mask.tolist() == [[0, 1, 1, 0, 0, 0, 0, 0], [0, 0, 0, 1, 1, 0, 0, 0]]
    assert batch.padding_mask[0].tolist() == [False] * 3 + [True] * 5
    assert batch.num_tokens == 8 and batch.num_loss_tokens == 4

    class PerTokenLossIsPosition(torch.nn.Module):  # stands in for GPTModel(labels=...) -> [B, S] losses
        def forward(self, input_ids, position_ids, attention_mask, labels, padding_mask):
            return position_ids.float() + 10 * torch.arange(input_ids.shape[0]).unsqueeze(1)

    # row 0 positions 1, 2 -> 1, 2; row 1 positions 3, 4 -> 13, 14
    assert sft_loss(PerTokenLossIsPosition(), batch).item() == pytest.approx((1 + 2 + 13 + 14) / 4)


def test_prompts_render_like_the_rl_prompt_loader(tmp_path, tok):
    from megatron_qarl.rl.data import PromptDataConfig, load_prompt_examples

    rows = [{"prompt": "63+4=", "answer": "67"}, {"prompt": "48+55=", "answer": "103"}]
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    examples, _ = load_prompt_examples(PromptDataConfig(path=str(path)), tok)
    assert [e.prompt_ids for e in examples] == [prompt_token_ids(tok, r["prompt"]) for r in rows]


def test_training_stream_never_yields_held_out_prompts():
    sft = SFTConfig(min_digits=1, max_digits=1, eval_prompts=60)
    held = {p["prompt"] for p in held_out_problems(sft)}
    assert len(held) == 60
    drawn = ProblemStream(sft.task_config(), seed=1, held_out=held).next(500)
    assert not held & {p["prompt"] for p in drawn}
    assert len({p["prompt"] for p in drawn}) == 40  # exactly the 100 - 60 remaining one-digit sums
    with pytest.raises(SFTConfigError, match="eval_prompts"):
        held_out_problems(SFTConfig(min_digits=1, max_digits=1, eval_prompts=101))


def test_bad_settings_are_named():
    with pytest.raises(SFTConfigError, match="dtype='bfloat16'"):
        SFTConfig(dtype="bfloat16").validate()
    with pytest.raises(SFTConfigError, match="operations"):
        SFTConfig(operators="/").validate()
    with pytest.raises(SFTConfigError, match="batch_size=0"):
        SFTConfig(batch_size=0).validate()


def test_the_warm_up_refuses_pipeline_stages_before_any_process_group():
    """Its generation-based evaluation calls the whole model: one line naming the fix, nothing initialised."""
    import torch.distributed as dist
    from types import SimpleNamespace

    from megatron_qarl.sft import run_sft

    was = dist.is_initialized()
    with pytest.raises(SFTConfigError, match=r"runs at parallel.pp=1, not 2: run it at pp=1"):
        run_sft(SimpleNamespace(parallel=ParallelLayout(pp=2)), SFTConfig())
    assert dist.is_initialized() == was


# ---------------------------------------------------------------------------------------------- model


def test_batched_greedy_decode_equals_one_prompt_at_a_time(tok):
    ddp, _ = _fresh_model(seed=3)
    ddp.eval()
    prompts = [prompt_token_ids(tok, p) for p in ("7+8=", "123+45=", "1+2=")]
    batched = generate(ddp, prompts, max_new_tokens=5, eos_id=tok.eos_token_id, pad_id=tok.pad_token_id)
    for prompt, got in zip(prompts, batched):
        ids = list(prompt)
        expected = []
        for _ in range(5):  # the obvious reference: whole-sequence forward, argmax at the last position
            nxt = int(_logits(ddp, torch.tensor([ids]))[0, -1].argmax())
            expected.append(nxt)
            ids.append(nxt)
            if nxt == tok.eos_token_id:
                break
        assert got == expected


def test_sampled_decode_is_reproducible_from_the_generator_seed(tok):
    ddp, _ = _fresh_model(seed=4)
    prompts = [prompt_token_ids(tok, "12+34=")] * 6
    kw = dict(max_new_tokens=4, eos_id=tok.eos_token_id, pad_id=tok.pad_token_id, temperature=1.0)
    a = generate(ddp, prompts, generator=torch.Generator().manual_seed(0), **kw)
    b = generate(ddp, prompts, generator=torch.Generator().manual_seed(0), **kw)
    assert a == b
    assert len({tuple(x) for x in a}) > 1  # an untrained model at T=1 does not repeat itself 6 times


def test_a_few_steps_reduce_the_loss_on_a_fixed_batch(tok):
    ddp, opt = _fresh_model(seed=5, lr=2e-3, lr_warmup_steps=0)
    problems = [{"prompt": f"{a}+{b}=", "answer": str(a + b)}
                for a, b in [(random.Random(i).randint(10, 99), random.Random(i + 100).randint(10, 99))
                             for i in range(16)]]
    batch = make_batch(tok, problems)
    losses = [train_step(ddp, opt, batch)[0] for _ in range(15)]
    with torch.no_grad():
        final = sft_loss(ddp, batch).item()
    assert losses[0] > 3.0  # ~ln(128) at init
    assert final < 0.5 * losses[0], (losses, final)


def test_run_sft_saves_a_checkpoint_that_reloads_with_identical_logits(tmp_path, tok):
    from megatron_qarl.config import RunConfig
    from megatron_qarl.checkpointing.format import is_complete
    from megatron_qarl.checkpointing.save_load import load_checkpoint
    from megatron_qarl.checkpointing.format import HF_SIDECAR_KEY
    from megatron_qarl.weights.hf_io import hf_config_from_json

    cfg = RunConfig()
    cfg.model.tokenizer = "char"
    cfg.logging.out_dir = str(tmp_path / "log")
    out = tmp_path / "sft_ckpt"
    sft = SFTConfig(steps=4, batch_size=8, eval_every=0, eval_prompts=8, eval_max_new_tokens=4, log_every=2,
                    lr_warmup_steps=0, out_checkpoint=str(out))
    result = run_sft(cfg, sft)
    assert result["step"] == 4 and result["checkpoint"] == str(out) and is_complete(out)
    written = json.loads((tmp_path / "log" / "sft_metrics.json").read_text())  # what demo_robustness reads
    assert written["step"] == 4 and written["eval/sampled_accuracy"] == result["eval/sampled_accuracy"]
    assert 0.0 <= result["eval/greedy_accuracy"] <= 1.0 and result["tokens_per_s"] > 0
    assert [h["step"] for h in result["history"]] == [4]

    ids = torch.tensor([prompt_token_ids(tok, "12+34=") + [5, 6]])
    a, _ = _fresh_model(seed=11)
    b, _ = _fresh_model(seed=12)
    assert not torch.equal(_logits(a, ids), _logits(b, ids))
    extra_a = load_checkpoint(out, a)
    load_checkpoint(out, b)
    assert torch.equal(_logits(a, ids), _logits(b, ids))
    assert extra_a["kind"] == "sft" and extra_a["sft_config"]["steps"] == 4
    # the architecture travels with the checkpoint (qarl-convert reads it from there)
    assert hf_config_from_json(extra_a[HF_SIDECAR_KEY]["config.json"]).to_dict() == tiny_hf_config().to_dict()


def test_saved_weights_are_the_trained_weights(tmp_path, tok):
    from megatron_qarl.checkpointing.save_load import load_checkpoint
    from megatron_qarl.sft import _save

    trained, opt = _fresh_model(seed=21, lr=1e-3, lr_warmup_steps=0)
    batch = make_batch(tok, [{"prompt": "1+2=", "answer": "3"}, {"prompt": "40+2=", "answer": "42"}])
    for _ in range(2):
        train_step(trained, opt, batch)
    ids = batch.input_ids
    expected = _logits(trained, ids)
    _save(trained, SFTConfig(out_checkpoint=str(tmp_path / "ck")), {"loss": 1.0})
    fresh, _ = _fresh_model(seed=22)
    assert not torch.equal(_logits(fresh, ids), expected)
    load_checkpoint(tmp_path / "ck", fresh)
    assert torch.equal(_logits(fresh, ids), expected)


def test_cli_style_overrides_set_fields_and_reject_unknown_keys():
    """`qarl-train sft ... sft.<field>=value`: the sft section is overridden like any other run key."""
    from megatron_qarl.config import ConfigError, load_config

    sft = load_config(None, ["sft.steps=7", "sft.operators=+-", "sft.stop_at_sampled_accuracy=0.3"]).sft
    assert (sft.steps, sft.operators, sft.stop_at_sampled_accuracy) == (7, "+-", 0.3)
    with pytest.raises(ConfigError, match="stepz"):
        load_config(None, ["sft.stepz=7"])


@pytest.mark.dist
@pytest.mark.slow
def test_tp2_sft_matches_world_one_and_its_checkpoint_loads_at_tp1(tmp_path, torchrun):
    """TP=2 (+SP) trains on the same problems as one process (DP=1 in both): same losses, same weights."""
    import sys

    from megatron_qarl.checkpointing.save_load import load_checkpoint
    from megatron_qarl.config import RunConfig

    sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent / "dist"))
    from sft_layout import short_sft

    tp2 = torchrun(2, "sft_layout.py", "2,1", str(tmp_path / "tp2"))
    cfg = RunConfig()
    cfg.model.tokenizer = "char"
    ref = run_sft(cfg, short_sft(str(tmp_path / "tp1")))
    steps = [s for s, _ in ref["loss_history"]]
    assert steps == [1, 2, 3, 4, 5] and [s for s, _ in tp2["loss_history"]] == steps
    for (_, a), (_, b) in zip(ref["loss_history"], tp2["loss_history"]):
        assert b == pytest.approx(a, rel=1e-5)
    ids = torch.tensor([prompt_token_ids(build_char_tokenizer(), "12+34=") + [5, 6]])
    a, _ = _fresh_model(seed=31)
    load_checkpoint(tmp_path / "tp1", a)
    b, _ = _fresh_model(seed=32)
    load_checkpoint(tmp_path / "tp2", b)
    torch.testing.assert_close(_logits(b, ids), _logits(a, ids), rtol=1e-4, atol=1e-4)
