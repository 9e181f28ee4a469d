"""Trainer optimizers: AdamW and Muon over megatron-core model chunks.

Both optimizers are megatron ``MegatronOptimizer`` chains, so gradient handling stays megatron's:
DDP ``main_grad`` -> ``param.grad``, one global grad norm over dense and expert groups, clipping,
``zero_grad`` and ``sharded_state_dict`` for ``megatron.core.dist_checkpointing``.

- ``adamw``: ``get_megatron_optimizer(OptimizerConfig(optimizer="adam", decoupled_weight_decay=True))``.
- ``muon`` (the paper's optimizer): megatron-core's own Muon when ``emerging_optimizers`` is
  importable (it needs Python >= 3.12); otherwise a fallback built on ``torch.optim.Muon``'s
  Newton-Schulz iteration. Either way, 2-D hidden matrices (attention qkv/proj, dense and expert
  fc1/fc2, the router) go to Muon and everything else (embeddings, output layer, norms, biases) to
  AdamW — the same split megatron's Muon makes.

The fallback orthogonalises a tensor-parallel shard as part of its WHOLE matrix: the momentum
update is all-gathered over the (expert-)TP group, reassembled in the TP=1 row order, put through
Newton-Schulz, and each rank keeps its own slice, so a TP=2 step equals the TP=1 step. GLU fc1
shards are ``[gate_r; up_r]``; a plain gather along dim 0 would give ``[g0;u0;g1;u1]``, a row
permutation P of ``[g;u]``. Newton-Schulz is equivariant to row permutations (every iterate is
``p(X X^T) X`` and ``(PX)(PX)^T = P X X^T P^T``, so ``NS(PX) = P NS(X)``) — in exact arithmetic; with
torch's bf16 iteration the summation order changes, so we reorder to ``[g;u]`` before the iteration
and stay bit-identical to TP=1 instead of relying on it. (Measured on gloo: TP2, EP2 and
TP2/expert-TP1 steps equal torch.optim.Muon on the gathered whole matrices exactly, except split qkv
— q, k, v scaled by their own ratio — within one fp32 ulp, 7e-9.)

Usage (fp32 masters, megatron DDP chunks, parallel state initialised)::

    opt = build_optimizer(cfg, [ddp_model], family_of(hf_config))
    ddp_model.zero_grad_buffer(); loss.backward(); finalize_model_grads([ddp_model])
    success, grad_norm, num_zeros = opt.step()      # also advances the lr schedule
    sd = {"model": model_sd, "optimizer": opt.sharded_state_dict(model_sd)}   # dist_checkpointing.save
    loaded = dist_checkpointing.load({"model": model_sd,
                                      "optimizer": opt.sharded_state_dict(model_sd, is_loading=True)}, d)
    opt.load_state_dict(loaded["optimizer"])
"""
from __future__ import annotations

import contextlib
import importlib.util
import re
from dataclasses import dataclass, field
from typing import Iterable, Iterator, Optional

import torch
import torch.distributed as dist


OPTIMIZER_NAMES = ("adamw", "muon")
MUON_ADJUST_LR = ("original", "match_rms_adamw")
MUON_TP_MODES = ("whole", "blockwise")
MUON_BACKENDS = ("auto", "megatron", "torch")

# Row-block labels of one local 2-D shard (see MuonMatrixLayout).
# megatron's legacy GroupedMLP keeps all local experts in one [H, E*F] matrix: Muon would
# orthogonalise the experts jointly, which is not per-expert Muon.
_LEGACY_GROUPED_MLP_NAME = re.compile(r"experts\.weight[12]$")


class OptimConfigError(ValueError):
    """An optimizer setting is invalid; the message names the setting and the fix."""


@dataclass
class OptimConfig:
    """Optimizer + learning-rate schedule for the trainer (fp32 master weights)."""

    name: str = "adamw"  # adamw | muon (megatron's optimizers)
    lr: float = 1e-6  # peak learning rate
    weight_decay: float = 0.01  # decoupled weight decay
    betas: tuple[float, float] = (0.9, 0.999)  # AdamW moments
    eps: float = 1e-8  # AdamW epsilon
    clip_grad: float = 1.0  # global gradient-norm clip (0: off)
    # Constant lr after an optional linear warmup: step k (0-based) uses lr * (k+1)/(warmup+1).
    lr_warmup_steps: int = 0
    muon_momentum: float = 0.95
    muon_nesterov: bool = True
    muon_ns_steps: int = 5
    # torch.optim.Muon's adjust_lr_fn: "original" = sqrt(max(1, rows/cols)) (Keller Jordan),
    # "match_rms_adamw" = 0.2*sqrt(max(rows, cols)) (Moonlight), so AdamW's lr/wd carry over.
    muon_adjust_lr: str = "match_rms_adamw"
    # Orthogonalise q, k, v of the fused linear_qkv separately (megatron's default); as separate
    # HF q_proj/k_proj/v_proj would be.
    muon_split_qkv: bool = True
    # Orthogonalise gate and up of a GLU fc1 separately (as separate HF gate_proj/up_proj would be);
    # megatron's Muon keeps them as one matrix, which is the default here too.
    muon_split_glu: bool = False
    # "whole": TP shards are orthogonalised as part of the whole matrix (TP-invariant);
    # "blockwise": each shard on its own (cheaper, changes the update with the TP size).
    muon_tp_mode: str = "whole"
    # "auto": megatron-core's Muon if emerging_optimizers is importable, else the torch fallback.
    muon_backend: str = "auto"
    # bf16 model params with fp32 master weights in the optimizer (megatron Float16Optimizer; GPU).
    bf16: bool = False

    def validate(self) -> "OptimConfig":
        if self.name not in OPTIMIZER_NAMES:
            raise OptimConfigError(f"name={self.name!r}: choose one of {OPTIMIZER_NAMES}")
        if not self.lr > 0:
            raise OptimConfigError(f"lr={self.lr}: the learning rate must be > 0 (e.g. 1e-6)")
        if self.weight_decay < 0:
            raise OptimConfigError(f"weight_decay={self.weight_decay}: must be >= 0")
        betas = tuple(self.betas)
        if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
            raise OptimConfigError(f"betas={self.betas}: give two values in [0, 1), e.g. [0.9, 0.999]")
        self.betas = (float(betas[0]), float(betas[1]))
        if not self.eps > 0:
            raise OptimConfigError(f"eps={self.eps}: must be > 0 (e.g. 1e-8)")
        if self.clip_grad < 0:
            raise OptimConfigError(f"clip_grad={self.clip_grad}: must be >= 0 (0 disables clipping)")
        if self.lr_warmup_steps < 0 or int(self.lr_warmup_steps) != self.lr_warmup_steps:
            raise OptimConfigError(f"lr_warmup_steps={self.lr_warmup_steps}: must be an integer >= 0")
        if not 0.0 <= self.muon_momentum < 1.0:
            raise OptimConfigError(f"muon_momentum={self.muon_momentum}: must be in [0, 1), e.g. 0.95")
        if not 1 <= self.muon_ns_steps < 100:
            raise OptimConfigError(f"muon_ns_steps={self.muon_ns_steps}: must be in [1, 99], e.g. 5")
        if self.muon_adjust_lr not in MUON_ADJUST_LR:
            raise OptimConfigError(f"muon_adjust_lr={self.muon_adjust_lr!r}: choose one of {MUON_ADJUST_LR}")
        if self.muon_tp_mode not in MUON_TP_MODES:
            raise OptimConfigError(f"muon_tp_mode={self.muon_tp_mode!r}: choose one of {MUON_TP_MODES}")
        if self.muon_backend not in MUON_BACKENDS:
            raise OptimConfigError(f"muon_backend={self.muon_backend!r}: choose one of {MUON_BACKENDS}")
        if self.name == "muon" and self.muon_backend == "megatron":
            if not megatron_muon_available():
                raise OptimConfigError(
                    "muon_backend='megatron' needs the emerging_optimizers package (Python >= 3.12); "
                    "install it or set muon_backend='auto'/'torch' for the torch.Muon fallback")
            if self.muon_split_glu:
                raise OptimConfigError(
                    "muon_split_glu=true is only implemented by the torch fallback; "
                    "set muon_backend='torch' or muon_split_glu=false")
        return self


def megatron_muon_available() -> bool:
    return importlib.util.find_spec("emerging_optimizers") is not None


def muon_backend_in_use(cfg: OptimConfig) -> str:
    """'megatron' or 'torch': which Muon implementation build_optimizer will use for cfg."""
    if cfg.muon_backend == "auto":
        return "megatron" if megatron_muon_available() else "torch"
    return cfg.muon_backend


# ----------------------------------------------------------------------------------------------
# Whole-matrix Muon over tensor-parallel shards (the fallback's core)
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MuonMatrixLayout:
    """How one local 2-D shard maps onto the whole matrices Muon orthogonalises.

    ``blocks`` are the shard's consecutive row blocks ``(label, rows)``. Every TP rank holds the same
    block structure; the whole matrix of a label is, in TP=1 order, the concatenation over ranks
    (rank order) of that rank's rows with the label — along dim 0 when the shard is split on rows;
    when it is split on columns the ranks' columns are concatenated instead. ``ortho_groups`` lists
    which labels are orthogonalised together, as one matrix stacked in the given order.
    """

    blocks: tuple[tuple[str, int], ...]
    ortho_groups: tuple[tuple[str, ...], ...]
    partition_dim: Optional[int] = None
    tp_group: Optional[dist.ProcessGroup] = field(default=None, compare=False)

    @staticmethod
    def whole(rows: int, partition_dim: Optional[int] = None, tp_group=None) -> "MuonMatrixLayout":
        return MuonMatrixLayout((("w", rows),), (("w",),), partition_dim, tp_group)

    def tp_size(self) -> int:
        if self.partition_dim is None or self.tp_group is None:
            return 1
        return dist.get_world_size(self.tp_group)

    def check(self, shape: torch.Size) -> None:
        rows = sum(n for _, n in self.blocks)
        labels = {label for label, _ in self.blocks}
        grouped = [label for g in self.ortho_groups for label in g]
        if rows != shape[0] or sorted(grouped) != sorted(labels) or len(grouped) != len(labels):
            raise ValueError(f"MuonMatrixLayout {self} does not describe a shard of shape {tuple(shape)}")
        if self.partition_dim not in (None, 0, 1):
            raise ValueError(f"MuonMatrixLayout.partition_dim={self.partition_dim}: must be None, 0 or 1")


def _label_rows(x: torch.Tensor, blocks) -> dict[str, list[torch.Tensor]]:
    """Row blocks of x grouped by label, in order."""
    out: dict[str, list[torch.Tensor]] = {}
    start = 0
    for label, n in blocks:
        out.setdefault(label, []).append(x[start:start + n])
        start += n
    return out


def _assemble_whole(shards: list[torch.Tensor], layout: MuonMatrixLayout) -> dict[str, torch.Tensor]:
    """label -> whole (TP=1 order) matrix of that label, from the shards of all TP ranks."""
    if layout.partition_dim == 1:
        by_label = _label_rows(torch.cat(shards, dim=1), layout.blocks)
        return {label: torch.cat(parts, dim=0) for label, parts in by_label.items()}
    per_rank = [_label_rows(s, layout.blocks) for s in shards]
    return {label: torch.cat([p for rank in per_rank for p in rank[label]], dim=0) for label in per_rank[0]}


def _local_slice(wholes: dict[str, torch.Tensor], layout: MuonMatrixLayout, rank: int, world: int) -> torch.Tensor:
    """Inverse of _assemble_whole for one rank: its shard, rebuilt from the whole matrices."""
    rows_per_rank: dict[str, int] = {}
    for label, n in layout.blocks:
        rows_per_rank[label] = rows_per_rank.get(label, 0) + n
    cursor = {label: 0 for label in rows_per_rank}
    parts = []
    for label, n in layout.blocks:
        whole = wholes[label]
        if layout.partition_dim == 1:
            start = cursor[label]
            cols = whole.shape[1] // world
            parts.append(whole[start:start + n, rank * cols:(rank + 1) * cols])
        else:
            start = rank * rows_per_rank[label] + cursor[label]
            parts.append(whole[start:start + n])
        cursor[label] += n
    return torch.cat(parts, dim=0)


def _torch_muon_internals():
    try:
        from torch.optim._muon import _adjust_lr, _zeropower_via_newtonschulz
    except ImportError as exc:  # private API; pinned torch==2.13.0 has it
        raise ImportError(
            "the Muon fallback uses torch.optim._muon._zeropower_via_newtonschulz/_adjust_lr "
            f"(torch 2.13); this torch {torch.__version__} lacks them") from exc
    return _zeropower_via_newtonschulz, _adjust_lr


class TensorParallelTorchMuon(torch.optim.Muon):
    """``torch.optim.Muon`` whose Newton-Schulz step sees whole matrices under tensor parallelism.

    ``layouts`` gives, per param group and per parameter position, the MuonMatrixLayout of that
    parameter (positions, not tensors, because megatron's Float16Optimizer swaps in fp32 master
    copies in place). Without layouts every parameter is a whole matrix and this is torch's Muon.
    Momentum and weight decay are elementwise and stay local; only the update is gathered.
    """

    def __init__(self, params, layouts: Optional[list[list[MuonMatrixLayout]]] = None,
                 tp_mode: str = "whole", **muon_kwargs):
        super().__init__(params, **muon_kwargs)
        if tp_mode not in MUON_TP_MODES:
            raise ValueError(f"tp_mode={tp_mode!r}: choose one of {MUON_TP_MODES}")
        self.tp_mode = tp_mode
        if layouts is None:
            layouts = [[MuonMatrixLayout.whole(p.shape[0]) for p in g["params"]] for g in self.param_groups]
        if [len(g) for g in layouts] != [len(g["params"]) for g in self.param_groups]:
            raise ValueError("layouts must give one MuonMatrixLayout per parameter of every param group")
        for group, group_layouts in zip(self.param_groups, layouts):
            for p, layout in zip(group["params"], group_layouts):
                layout.check(p.shape)
        self.layouts = layouts
        self._ns, self._adjust_lr = _torch_muon_internals()

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group, group_layouts in zip(self.param_groups, self.layouts):
            for p, layout in zip(group["params"], group_layouts):
                if p.grad is not None:
                    self._step_param(p, layout, group)
        return loss

    def _step_param(self, p: torch.Tensor, layout: MuonMatrixLayout, group: dict) -> None:
        grad = p.grad
        if grad.ndim != 2:
            raise ValueError(f"Muon got a {grad.ndim}-D gradient of shape {tuple(grad.shape)}; only 2-D matrices")
        state = self.state[p]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(grad, memory_format=torch.preserve_format)
        buf = state["momentum_buffer"]
        momentum = group["momentum"]
        # Same arithmetic as torch.optim._muon._single_tensor_muon.
        buf.lerp_(grad, 1 - momentum)
        update = grad.lerp(buf, momentum) if group["nesterov"] else buf
        lr = group["lr"]
        local, whole_shape = self._orthogonalize(update, layout, group)
        p.mul_(1 - lr * group["weight_decay"])
        if whole_shape is not None:
            p.add_(local, alpha=-self._adjust_lr(lr, group["adjust_lr_fn"], whole_shape))
        else:
            p.add_(local, alpha=-lr)

    def _orthogonalize(self, update: torch.Tensor, layout: MuonMatrixLayout, group: dict):
        """This rank's slice of Newton-Schulz(whole matrix) for each ortho group of the layout.

        One ortho group: returns (raw local update, whole shape), so the caller scales the lr exactly
        as torch does. Several: returns (local update with each group already multiplied by its own
        adjust-lr ratio, None).
        """
        tp_size = layout.tp_size() if self.tp_mode == "whole" else 1
        if tp_size > 1:
            shards = [torch.empty_like(update) for _ in range(tp_size)]
            dist.all_gather(shards, update.contiguous(), group=layout.tp_group)
            rank = dist.get_rank(layout.tp_group)
            whole_layout = layout
        else:
            shards, rank = [update], 0
            whole_layout = MuonMatrixLayout(layout.blocks, layout.ortho_groups)
        wholes = _assemble_whole(shards, whole_layout)
        single = len(layout.ortho_groups) == 1
        ortho_wholes: dict[str, torch.Tensor] = {}
        whole_shape = None
        for labels in layout.ortho_groups:
            matrix = torch.cat([wholes[label] for label in labels], dim=0)
            ortho = self._ns(matrix, group["ns_coefficients"], group["ns_steps"], group["eps"])
            if single:
                whole_shape = matrix.shape
            else:
                ortho = ortho.float() * self._adjust_lr(1.0, group["adjust_lr_fn"], matrix.shape)
            start = 0
            for label in labels:
                n = wholes[label].shape[0]
                ortho_wholes[label] = ortho[start:start + n]
                start += n
        return _local_slice(ortho_wholes, whole_layout, rank, tp_size), whole_shape


# ----------------------------------------------------------------------------------------------
# Which megatron parameters Muon takes, and their layouts
# ----------------------------------------------------------------------------------------------


def _unwrap(chunk):
    return getattr(chunk, "module", chunk)


def is_muon_param(name: str, param: torch.nn.Parameter) -> bool:
    """2-D hidden matrices go to Muon; embeddings, output layer and 1-D params go to AdamW."""
    return param.ndim == 2 and not getattr(param, "is_embedding_or_output_parameter", False)


def is_routed_expert_param(layout, param) -> bool:
    # By the family's layout as well as by `allreduce`: megatron only marks experts allreduce=False when EP > 1,
    # but they are sharded over the expert-TP group whatever the EP size.
    return not getattr(param, "allreduce", True) or layout.expert


def _tp_placement(layout, param) -> tuple[Optional[int], Optional[dist.ProcessGroup]]:
    if not getattr(param, "tensor_model_parallel", False):
        return None, None
    from megatron.core import parallel_state

    is_expert = is_routed_expert_param(layout, param)
    group = (parallel_state.get_expert_tensor_parallel_group() if is_expert
             else parallel_state.get_tensor_model_parallel_group())
    if dist.get_world_size(group) == 1:
        return None, None
    return int(param.partition_dim), group


def muon_layout_for(name: str, param: torch.nn.Parameter, transformer_config,
                    split_qkv: bool, split_glu: bool, layout) -> MuonMatrixLayout:
    """The MuonMatrixLayout of one megatron 2-D parameter (its TP shard on this rank); `layout`: the model
    family's `ParamLayout` of the parameter (fused qkv, gated fc1, expert)."""
    if _LEGACY_GROUPED_MLP_NAME.search(name):
        raise ValueError(
            f"{name}: megatron's legacy GroupedMLP stores all experts in one matrix, which Muon would "
            "orthogonalise jointly; build the model with SequentialMLP or TEGroupedMLP experts")
    partition_dim, tp_group = _tp_placement(layout, param)
    rows = param.shape[0]
    if layout.fused_qkv and split_qkv:
        c = transformer_config
        kv = c.kv_channels
        q_rows = c.num_attention_heads // c.num_query_groups * kv
        per_group = q_rows + 2 * kv
        if rows % per_group:
            raise ValueError(f"{name}: {rows} rows is not a multiple of the q+k+v rows per group ({per_group})")
        blocks = tuple(b for _ in range(rows // per_group) for b in (("q", q_rows), ("k", kv), ("v", kv)))
        return MuonMatrixLayout(blocks, (("q",), ("k",), ("v",)), partition_dim, tp_group)
    if layout.glu and transformer_config.gated_linear_unit:
        if rows % 2:
            raise ValueError(f"{name}: a GLU fc1 needs an even number of rows, got {rows}")
        blocks = (("gate", rows // 2), ("up", rows // 2))
        groups = (("gate",), ("up",)) if split_glu else (("gate", "up"),)
        return MuonMatrixLayout(blocks, groups, partition_dim, tp_group)
    return MuonMatrixLayout.whole(rows, partition_dim, tp_group)


def named_trainable_params(model_chunks) -> Iterator[tuple[str, torch.nn.Parameter]]:
    for chunk in model_chunks:
        for name, param in chunk.named_parameters():
            if param.requires_grad:
                yield name, param


@contextlib.contextmanager
def _only_trainable(model_chunks, keep: set[int]):
    """Temporarily freeze every trainable param whose id is not in keep (how megatron's
    optimizer builders are told which params to take)."""
    frozen = [p for _, p in named_trainable_params(model_chunks) if id(p) not in keep]
    for p in frozen:
        p.requires_grad = False
    try:
        yield
    finally:
        for p in frozen:
            p.requires_grad = True


# ----------------------------------------------------------------------------------------------
# Builders
# ----------------------------------------------------------------------------------------------


def distributed_optimizer_refusal(ddp_configs: Iterable) -> str | None:
    """Why megatron's distributed optimizer cannot be built here (one line), None when no chunk asks for it.

    `DistributedDataParallelConfig(use_distributed_optimizer=True)` makes DDP allocate a param buffer next to the
    grad buffer and re-point every ``param.data`` into it (mcore megatron/core/distributed/param_and_grad_buffer.py
    :796-834: ``self.param_data = torch.zeros(...)``, then ``param.data = new_param_data`` and a copy). The trainer
    builds DDP inside the memory saver's TRAINER_GRADS region, which has no host backup (memory_saver.REGIONS:
    grads are dead between steps), so the first release for a colocated engine would drop the bf16 params
    themselves; and the optimizers built here do not shard their state (``_megatron_config``:
    ``use_distributed_optimizer=False``), which megatron's mixed-precision optimizer would need to match."""
    if any(getattr(c, "use_distributed_optimizer", False) for c in ddp_configs):
        return ("megatron's distributed optimizer (DistributedDataParallelConfig(use_distributed_optimizer=True)) "
                "is not supported: DDP moves every param into its param buffer, which the trainer allocates in the "
                "memory saver's TRAINER_GRADS region that has no host backup, so a release for a colocated engine "
                "would lose the params; build DDP with use_distributed_optimizer=False")
    return None


def _megatron_config(cfg: OptimConfig):
    from megatron.core.optimizer import OptimizerConfig

    return OptimizerConfig(
        optimizer="adam",
        lr=cfg.lr,
        min_lr=0.0,
        weight_decay=cfg.weight_decay,
        adam_beta1=cfg.betas[0],
        adam_beta2=cfg.betas[1],
        adam_eps=cfg.eps,
        decoupled_weight_decay=True,
        clip_grad=cfg.clip_grad,
        bf16=cfg.bf16,
        params_dtype=torch.bfloat16 if cfg.bf16 else torch.float32,
        use_distributed_optimizer=False,
        muon_momentum=cfg.muon_momentum,
        muon_use_nesterov=cfg.muon_nesterov,
        muon_num_ns_steps=cfg.muon_ns_steps,
        muon_split_qkv=cfg.muon_split_qkv,
        muon_tp_mode="duplicated" if cfg.muon_tp_mode == "whole" else "blockwise",
        # emerging_optimizers' scale modes: "shape_scaling" = sqrt(max(1, rows/cols)) ("original"),
        # "spectral" = sqrt(max(rows, cols)), x0.2 = Moonlight's match_rms_adamw.
        muon_scale_mode="shape_scaling" if cfg.muon_adjust_lr == "original" else "spectral",
        muon_extra_scale_factor=1.0 if cfg.muon_adjust_lr == "original" else 0.2,
    )


def _init_momentum_state(opt, config=None):
    # Lets megatron's sharded_state_dict(is_loading=True) see the state keys before a first step.
    for group in opt.param_groups:
        for p in group["params"]:
            if len(opt.state[p]) == 0:
                opt.state[p]["momentum_buffer"] = torch.zeros_like(p.data)


def _muon_layouts(model_chunks, cfg: OptimConfig, family) -> dict[int, MuonMatrixLayout]:
    layouts = {}
    for chunk in model_chunks:
        tcfg = _unwrap(chunk).config
        for name, param in chunk.named_parameters():
            if param.requires_grad and is_muon_param(name, param):
                layouts[id(param)] = muon_layout_for(name, param, tcfg, cfg.muon_split_qkv, cfg.muon_split_glu,
                                                     family.param_layout(name))
    return layouts


def _wrap_muon(param_groups, layouts_by_id, cfg, mcfg, grad_stats_group, tp_group):
    from megatron.core.optimizer.optimizer import FP32Optimizer, Float16OptimizerWithFloat16Params

    layouts = [[layouts_by_id[id(p)] for p in g["params"]] for g in param_groups]
    muon = TensorParallelTorchMuon(
        param_groups, layouts=layouts, tp_mode=cfg.muon_tp_mode, lr=cfg.lr, weight_decay=cfg.weight_decay,
        momentum=cfg.muon_momentum, nesterov=cfg.muon_nesterov, ns_steps=cfg.muon_ns_steps,
        adjust_lr_fn=cfg.muon_adjust_lr)
    if cfg.bf16:
        wrapped = Float16OptimizerWithFloat16Params(muon, mcfg, None, _init_momentum_state)
    else:
        wrapped = FP32Optimizer(muon, mcfg, _init_momentum_state)
    wrapped.grad_stats_parallel_group = grad_stats_group
    wrapped.tp_group = tp_group
    return wrapped


def _build_torch_muon(cfg: OptimConfig, model_chunks, mcfg, family):
    """megatron's get_megatron_muon_optimizer, with the torch-based TP Muon in place of
    emerging_optimizers: [dense Muon, expert Muon] + megatron's chained AdamW for the rest."""
    from megatron.core import parallel_state
    from megatron.core.optimizer import _get_param_groups, get_megatron_optimizer
    from megatron.core.optimizer.optimizer import ChainedOptimizer

    layouts = _muon_layouts(model_chunks, cfg, family)
    muon_ids = set(layouts)
    with _only_trainable(model_chunks, muon_ids):
        groups = _get_param_groups(model_chunks, mcfg, None)
    dense = [g for g in groups if not g["is_expert_parallel"]]
    expert = [g for g in groups if g["is_expert_parallel"]]
    tp_group = parallel_state.get_tensor_model_parallel_group()
    optimizers = []
    if dense:
        optimizers.append(_wrap_muon(dense, layouts, cfg, mcfg, parallel_state.get_model_parallel_group(), tp_group))
    if expert:
        optimizers.append(_wrap_muon(
            expert, layouts, cfg, mcfg, parallel_state.get_expert_tensor_model_pipeline_parallel_group(), tp_group))
    other_ids = {id(p) for _, p in named_trainable_params(model_chunks)} - muon_ids
    with _only_trainable(model_chunks, other_ids):
        adam = get_megatron_optimizer(mcfg, model_chunks)
    return ChainedOptimizer(optimizers + list(adam.chained_optimizers))


def _build_megatron_muon(cfg: OptimConfig, model_chunks, mcfg):
    from megatron.core.optimizer.muon import get_megatron_muon_optimizer

    return get_megatron_muon_optimizer(mcfg, model_chunks)


def _linear_warmup_constant_scheduler(optimizer, cfg: OptimConfig):
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    # megatron's scheduler also applies the per-group wd_mult (no decay on norms and biases), so
    # it is needed even for a constant lr. init_lr = lr/(w+1) makes step k use lr*(k+1)/(w+1).
    warmup = int(cfg.lr_warmup_steps)
    return OptimizerParamScheduler(
        optimizer, init_lr=cfg.lr / (warmup + 1), max_lr=cfg.lr, min_lr=0.0, lr_warmup_steps=warmup,
        lr_decay_steps=warmup + 1, lr_decay_style="constant", start_wd=cfg.weight_decay,
        end_wd=cfg.weight_decay, wd_incr_steps=1, wd_incr_style="constant")


class QarlOptimizer:
    """A megatron optimizer chain plus its lr/wd scheduler, stepped together."""

    def __init__(self, cfg: OptimConfig, optimizer, scheduler, backend: str):
        self.cfg = cfg
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.backend = backend

    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups

    @property
    def chained_optimizers(self) -> list:
        return list(self.optimizer.chained_optimizers)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none)

    def step(self):
        """megatron's (success, grad_norm, num_zeros_in_grad); advances the schedule on success.

        Ends by dropping the ``param.grad`` aliases of ``main_grad`` that megatron's optimizer set:
        left in place, the next backward accumulates into ``param.grad`` (= ``main_grad``) and DDP's
        hook then adds it to ``main_grad`` again, doubling the next gradients. (megatron's own
        train_step avoids this with ``optimizer.zero_grad()`` at the start of every iteration.)
        The gradients stay readable in ``param.main_grad`` until DDP's ``zero_grad_buffer()``.
        """
        success, grad_norm, num_zeros = self.optimizer.step()
        if success:
            self.scheduler.step(1)
        self.optimizer.zero_grad(set_to_none=True)
        return success, grad_norm, num_zeros

    def current_lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"]) if self.optimizer.param_groups else self.cfg.lr

    def state_dict(self) -> dict:
        return {"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict()}

    def sharded_state_dict(self, model_sharded_state_dict, is_loading: bool = False) -> dict:
        """For megatron.core.dist_checkpointing.save/load, next to the model's sharded state dict."""
        return {
            "optimizer": self.optimizer.sharded_state_dict(model_sharded_state_dict, is_loading=is_loading),
            "scheduler": self.scheduler.state_dict(),
        }

    def load_state_dict(self, state_dict: dict) -> None:
        """Accepts state_dict() output or what dist_checkpointing.load returns for sharded_state_dict()."""
        missing = {"optimizer", "scheduler"} - set(state_dict)
        if missing:
            raise KeyError(f"optimizer state dict lacks {sorted(missing)}; was it written by QarlOptimizer?")
        self.optimizer.load_state_dict(state_dict["optimizer"])
        self.scheduler.load_state_dict(state_dict["scheduler"])


def build_optimizer(cfg: OptimConfig, model_chunks: Iterable, family) -> QarlOptimizer:
    """The trainer's optimizer over megatron-DDP-wrapped model chunks (parallel state initialised); `family`: the
    model's `ModelFamily` (which parameters are experts, fused qkv, gated fc1)."""
    cfg.validate()
    model_chunks = list(model_chunks)
    if not model_chunks:
        raise ValueError("build_optimizer got no model chunks")
    for chunk in model_chunks:
        if not hasattr(chunk, "ddp_config"):
            raise TypeError(
                f"build_optimizer needs megatron DistributedDataParallel-wrapped chunks (for main_grad); "
                f"got {type(chunk).__name__}")
    refusal = distributed_optimizer_refusal(chunk.ddp_config for chunk in model_chunks)
    if refusal:
        raise OptimConfigError(refusal)
    if cfg.bf16 and not torch.cuda.is_available():
        raise OptimConfigError(
            "bf16=true keeps bf16 model params with fp32 masters in megatron's Float16Optimizer, which "
            "only accepts CUDA tensors; without a GPU keep fp32 params (bf16=false)")
    mcfg = _megatron_config(cfg)
    if cfg.name == "adamw":
        from megatron.core.optimizer import get_megatron_optimizer

        optimizer, backend = get_megatron_optimizer(mcfg, model_chunks), "megatron"
    elif muon_backend_in_use(cfg) == "megatron":
        optimizer, backend = _build_megatron_muon(cfg, model_chunks, mcfg), "megatron"
    else:
        optimizer, backend = _build_torch_muon(cfg, model_chunks, mcfg, family), "torch"
    return QarlOptimizer(cfg, optimizer, _linear_warmup_constant_scheduler(optimizer, cfg), backend)
