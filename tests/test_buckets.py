"""Flattened buckets: planning rules, bitwise round trip, streaming, SGLang reconstruction semantics."""

import functools

import pytest
import torch

from megatron_qarl.models.registry import family_named
from megatron_qarl.quant.engine_layout import is_expert_engine_name
from megatron_qarl.rollout.sglang_compat import sglang_bucket_dict
from megatron_qarl.rollout.payload import (
    FlattenedBucket,
    TensorMeta,
    iter_buckets,
    plan_buckets,
    unflatten_bucket,
)

QWEN3 = family_named("qwen3_moe")
IS_EXPERT = functools.partial(is_expert_engine_name, naming=QWEN3)  # what the publisher buckets by

EXPERT = "model.layers.0.mlp.experts.{}.up_proj.weight_packed"
ATTN = "model.layers.0.self_attn.q_proj.weight"


def meta(name, numel, dtype=torch.bfloat16):
    return TensorMeta(name, (numel,), dtype)


def test_expert_names_are_recognised_in_every_engine_form():
    assert IS_EXPERT("model.layers.3.mlp.experts.7.down_proj.weight_scale")
    assert IS_EXPERT("model.layers.3.mlp.experts.7.gate_proj.weight_shape")
    assert IS_EXPERT("model.layers.3.mlp.experts.7.gate_proj.weight_scale_inv")
    assert IS_EXPERT("model.layers.3.mlp.experts.7.gate_proj.weight")
    assert not IS_EXPERT("model.layers.3.mlp.gate.weight")
    assert not IS_EXPERT(ATTN)


def test_exact_fit_fills_a_bucket_and_overflow_starts_the_next():
    metas = [meta(f"model.norm{i}.weight", 50) for i in range(5)]  # 100 bytes each
    plan = plan_buckets(metas, bucket_bytes=200, is_expert=IS_EXPERT)
    assert [[m.name for m in b] for b in plan] == [
        ["model.norm0.weight", "model.norm1.weight"],
        ["model.norm2.weight", "model.norm3.weight"],
        ["model.norm4.weight"],
    ]


def test_tensor_larger_than_a_bucket_gets_its_own():
    metas = [meta("a.weight", 10), meta("big.weight", 1000), meta("b.weight", 10)]
    plan = plan_buckets(metas, bucket_bytes=100, is_expert=IS_EXPERT)
    assert [[m.name for m in b] for b in plan] == [["a.weight"], ["big.weight"], ["b.weight"]]


def test_experts_and_dtypes_never_share_a_bucket():
    metas = [meta(ATTN, 10), TensorMeta(EXPERT.format(0), (4,), torch.int32), meta("model.norm.weight", 10),
             TensorMeta(EXPERT.format(1), (4,), torch.int32), meta(EXPERT.format(2)[:-7] + "_scale", 2)]
    plan = plan_buckets(metas, bucket_bytes=1 << 20, is_expert=IS_EXPERT)
    names = [[m.name for m in b] for b in plan]
    assert names[0] == [EXPERT.format(0), EXPERT.format(1)]  # experts first
    assert names[1] == [EXPERT.format(2)[:-7] + "_scale"]
    assert names[2] == [ATTN, "model.norm.weight"]
    for b in plan:
        assert len({m.dtype for m in b}) == 1
        assert len({IS_EXPERT(m.name) for m in b}) == 1


def test_empty_update_plans_and_streams_nothing():
    assert plan_buckets([], 100, is_expert=IS_EXPERT) == []
    assert list(iter_buckets(iter([]), 100, is_expert=IS_EXPERT)) == []
    with pytest.raises(ValueError, match="empty bucket"):
        FlattenedBucket.from_named_tensors([])
    with pytest.raises(ValueError, match="positive"):
        plan_buckets([], 0, is_expert=IS_EXPERT)


def _payload():
    g = torch.Generator().manual_seed(0)
    return [
        (EXPERT.format(0), torch.randint(-2**31, 2**31 - 1, (8, 4), dtype=torch.int32, generator=g)),
        (EXPERT.format(0)[:-7] + "_scale", torch.randn(8, 2, generator=g).to(torch.bfloat16)),
        (EXPERT.format(0)[:-7] + "_shape", torch.tensor([8, 32], dtype=torch.int32)),
        (ATTN, torch.randn(16, 8, generator=g).to(torch.float8_e4m3fn)),
        (ATTN + "_scale_inv", torch.rand(1, 1, generator=g)),
        ("model.norm.weight", torch.randn(16, generator=g).to(torch.bfloat16)),
        ("lm_head.weight", torch.randn(3, 5, 7, generator=g).to(torch.bfloat16)),
    ]


def test_round_trip_is_bitwise_for_every_dtype():
    payload = _payload()
    buckets = list(iter_buckets(payload, bucket_bytes=64, is_expert=IS_EXPERT))
    got = dict(kv for b in buckets for kv in unflatten_bucket(b))
    assert set(got) == {n for n, _ in payload}
    for name, t in payload:
        assert got[name].dtype == t.dtype and got[name].shape == t.shape
        assert torch.equal(got[name].view(torch.uint8), t.view(torch.uint8)), name
    for b in buckets:
        assert b.nbytes <= 64 or len(b.metadata) == 1


def test_sglang_style_reconstruction_casts_nothing():
    """SGLang rebuilds with flattened[start:end].reshape(shape).to(dtype): with one dtype per bucket the
    cast is a no-op, so its reconstruction is bit-identical too (the contract test runs SGLang's class)."""
    for b in iter_buckets(_payload(), bucket_bytes=1 << 20, is_expert=IS_EXPERT):
        for m in sglang_bucket_dict(b)["metadata"]:
            t = b.flattened_tensor[m.start_idx:m.end_idx].reshape(m.shape)
            assert t.dtype == m.dtype and m.end_idx - m.start_idx == m.numel


def test_mixed_dtypes_in_one_bucket_are_rejected():
    with pytest.raises(ValueError, match="one dtype"):
        FlattenedBucket.from_named_tensors([("a", torch.ones(2)), ("b", torch.ones(2, dtype=torch.int32))])


def test_streaming_holds_at_most_one_open_bucket_per_group():
    """A generator that counts live tensors: the bucketer never asks for more than a bucket ahead."""
    produced = []

    def stream():
        for i in range(40):
            produced.append(i)
            yield f"model.layers.{i}.input_layernorm.weight", torch.zeros(64, dtype=torch.bfloat16)  # 128 B

    seen = 0
    for bucket in iter_buckets(stream(), bucket_bytes=512, is_expert=IS_EXPERT):
        # bucket k is emitted at latest when tensor 4k+5 has been pulled (4 per bucket + the overflow one)
        seen += len(bucket.metadata)
        assert len(produced) <= seen + 1
    assert seen == 40


def test_the_caller_says_which_names_are_experts():
    """payload knows no model naming: the predicate it is handed decides (here: every name with a 7 in it)."""
    metas = [meta("a7.weight", 10), meta("b.weight", 10), meta("c7.weight", 10)]
    plan = plan_buckets(metas, bucket_bytes=1 << 20, is_expert=lambda name: "7" in name)
    assert [[m.name for m in b] for b in plan] == [["a7.weight", "c7.weight"], ["b.weight"]]
    streamed = iter_buckets([(m.name, torch.zeros(10, dtype=torch.bfloat16)) for m in metas], 1 << 20,
                            is_expert=lambda name: "7" in name)
    assert sorted(b.names for b in streamed) == [["a7.weight", "c7.weight"], ["b.weight"]]


def test_a_load_together_group_shares_one_bucket_and_the_plan_agrees():
    """DeepSeek-V3's q_a_proj and kv_a_proj_with_mqa must reach SGLang in one update call (its loader fuses them
    within one load_weights call): held until both came, they go into one bucket even where the stream order and
    the bucket size would part them; the plan buckets the same way; a member without a partner goes last."""
    dsv3 = family_named("deepseek_v3")
    is_expert = functools.partial(is_expert_engine_name, naming=dsv3)
    a = "model.layers.1.self_attn."
    stream = [(a + "q_a_proj.weight", torch.zeros(40, dtype=torch.bfloat16)),
              (a + "q_b_proj.weight", torch.zeros(40, dtype=torch.bfloat16)),
              (a + "o_proj.weight", torch.zeros(40, dtype=torch.bfloat16)),
              (a + "kv_a_proj_with_mqa.weight", torch.zeros(40, dtype=torch.bfloat16)),
              ("model.layers.2.self_attn.kv_a_proj_with_mqa.weight", torch.zeros(8, dtype=torch.bfloat16))]
    assert dsv3.engine_load_group(a + "kv_a_proj_with_mqa.weight") == (a + "q_a_proj.weight",
                                                                       a + "kv_a_proj_with_mqa.weight")
    assert dsv3.engine_load_group(a + "q_b_proj.weight") is None
    apart = [b.names for b in iter_buckets(stream, 160, is_expert=is_expert)]
    assert apart == [[a + "q_a_proj.weight", a + "q_b_proj.weight"],
                     [a + "o_proj.weight", a + "kv_a_proj_with_mqa.weight"],
                     ["model.layers.2.self_attn.kv_a_proj_with_mqa.weight"]]  # the failure mode without the rule
    together = [b.names for b in iter_buckets(stream, 160, is_expert=is_expert,
                                                load_together=dsv3.engine_load_group)]
    assert together == [[a + "q_b_proj.weight", a + "o_proj.weight"],
                        [a + "q_a_proj.weight", a + "kv_a_proj_with_mqa.weight"],
                        ["model.layers.2.self_attn.kv_a_proj_with_mqa.weight"]]
    planned = plan_buckets([TensorMeta.of(n, t) for n, t in stream], 160, is_expert=is_expert,
                           load_together=dsv3.engine_load_group)
    assert [[m.name for m in b] for b in planned] == together
    with pytest.raises(ValueError, match="must arrive in one update call but differ in kind or dtype"):
        list(iter_buckets([(a + "q_a_proj.weight", torch.zeros(4, dtype=torch.bfloat16)),
                           (a + "kv_a_proj_with_mqa.weight", torch.zeros(4))], 1 << 20, is_expert=is_expert,
                          load_together=dsv3.engine_load_group))
