"""Two embedded engines on a world of two (EP 2: each rank holds half of the experts), the production
topology's code paths: the publisher, the dispatcher and the trainer's rollout phase.

1. publish (W4A16 aligned, small buckets) to both engines, then an in-place update of every master and
   publish again: each engine holds BITWISE the offline exporter's payload (gather -> mcore_to_hf ->
   engine_named_tensors, none of which the publisher calls); each rank's peak publish bytes are recorded
   next to the whole payload's size;
2. the same requests through 1 engine (rank 0) and through 2 engines (round-robin): samples, log-probs and
   routes are identical; `deliver_samples` hands each rank exactly the rows it asks for;
3. the trainer's `collect_rollouts` with 2 engines: clean (every request of an engine in flight at once), and
   with rollout.max_inflight_requests=1: the same batch bit for bit; with rank 1's engine killed (shut down) at its
   second request: restarted, re-published, the request rerun -> the same batch as the clean run; with
   `engine_restarts=0` the same kill fails the step on BOTH ranks with a clear error (no hang).
Rank 0 writes the numbers as JSON; the asserts are in tests/test_rollout_topology.py.
"""
import dataclasses
import time
from types import SimpleNamespace

import torch
import torch.distributed as dist

from _common import write_result
from publish_common import SCHEMES, build_model, offline_engine_tensors
from publish_layouts import perturb
from megatron_qarl.config import load_config
from megatron_qarl.memory_saver import TrainerMemory
from megatron_qarl.models.aligned import apply_aligned_quantization
from megatron_qarl.models.qwen3_moe import tiny_hf_config
from megatron_qarl.models.registry import family_of
from megatron_qarl.parallel import ParallelLayout, RolloutTopology, init_distributed
from megatron_qarl.rollout.dispatch import Sample, deliver_samples, generate_request, plan_requests
from megatron_qarl.rollout.embedded import EmbeddedEngine
from megatron_qarl.rollout.payload import tensor_sha256
from megatron_qarl.rollout.protocol import RolloutEngineError, SamplingParams
from megatron_qarl.weights.publish import WeightPublisher

N, PROMPTS, REQUEST_PROMPTS = 2, 8, 2


def prompts(vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(7)
    return [torch.randint(1, vocab, (int(3 + i % 4),), generator=gen).tolist() for i in range(PROMPTS)]


def new_engine(cfg) -> EmbeddedEngine:
    return EmbeddedEngine.from_hf_config(cfg, dtype="float32", seed=3, collect_routed_experts=True)


def check_publish(publisher, engine, model, cfg, quant_cfg) -> dict:
    publisher.publish()
    want = offline_engine_tensors(model, cfg, quant_cfg)  # collective (gathers the masters)
    held = engine.checksum(list(want))
    bad = [n for n, t in want.items() if held[n] != tensor_sha256(t)]
    return {"mismatched": bad, "compared": len(want), "payload_bytes": sum(t.nbytes for t in want.values()),
            "largest_tensor_bytes": max(t.nbytes for t in want.values()), "peak_bytes": publisher.peak_bytes}


def as_rows(results) -> list:
    return [(r.token_ids, r.logprobs, r.finish_reason, r.routed_experts) for r in results]


def serve(engine, rows_prompts, sampling, engines: int) -> dict[int, tuple]:
    """This rank's share of the requests when `engines` engines (leaders 0..engines-1) serve them."""
    out = {}
    for req in plan_requests(len(rows_prompts), N, REQUEST_PROMPTS, engines):
        if req.engine == dist.get_rank():
            results, _ = generate_request(engine, rows_prompts, sampling, req, retries=0)
            out.update(zip(req.rows, as_rows(results)))
    return out


def all_rows(local: dict) -> dict:
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, local)
    return {k: v for p in parts for k, v in p.items()}


def same(a: dict, b: dict) -> list[int]:
    bad = sorted(set(a) ^ set(b))
    for k in set(a) & set(b):
        (ta, la, fa, ra), (tb, lb, fb, rb) = a[k], b[k]
        if ta != tb or la != lb or fa != fb or not torch.equal(ra, rb) or ra.dtype != torch.uint8:
            bad.append(k)
    return bad


class KillAt:
    """Kills (shuts down) the wrapped engine when its `at`-th generate call starts: a dead engine process."""

    def __init__(self, engine, at: int):
        self.engine, self.at, self.calls = engine, at, 0

    def generate(self, prompt_ids, sampling):
        self.calls += 1
        if self.calls == self.at:
            self.engine.shutdown()
        return self.engine.generate(prompt_ids, sampling)

    def __getattr__(self, name):
        return getattr(self.engine, name)


def rollout_ctx(run_cfg, engine, publisher, tokenizer, reward_fn, rows_prompts, cfg):
    from megatron_qarl.rollout.protocol import SamplingParams

    batch = [SimpleNamespace(prompt_ids=p, answer="1", row={"answer": "1"}) for p in rows_prompts[::N]]
    return SimpleNamespace(
        cfg=run_cfg, topology=RolloutTopology(2, 2, 1, True), engine=engine, publisher=publisher,
        tokenizer=tokenizer, reward_fn=reward_fn, route_geometry=family_of(cfg).moe_geometry(cfg),
        data=SimpleNamespace(next_batch=lambda k: batch[:k]), reward_counts={}, tracker=None,
        sampling=SamplingParams(temperature=1.0, max_new_tokens=5, seed=11),
        memory=TrainerMemory.for_run(False), quant=None,  # no engine on the trainer's devices: nothing released
        canary=None, publishes=0,  # the restart's re-publish runs no refit canary here (tests/test_canary.py does)
    )


def batch_digest(batch) -> list:
    return [tensor_sha256(t) for t in (batch.input_ids, batch.sampler_logp, batch.advantages, batch.rewards,
                                       batch.routed_experts)]


def main():
    layout = ParallelLayout(tp=1, ep=2)
    init_distributed(layout)
    cfg = tiny_hf_config()
    quant_cfg = SCHEMES["w4a16"]
    model = build_model(layout, cfg)
    aligned = apply_aligned_quantization(model, quant_cfg)
    engine = new_engine(cfg)
    publisher = WeightPublisher(model, cfg, quant_cfg, quant=aligned, engine=engine, leaders=[0, 1],
                                bucket_bytes=16 << 10, verify=True)
    first = check_publish(publisher, engine, model, cfg, quant_cfg)
    perturb(model, 0.05, seed=3)
    aligned.invalidate()
    second = check_publish(publisher, engine, model, cfg, quant_cfg)

    rows_prompts = [p for p in prompts(cfg.vocab_size) for _ in range(N)]
    sampling = SamplingParams(temperature=1.0, max_new_tokens=6, seed=5)
    one = all_rows(serve(engine, rows_prompts, sampling, engines=1))
    two_local = serve(engine, rows_prompts, sampling, engines=2)
    two = all_rows(two_local)
    owned = {r: Sample(r, rows_prompts[r], *v[:3], 0.0, 0.0, r // N, v[3]) for r, v in two_local.items()}
    half = len(rows_prompts) // 2
    wanted = list(range(dist.get_rank() * half, (dist.get_rank() + 1) * half))
    plan = plan_requests(len(rows_prompts), N, REQUEST_PROMPTS, 2)
    got = deliver_samples(owned, wanted, lambda r: plan[r // (REQUEST_PROMPTS * N)].engine)
    delivered_ok = [s.row for s in got] == wanted and not same(
        {s.row: (s.token_ids, s.logprobs, s.finish_reason, s.routed_experts) for s in got},
        {r: one[r] for r in wanted})
    delivered_ok = all_rows({dist.get_rank(): delivered_ok})

    # -- the trainer's rollout phase: clean, killed + recovered, killed without restarts
    from megatron_qarl.rl.rewards import RewardConfig, build_reward_fn
    from megatron_qarl.tokenizer import build_char_tokenizer
    from megatron_qarl.trainer import collect_rollouts

    run_cfg = load_config(None, ["rollout.n=2", f"train.prompts_per_step={PROMPTS}", "train.mini_batch_prompts=4",
                                 f"rollout.request_prompts={REQUEST_PROMPTS}", "rollout.request_retries=1",
                                 "rollout.engine_restarts=1"], world_size=2)
    tokenizer = build_char_tokenizer()
    reward_fn = build_reward_fn(RewardConfig(kind="exact_match"))
    try:
        ctx = rollout_ctx(run_cfg, engine, publisher, tokenizer, reward_fn, rows_prompts, cfg)
        clean, clean_metrics = collect_rollouts(ctx, step=0)
        # one request in flight at a time instead of all of them: the same batch, bit for bit
        ctx.cfg = dataclasses.replace(run_cfg, rollout=dataclasses.replace(run_cfg.rollout, max_inflight_requests=1))
        serial, _ = collect_rollouts(ctx, step=0)
        ctx.cfg = run_cfg
        killer = KillAt(engine, at=2) if dist.get_rank() == 1 else engine
        ctx.engine = killer
        publisher.engine = engine  # the restarted engine object is the same one: re-published in place
        recovered, rec_metrics = collect_rollouts(ctx, step=0)
        no_restart = dataclasses.replace(run_cfg, rollout=dataclasses.replace(run_cfg.rollout, engine_restarts=0))
        ctx.cfg = no_restart
        ctx.engine = KillAt(engine, at=1) if dist.get_rank() == 1 else engine
        t0 = time.perf_counter()
        try:
            collect_rollouts(ctx, step=0)
            failure = "no error"
        except RolloutEngineError as err:
            failure = str(err)
        failed_in = time.perf_counter() - t0
        failures = all_rows({dist.get_rank(): failure})
    finally:
        reward_fn.close()
    recovered_equal = all_rows({dist.get_rank(): batch_digest(clean) == batch_digest(recovered)})
    serial_equal = all_rows({dist.get_rank(): batch_digest(clean) == batch_digest(serial)})
    write_result({
        "publish": [first, second], "engines_differ": same(one, two), "rows": len(one),
        "delivered_ok": delivered_ok, "recovered_equal": recovered_equal, "serial_equal": serial_equal,
        "restarts": rec_metrics["rollout/engine_restarts"], "clean_restarts": clean_metrics["rollout/engine_restarts"],
        "clean_requests": clean_metrics["rollout/requests"], "failures": failures, "failed_in_s": failed_in,
        "peak_by_rank": all_rows({dist.get_rank(): [first["peak_bytes"], second["peak_bytes"]]}),
        "mismatch_by_rank": all_rows({dist.get_rank(): first["mismatched"] + second["mismatched"]}),
    })


if __name__ == "__main__":
    main()
