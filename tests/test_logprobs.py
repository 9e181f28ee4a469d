"""models/logprobs.py: the chunked vocab-parallel log-softmax against fp64 torch.log_softmax (values and
gradients, within bounds derived from fp32's unit roundoff and the vocabulary size), an fp64 gradcheck, TP=2
over gloo against the whole vocabulary, and the bytes it keeps alive, counted tensor by tensor on the CPU,
against memory.logits_transient_bytes."""
from __future__ import annotations

import math
import os
import socket

import pytest
import torch
import torch.multiprocessing as mp
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from megatron_qarl.memory import LOGPROB_ROW_BYTES, LOGPROB_TOKEN_BYTES, logits_transient_bytes
from megatron_qarl.models.logprobs import chunk_rows, token_logprobs, vocab_parallel_token_logprobs

U = 2.0 ** -24  # fp32 unit roundoff (torch.finfo(torch.float32).eps / 2)


def forward_bound(vocab: int, z_max: float) -> float:
    """|computed - exact| of one log-prob, fp32, rows of `vocab` logits z = logits / T with |z| <= z_max:
    z rounded (u|z|); z - max rounded (u * 2 z_max); exp within 4u (torch's vectorised exp is <= 1 ulp = 2u; 4u
    leaves room); the sum of `vocab` terms by recursive summation (vocab - 1) u (the worst case; torch's
    pairwise sum is far better); so the sum's relative error <= u (vocab + 3 + 4 z_max) and log adds u ln(vocab);
    lse = max + log sum rounded (u (z_max + ln V)); the target logit's own rounding u z_max; lp = target - lse
    rounded (u (2 z_max + ln V)). Total u (vocab + 3 + 8 z_max + 3 ln vocab)."""
    return U * (vocab + 3 + 8 * z_max + 3 * math.log(vocab))


def grad_bound(vocab: int, z_max: float, g_max: float, temperature: float) -> float:
    """|computed - exact| of one gradient element (fp32): p = exp(z - lse) carries the lse error above plus
    u (2 z_max + ln V) for the subtraction and 4u for exp; times g / T (two roundings), the target's += (one):
    |g| / T (forward_bound + u (2 z_max + ln V + 7)), with p <= 1."""
    return g_max / temperature * (forward_bound(vocab, z_max) + U * (2 * z_max + math.log(vocab) + 7))


def reference(logits: torch.Tensor, targets: torch.Tensor, temperature: float, grad_out: torch.Tensor):
    """fp64 log_softmax(logits / T)[targets] and its gradient for `grad_out`, independently of the code under
    test (torch's own log_softmax and autograd, in fp64)."""
    z = logits.detach().double().requires_grad_(True)
    lp = torch.log_softmax(z[:, :-1] / temperature, dim=-1).gather(-1, targets[..., None])[..., 0]
    lp.backward(grad_out.double())
    return lp.detach(), z.grad


def _case(dtype, batch=2, seq=33, vocab=1000, scale=4.0, seed=0):
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(batch, seq, vocab, generator=gen) * scale).to(dtype)
    targets = torch.randint(0, vocab, (batch, seq - 1), generator=gen)
    grad_out = torch.randn(batch, seq - 1, generator=gen)
    return logits, targets, grad_out


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_fp32_values_and_gradients_match_fp64_log_softmax_within_the_derived_bound(temperature):
    logits, targets, grad_out = _case(torch.float32)
    vocab = logits.shape[-1]
    x = logits.clone().requires_grad_(True)
    # 3 rows per chunk: 32 positions per row -> 11 chunks, the last one partial
    lp = vocab_parallel_token_logprobs(x, targets, temperature, chunk_elements=3 * vocab + 17)
    lp.backward(grad_out)
    ref_lp, ref_grad = reference(logits, targets, temperature, grad_out)
    z_max = logits.abs().max().item() / temperature
    assert lp.dtype == torch.float32 and lp.shape == targets.shape
    assert (lp.double() - ref_lp).abs().max().item() <= forward_bound(vocab, z_max)
    g_bound = grad_bound(vocab, z_max, grad_out.abs().max().item(), temperature)
    assert (x.grad.double() - ref_grad).abs().max().item() <= g_bound
    assert torch.all(x.grad[:, -1] == 0)  # the last position predicts nothing


def test_bf16_logits_give_fp32_logprobs_and_bf16_gradients_within_bf16_rounding():
    logits, targets, grad_out = _case(torch.bfloat16, seed=1)
    vocab = logits.shape[-1]
    x = logits.clone().requires_grad_(True)
    lp = vocab_parallel_token_logprobs(x, targets, 0.7, chunk_elements=5 * vocab)
    lp.backward(grad_out)
    ref_lp, ref_grad = reference(logits, targets, 0.7, grad_out)
    z_max = logits.float().abs().max().item() / 0.7
    assert lp.dtype == torch.float32 and x.grad.dtype == torch.bfloat16
    assert (lp.double() - ref_lp).abs().max().item() <= forward_bound(vocab, z_max)
    # the fp32 gradient, then one rounding to bf16 (relative 2^-8)
    err = (x.grad.double() - ref_grad).abs()
    bound = grad_bound(vocab, z_max, grad_out.abs().max().item(), 0.7) + 2.0 ** -8 * ref_grad.abs()
    assert torch.all(err <= bound)


def test_fp64_gradcheck_of_the_chunked_backward():
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(2, 6, 11, dtype=torch.float64, generator=gen, requires_grad=True)
    targets = torch.randint(0, 11, (2, 5), generator=gen)
    assert torch.autograd.gradcheck(
        lambda z: vocab_parallel_token_logprobs(z, targets, 0.7, chunk_elements=2 * 11), (logits,))


def test_a_target_outside_the_vocabulary_gives_minus_logsumexp_as_megatron():
    logits, targets, _ = _case(torch.float32, batch=1, seq=5, vocab=7)
    targets[0, 2] = -100
    lp = vocab_parallel_token_logprobs(logits, targets)
    assert lp[0, 2].item() == pytest.approx(-torch.logsumexp(logits[0, 2].double(), -1).item(), abs=1e-5)


def test_bad_shapes_are_one_clear_line():
    with pytest.raises(ValueError, match=r"logits must be \[B, S, V/TP\] and targets \[B, S-1\]"):
        vocab_parallel_token_logprobs(torch.zeros(2, 5, 7), torch.zeros(2, 5, dtype=torch.long))


# ------------------------------------------------------------------------------------------ tensor parallel

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tp_worker(rank, world, port, logits, targets, grad_out, out_dir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    try:
        group = torch.distributed.new_group(list(range(world)))
        width = logits.shape[-1] // world
        x = logits[..., rank * width:(rank + 1) * width].clone().requires_grad_(True)
        lp = vocab_parallel_token_logprobs(x, targets, 0.7, group=group, chunk_elements=4 * width)
        lp.backward(grad_out)
        torch.save((lp.detach(), x.grad), os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        torch.distributed.destroy_process_group()


def test_tp2_slices_match_the_whole_vocabulary_reference(tmp_path):
    """Two gloo ranks, each with half of the vocabulary: every rank's log-probs are the whole vocabulary's, and
    its gradient is its slice of the whole gradient (the targets fall on both halves)."""
    logits, targets, grad_out = _case(torch.float32, batch=2, seq=9, vocab=64, seed=3)
    mp.spawn(_tp_worker, args=(2, _free_port(), logits, targets, grad_out, str(tmp_path)), nprocs=2, join=True)
    ref_lp, ref_grad = reference(logits, targets, 0.7, grad_out)
    z_max = logits.abs().max().item() / 0.7
    # the cross-rank lse adds two roundings of the combined sum (2 terms) and of its log: within 4u (z_max + ...)
    f_bound = forward_bound(64, z_max) + 4 * U * (z_max + math.log(64) + 2)
    g_bound = grad_bound(64, z_max, grad_out.abs().max().item(), 0.7) + 4 * U * (z_max + 8) * \
        grad_out.abs().max().item() / 0.7
    for rank in range(2):
        lp, grad = torch.load(tmp_path / f"rank{rank}.pt")
        assert (lp.double() - ref_lp).abs().max().item() <= f_bound
        assert (grad.double() - ref_grad[..., rank * 32:(rank + 1) * 32]).abs().max().item() <= g_bound


# ------------------------------------------------------------------------------------------ bytes held

class LiveBytes(TorchDispatchMode):
    """The bytes of every tensor storage created under the mode that is still alive, and their peak, checked
    after every op (autograd's backward ops on the CPU included). In-place ops and views reuse an input's
    storage and add nothing."""

    def __init__(self):
        super().__init__()
        self.tracked: list[tuple[StorageWeakRef, int, int]] = []  # (storage, bytes, address)
        self.peak = 0

    def live(self) -> int:
        self.tracked = [entry for entry in self.tracked if not entry[0].expired()]
        return sum(n for _, n, _ in self.tracked)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.live()
        known = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        known |= {ptr for _, _, ptr in self.tracked}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                ptr = storage.data_ptr()
                if ptr not in known and storage.nbytes():
                    self.tracked.append((StorageWeakRef(storage), storage.nbytes(), ptr))
                    known.add(ptr)
        self.peak = max(self.peak, self.live())
        return out


class OutputLayerLike(torch.nn.Module):
    """The end of megatron's GPTModel, as far as the logits go: a fresh [s, b, V] tensor (the output layer's
    GEMM, here a scale of a weight of that shape) returned as `logits.transpose(0, 1).contiguous()`
    (gpt_model.py:712); its backward makes a new tensor from the [b, s, V] gradient, as the output layer's
    `grad_output.contiguous()` does (utils.py:1086)."""

    def __init__(self, batch, seq, vocab, dtype):
        super().__init__()
        gen = torch.Generator().manual_seed(4)
        self.w = torch.nn.Parameter((torch.randn(seq, batch, vocab, generator=gen) * 3).to(dtype))

    def forward(self, input_ids, position_ids, attention_mask):
        logits = self.w * 1.5  # [s, b, V]
        return logits.transpose(0, 1).contiguous()


@pytest.mark.parametrize("grad", [True, False], ids=["train", "no-grad"])
def test_bytes_alive_are_what_the_memory_model_counts(grad, monkeypatch):
    """bf16 logits [2, 129, 2048] (528k elements), 4 rows per chunk: the peak of the storages alive during
    token_logprobs (forward and backward) is memory.logits_transient_bytes's count, to within its per-token and
    per-chunk-row allowance (LOGPROB_TOKEN_BYTES, LOGPROB_ROW_BYTES: small vectors). The previous form held
    the bf16 logits, their fp32 cast and the fp32 quotient at once (10 B per element against 4 B + a chunk)."""
    import megatron_qarl.models.logprobs as lp_mod

    batch, seq, vocab = 2, 129, 2048
    model = OutputLayerLike(batch, seq, vocab, torch.bfloat16)
    ids = torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(5))
    chunk = 4 * vocab
    monkeypatch.setattr(lp_mod, "CHUNK_ELEMENTS", chunk)
    with LiveBytes() as tracker, torch.set_grad_enabled(grad):
        out = token_logprobs(model, ids, temperature=0.7)
        if grad:
            out.backward(torch.ones_like(out))
    rows = chunk_rows(vocab, chunk)
    tokens = batch * seq
    count = logits_transient_bytes(batch, seq, vocab, 2, grad=grad, chunk_elements=chunk)
    small = tokens * LOGPROB_TOKEN_BYTES + rows * LOGPROB_ROW_BYTES
    # hand count of the large terms: 2 bf16 copies of 528,384 elements (+ one fp32 chunk of 4 rows in the backward)
    large = 2 * 2 * tokens * vocab + (4 * rows * vocab if grad else 0)
    assert count == large + small
    assert large <= tracker.peak <= count, (tracker.peak, large, count)
