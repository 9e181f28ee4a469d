"""AdamW through megatron (world 1): two steps with gradient clipping must equal a hand-written
AdamW on the same main_grads — decoupled weight decay on matrices, none on 1-D params (norms),
global-norm clipping, bias-corrected moments — and report the same grad norm."""
import math

import torch

from _common import write_result
from optim_model import build_ddp_model, forward_backward

from megatron_qarl.models.registry import family_named
from megatron_qarl.optim import OptimConfig, build_optimizer
from megatron_qarl.parallel import ParallelLayout, destroy_distributed, init_distributed

QWEN3 = family_named("qwen3_moe")

LR, WD, BETAS, EPS, CLIP = 1e-3, 0.1, (0.9, 0.95), 1e-8, 0.05


def main():
    init_distributed(ParallelLayout(tp=1), seed=1234)
    model = build_ddp_model(tp=1)
    opt = build_optimizer(OptimConfig(name="adamw", lr=LR, weight_decay=WD, betas=BETAS, eps=EPS, clip_grad=CLIP),
                          [model], QWEN3)
    params = dict(model.named_parameters())
    ref = {n: p.detach().clone().double() for n, p in params.items()}
    m = {n: torch.zeros_like(v) for n, v in ref.items()}
    v2 = {n: torch.zeros_like(v) for n, v in ref.items()}
    norms, clipped = [], []
    for step in range(1, 3):
        forward_backward(model, seed=10 + step)
        grads = {n: p.main_grad.detach().clone().double() for n, p in params.items()}
        norm = math.sqrt(sum(float((g * g).sum()) for g in grads.values()))
        coef = CLIP / (norm + 1e-6)
        clipped.append(coef < 1.0)
        success, grad_norm, _ = opt.step()
        assert success
        assert abs(grad_norm - norm) <= 1e-5 * norm, (grad_norm, norm)
        norms.append(norm)
        for n in ref:
            g = grads[n] * min(coef, 1.0)
            m[n] = BETAS[0] * m[n] + (1 - BETAS[0]) * g
            v2[n] = BETAS[1] * v2[n] + (1 - BETAS[1]) * g * g
            m_hat = m[n] / (1 - BETAS[0] ** step)
            v_hat = v2[n] / (1 - BETAS[1] ** step)
            wd = WD if ref[n].ndim >= 2 else 0.0  # megatron skips decay on 1-D params and biases
            ref[n] = ref[n] * (1 - LR * wd) - LR * m_hat / (v_hat.sqrt() + EPS)
        # fp32 params: compare with a tolerance of a few fp32 ulps of each value (norm weights are ~1).
        rel = {n: ((params[n].detach().double() - ref[n]).abs() / (ref[n].abs() + 1e-2)).max().item() for n in ref}
        worst = max(rel.values())
        assert worst < 3e-7, f"step {step}: megatron AdamW differs from the hand reference: {max(rel, key=rel.get)} {worst}"
    assert all(clipped), "the test must exercise clipping"
    # step() drops the param.grad aliases of main_grad, so a next backward is not doubled.
    # (tests/dist/optim_checkpoint.py's bit-identical resume fails without it.)
    assert all(p.grad is None for p in params.values())
    norm_params = [n for n in params if params[n].ndim == 1]
    assert norm_params
    write_result({"grad_norms": norms, "max_rel_diff": worst, "n_params": len(params),
                  "n_no_decay": len(norm_params)})
    destroy_distributed()


if __name__ == "__main__":
    main()
