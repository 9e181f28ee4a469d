"""Typed HF <-> megatron-core mappings, and a family's naming as ONE declared list of them (`MoENaming`).

In the style of Megatron-Bridge's param mappings (``AutoMapping``, ``QKVMapping``, ``GatedMLPMapping``): one row
names one full (unsharded) megatron tensor and the HF checkpoint tensor(s) it is made of; how they join into it
and split back (for every encoding whose rows follow the weight's rows: the weight, packed codes, scales); the HF
shapes as functions of the HF config; where it exists (a predicate on the config and the layer); its quantization
group ("experts", "attention", "dense_mlp" or None: never quantized) and its tensor-parallel `ParamLayout`.
Names are templates with the wildcards ``{layer}`` and ``{expert}``; mcore names carry the GLOBAL expert id
(``decoder.layers.{layer}.mlp.experts.local_experts.{expert}``; weights/sharding.py maps global <-> local ids).

`MoENaming` derives from that one list, both ways, everything the rest of the code asks of a family's naming:
hf_to_mcore, mcore_to_hf, to_hf, from_hf, hf_names, expected_hf_shapes, expected_mcore_shapes, param_layout,
linear_group, fused_linear_group, compressed_tensors_ignore, hf_linear_name, engine_load_group, and where
transformers holds a checkpoint tensor (`module_of`): transformers 5 keeps routed experts fused in memory
(``mlp.experts.gate_up_proj`` [E, 2I, H] = [gate; up] per expert, as megatron's fc1, and ``mlp.experts.down_proj``
[E, H, I]) while files and engines use per-expert names; `hf_state_from_model` / `transformers_tensor` /
`load_hf_state_into_model` translate, matching what ``save_pretrained`` writes.

The shared MoE base: the rows every MoE decoder here has alike (`embeddings`, `layer_norms`, `o_proj`, `router`,
`gated_mlp`, `routed_experts`), which a family's table lists next to its own rows. Pure functions of names,
configs and tensors; no torch.distributed.
"""
from __future__ import annotations

import copy
import dataclasses
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from megatron_qarl.models.family import ParamLayout, WeightMappingError
from megatron_qarl.models.hf_state import validate_state

Shape = Callable[[Any], tuple[int, ...]]  # hf_config -> an HF tensor's shape
Applies = Callable[[Any, int], bool]  # (hf_config, layer) -> whether that decoder layer has the tensor

HF_LAYER, MC_LAYER = "model.layers.{layer}.", "decoder.layers.{layer}."
HF_EXPERT, MC_EXPERT = "mlp.experts.{expert}.", "mlp.experts.local_experts.{expert}."
_MC_EXPERTS = ".mlp.experts."  # megatron's routed experts (local, global or grouped-GEMM names; not shared_experts)
REPLICATED, COLUMN, ROW = ParamLayout(None), ParamLayout(0), ParamLayout(1)
GROUPS = ("experts", "attention", "dense_mlp")  # the quantization groups, in the order ignore lists are written
_WEIGHT = ".weight"
_GROUPED_WEIGHT = re.compile(r"\.weight\d+$")  # grouped-GEMM experts (TE spec): linear_fc1.weight<e>


_WILDCARDS = {"{layer}": r"\d+", "{expert}": r"\d+", "{scope}": r".*\."}


def _pattern(template: str, named: bool = True) -> str:
    """A name template as a regex: `{layer}` / `{expert}` match decimal ids, `{scope}` any module path ending in a
    dot (named groups unless `named` is False)."""
    out = []
    for piece in re.split(r"(\{layer\}|\{expert\}|\{scope\})", template):
        if piece in _WILDCARDS:
            out.append(rf"(?P<{piece[1:-1]}>{_WILDCARDS[piece]})" if named else _WILDCARDS[piece])
        else:
            out.append(re.escape(piece))
    return "".join(out)


def _scoped(template: str) -> str:
    """An HF template as the name questions read it: a decoder layer's names under any module path (``{scope}``,
    e.g. ``model.layers.3.``: the linears of a layer are asked about under other roots too)."""
    return "{scope}" + template[len(HF_LAYER):] if template.startswith(HF_LAYER) else template


def _compiled(template: str) -> re.Pattern:
    """A name template's regex, matching whole names (`.match` anchors the start, `$` the end)."""
    return re.compile(_pattern(template) + "$")


def _linear(template: str) -> str:
    """An HF weight template's linear (module) name: without `.weight`."""
    return template[: -len(_WEIGHT)]


# ------------------------------------------------------------------------------------------------ the rows

class StateDictMapping:
    """One full megatron tensor <-> its HF checkpoint tensor(s) in split order, 1:1 here (subclasses join several).

    `shapes`: each HF tensor's shape from the HF config; `when`: whether layer `layer` of a config has it (None:
    always); `group`: the quantization group of its HF linears; `fused_as`: for a routed expert's row, the tensor
    of transformers' fused ``mlp.experts`` module that holds it (expert e's rows, in split order); `embedding`: the
    token embedding (no linear an engine quantizes or is asked about)."""

    def __init__(self, hf: Sequence[str], mcore: str, shapes: Sequence[Shape], *, layout: ParamLayout = REPLICATED,
                 group: str | None = None, when: Applies | None = None, fused_as: str | None = None,
                 embedding: bool = False):
        if len(hf) != len(shapes):
            raise ValueError(f"{mcore}: {len(hf)} HF names but {len(shapes)} shapes")
        if group not in (None, *GROUPS):
            raise ValueError(f"{mcore}: unknown quantization group {group!r}; groups: {GROUPS}")
        self.hf, self.mcore, self.shapes = tuple(hf), mcore, tuple(shapes)
        self.layout, self.group, self.when, self.fused_as, self.embedding = layout, group, when, fused_as, embedding

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.mcore!r} <- {', '.join(self.hf)})"

    def prefixed(self, hf_prefix: str, mcore_prefix: str, **changes) -> StateDictMapping:
        """This row under a module prefix on each side (a decoder layer, an expert), with attributes changed."""
        row = copy.copy(self)
        row.hf, row.mcore = tuple(hf_prefix + n for n in self.hf), mcore_prefix + self.mcore
        for key, value in changes.items():
            setattr(row, key, value)
        return row

    def exists(self, hf_config, layer: int | None) -> bool:
        return self.when is None or bool(self.when(hf_config, layer))

    def hf_shapes(self, hf_config) -> list[tuple[int, ...]]:
        return [tuple(int(d) for d in shape(hf_config)) for shape in self.shapes]

    def join(self, hf_config, tensors: Sequence[torch.Tensor], query_groups: int | None = None) -> torch.Tensor:
        """The mcore tensor from the HF tensors (in `hf` order); the tensor itself when 1:1 (not copied)."""
        (tensor,) = tensors
        return tensor

    def split(self, hf_config, parts: Mapping[str, torch.Tensor], shape) -> list[tuple[dict, tuple[int, ...]]]:
        """(parts, weight shape) of each HF tensor, in `hf` order, from the parts of the mcore tensor."""
        return [(dict(parts), tuple(shape))]


class AutoMapping(StateDictMapping):
    """A 1:1 rename: one HF tensor is the megatron tensor."""

    def __init__(self, hf: str, mcore: str, shape: Shape, **kw):
        super().__init__((hf,), mcore, (shape,), **kw)


class GatedMLPMapping(StateDictMapping):
    """Megatron's gated fc1 = [gate; up] (rows), from HF's gate_proj and up_proj of `shape` each; split over TP
    gate and up apart (ParamLayout.glu). Engines fuse the two into one linear (gate_up_proj / w13)."""

    def __init__(self, gate: str, up: str, mcore: str, shape: Shape, *, layout: ParamLayout | None = None, **kw):
        super().__init__((gate, up), mcore, (shape, shape), layout=layout or ParamLayout(0, glu=True), **kw)

    def join(self, hf_config, tensors, query_groups=None):
        return torch.cat(list(tensors), dim=0)

    def split(self, hf_config, parts, shape):
        rows, cols = tuple(shape)
        halves = {k: torch.chunk(v, 2, dim=0) for k, v in parts.items()}
        return [({k: h[i].contiguous() for k, h in halves.items()}, (rows // 2, cols)) for i in range(2)]


def interleave_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_kv_heads: int,
                   head_dim: int) -> torch.Tensor:
    """mcore linear_qkv rows: for each query group g, [q heads of g; k_g; v_g]."""
    hidden = q.shape[-1]
    q_per_group = q.shape[0] // (num_kv_heads * head_dim)
    qg = q.reshape(num_kv_heads, q_per_group * head_dim, hidden)
    kg = k.reshape(num_kv_heads, head_dim, hidden)
    vg = v.reshape(num_kv_heads, head_dim, hidden)
    return torch.cat([qg, kg, vg], dim=1).reshape(-1, hidden)


def split_qkv(qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int):
    """Inverse of interleave_qkv -> (q, k, v) in HF row order."""
    hidden = qkv.shape[-1]
    q_per_group = num_heads // num_kv_heads
    grouped = qkv.reshape(num_kv_heads, (q_per_group + 2) * head_dim, hidden)
    q, k, v = torch.split(grouped, [q_per_group * head_dim, head_dim, head_dim], dim=1)
    return (q.reshape(-1, hidden), k.reshape(-1, hidden), v.reshape(-1, hidden))


class QKVMapping(StateDictMapping):
    """Megatron's fused linear_qkv: q / k / v rows interleaved per query group (ParamLayout.fused_qkv), from HF's
    q_proj, k_proj, v_proj. `heads`: hf_config -> (query heads, key/value heads, head_dim)."""

    def __init__(self, q: str, k: str, v: str, mcore: str, heads: Callable[[Any], tuple[int, int, int]], **kw):
        def rows(count):
            return lambda c: (count(heads(c)) * heads(c)[2], c.hidden_size)
        shapes = (rows(lambda h: h[0]), rows(lambda h: h[1]), rows(lambda h: h[1]))
        super().__init__((q, k, v), mcore, shapes, layout=ParamLayout(0, fused_qkv=True), **kw)
        self.heads = heads

    def join(self, hf_config, tensors, query_groups=None):
        """For a tensor-parallel slice, q / k / v are row slices holding `query_groups` whole groups."""
        q, k, v = tensors
        _, num_kv, head_dim = self.heads(hf_config)
        return interleave_qkv(q, k, v, query_groups or num_kv, head_dim)

    def split(self, hf_config, parts, shape):
        rows, cols = tuple(shape)
        num_q, num_kv, head_dim = self.heads(hf_config)
        split = {k: self._split_rows(hf_config, v, rows) for k, v in parts.items()}
        sizes = (num_q * head_dim, num_kv * head_dim, num_kv * head_dim)
        return [({k: v[i].contiguous() for k, v in split.items()}, (sizes[i], cols)) for i in range(3)]

    def _split_rows(self, hf_config, part: torch.Tensor, weight_rows: int) -> tuple[torch.Tensor, ...]:
        """q, k, v of one part whose rows may be coarser than the weight's (FP8 scale blocks): a part row then
        covers weight_rows / rows weight rows, and heads must hold whole part rows."""
        num_q, num_kv, head_dim = self.heads(hf_config)
        head_rows = head_dim * part.shape[0]
        if head_rows % weight_rows:
            raise WeightMappingError(f"qkv part with {part.shape[0]} rows (weight rows {weight_rows}) does not split "
                                     f"into heads of {head_dim} rows: FP8 blocks must not straddle heads "
                                     "(block | head_dim)")
        return split_qkv(part, num_q, num_kv, head_rows // weight_rows)


def in_layer(*rows: StateDictMapping) -> list[StateDictMapping]:
    """Rows named inside a decoder layer (`model.layers.{layer}.` / `decoder.layers.{layer}.`)."""
    return [row.prefixed(HF_LAYER, MC_LAYER) for row in rows]


# ---------------------------------------------------------------------------------- the shared MoE base

def _hidden(c) -> tuple[int]:
    return (c.hidden_size,)


def _vocab_hidden(c) -> tuple[int, int]:
    return (c.vocab_size, c.hidden_size)


def embeddings() -> list[StateDictMapping]:
    """The token embedding, the final norm and the output layer (untied)."""
    return [AutoMapping("model.embed_tokens.weight", "embedding.word_embeddings.weight", _vocab_hidden, layout=COLUMN,
                        embedding=True),
            AutoMapping("model.norm.weight", "decoder.final_layernorm.weight", _hidden),
            AutoMapping("lm_head.weight", "output_layer.weight", _vocab_hidden, layout=COLUMN)]


def layer_norms() -> list[StateDictMapping]:
    """A decoder layer's two norms (layer-relative names)."""
    return [AutoMapping("input_layernorm.weight", "input_layernorm.weight", _hidden),
            AutoMapping("post_attention_layernorm.weight", "pre_mlp_layernorm.weight", _hidden)]


def o_proj(in_features: Callable[[Any], int]) -> StateDictMapping:
    """The attention output projection (row-parallel) from `in_features` (heads x value head width)."""
    return AutoMapping("self_attn.o_proj.weight", "self_attention.linear_proj.weight",
                       lambda c: (c.hidden_size, in_features(c)), layout=ROW, group="attention")


def router(num_experts: Callable[[Any], int], when: Applies | None = None) -> StateDictMapping:
    """The MoE router's weight (never quantized)."""
    return AutoMapping("mlp.gate.weight", "mlp.router.weight", lambda c: (num_experts(c), c.hidden_size), when=when)


def gated_mlp(hf_prefix: str, mcore_prefix: str, size: Callable[[Any], int], *, group: str = "dense_mlp",
              when: Applies | None = None, fused_as: tuple[str, str] = (None, None)) -> list[StateDictMapping]:
    """A gated MLP of intermediate `size`: gate/up_proj -> linear_fc1 ([gate; up]), down_proj -> linear_fc2."""
    def up(c):
        return (size(c), c.hidden_size)

    return [GatedMLPMapping(hf_prefix + "gate_proj.weight", hf_prefix + "up_proj.weight", mcore_prefix + "linear_fc1.weight",
                            up, group=group, when=when, fused_as=fused_as[0]),
            AutoMapping(hf_prefix + "down_proj.weight", mcore_prefix + "linear_fc2.weight",
                        lambda c: (c.hidden_size, size(c)), layout=ROW, group=group, when=when, fused_as=fused_as[1])]


def routed_experts(when: Applies | None = None) -> list[StateDictMapping]:
    """Expert `{expert}`'s gated MLP (layer-relative names): HF ``mlp.experts.{expert}.*_proj`` <-> megatron
    ``mlp.experts.local_experts.{expert}.linear_fc1/2``, held by transformers in the fused ``mlp.experts`` tensors
    ``gate_up_proj`` / ``down_proj``; split over EP x expert-TP."""
    rows = gated_mlp(HF_EXPERT, MC_EXPERT, lambda c: c.moe_intermediate_size, group="experts", when=when,
                     fused_as=("gate_up_proj", "down_proj"))
    for row in rows:
        row.layout = dataclasses.replace(row.layout, expert=True)
    return rows


# ------------------------------------------------------------------------------------- where transformers holds it

@dataclass(frozen=True)
class ModuleSlot:
    """Where a transformers model holds a checkpoint-named tensor or linear: tensor `tensor` of module `module`,
    all of it; or, for a routed expert (`expert` not None), rows part `part` of `parts` equal row blocks of
    ``<module>.<tensor>[expert]`` (``...mlp.experts.3.up_proj``: rows [I, 2I) of ``...mlp.experts.gate_up_proj[3]``)."""

    module: str
    tensor: str = "weight"
    expert: int | None = None
    part: int = 0
    parts: int = 1

    @property
    def fused_experts(self) -> bool:
        """The module is a fused experts module (one forward for all its experts)."""
        return self.expert is not None

    def view(self, tensor: torch.Tensor) -> torch.Tensor:
        """This slot of the module's `tensor` (a view)."""
        if self.expert is None:
            return tensor
        rows = tensor[self.expert]
        return rows if self.parts == 1 else torch.chunk(rows, self.parts, dim=0)[self.part]


# ------------------------------------------------------------------------------------------ the naming

def _leaf(mcore_name: str) -> str:
    return ".".join(mcore_name.split(".")[-2:])


class MoENaming:
    """A family's HF <-> megatron naming, derived from ONE list of rows (module docstring).

    `num_experts`: hf_config -> routed experts per MoE layer; `ignore`: per quantization group, the
    compressed-tensors ignore entries that keep it bf16 (engine-facing patterns, declared as data); `never_quantized`:
    the entries every ignore list starts with; `load_together`: HF tensor templates an engine must receive in one
    update call (its loader fuses them within one call); `unused_hf`: (hf_config, HF name) -> whether a checkpoint
    tensor is one the model leaves unread (DeepSeek-V3's MTP layers), which every HF-side check then skips."""

    def __init__(self, family: str, rows: Sequence[StateDictMapping], *, num_experts: Callable[[Any], int],
                 ignore: Mapping[str, Sequence[str]], never_quantized: Sequence[str],
                 load_together: Sequence[tuple[str, ...]] = (),
                 unused_hf: Callable[[Any, str], bool] | None = None):
        self.family, self.rows, self.num_experts = family, tuple(rows), num_experts
        self._unused_hf = unused_hf
        self.groups = tuple(g for g in GROUPS if any(row.group == g for row in self.rows))
        if set(ignore) != set(self.groups):
            raise ValueError(f"{family}: ignore entries for {sorted(ignore)}, linear groups {self.groups}")
        self.ignore, self.never_quantized = {g: list(ignore[g]) for g in self.groups}, list(never_quantized)
        self._global = [r for r in self.rows if "{layer}" not in r.mcore]
        self._layer_blocks = self._blocks([r for r in self.rows if "{layer}" in r.mcore])
        self._mcore_patterns = [(_compiled(r.mcore), r) for r in self.rows]
        # the HF-side questions name a layer's tensors under any scope (`_scoped`); every template as a tensor name,
        # and (a `.weight`) as its linear's name
        self._hf_patterns = [(_compiled(_scoped(t)), _compiled(_linear(_scoped(t))) if t.endswith(_WEIGHT) else None,
                              r, i) for r in self.rows for i, t in enumerate(r.hf)]
        self._group_patterns = {g: re.compile("^(?:" + "|".join(
            _pattern(_linear(_scoped(t)), named=False) for r in self.rows if r.group == g for t in r.hf)
            + r")(?:\.weight)?$") for g in self.groups}
        # transformers' fused experts: (its module, its tensor holding a row's HF linears, the row)
        self._fused_experts = [(_compiled(self._experts_module(_scoped(r.hf[0]))),
                                _compiled(self._experts_module(_scoped(r.hf[0])) + "." + r.fused_as), r)
                               for r in self.rows if r.fused_as]
        self._load_together = [(tuple(map(_scoped, group)), [_compiled(_scoped(t)) for t in group])
                               for group in load_together]
        self._leaf_layout = {}
        for r in self.rows:
            layout = dataclasses.replace(r.layout, expert=False)
            if self._leaf_layout.setdefault(_leaf(r.mcore), layout) != layout:
                raise ValueError(f"{family}: rows ending in {_leaf(r.mcore)!r} disagree on their layout")

    @staticmethod
    def _blocks(rows):
        """Layer rows in table order, each run of per-expert rows one block (enumerated expert by expert)."""
        blocks = []
        for r in rows:
            expert = "{expert}" in r.mcore
            if expert and blocks and blocks[-1][0]:
                blocks[-1][1].append(r)
            else:
                blocks.append((expert, [r]))
        return blocks

    @staticmethod
    def _experts_module(template: str) -> str:
        return template.split(".{expert}.")[0]

    # ---------------------------------------------------------------- what a config has
    def _entries(self, hf_config) -> Iterator[tuple[StateDictMapping, dict]]:
        """(row, wildcard values) of every tensor of `hf_config`, in checkpoint order: the model-wide rows, then
        layer by layer its rows in table order (the routed experts expert by expert)."""
        for r in self._global:
            if r.exists(hf_config, None):
                yield r, {}
        for layer in range(hf_config.num_hidden_layers):
            for expert, block in self._layer_blocks:
                rows = [r for r in block if r.exists(hf_config, layer)]
                for e in (range(self.num_experts(hf_config)) if expert and rows else [None]):
                    for r in rows:
                        yield r, {"layer": layer} if e is None else {"layer": layer, "expert": e}

    def expected_hf_shapes(self, hf_config) -> dict[str, tuple[int, ...]]:
        """Every tensor name of the family's HF checkpoint (what save_pretrained writes) with its shape."""
        return {t.format(**w): shape for r, w in self._entries(hf_config)
                for t, shape in zip(r.hf, r.hf_shapes(hf_config))}

    def expected_mcore_shapes(self, hf_config) -> dict[str, tuple[int, ...]]:
        """Every full (unsharded, global expert id) mcore tensor name with its shape: the HF shapes through
        `hf_to_mcore` on meta tensors."""
        meta = {n: torch.empty(s, device="meta") for n, s in self.expected_hf_shapes(hf_config).items()}
        return {n: tuple(t.shape) for n, t in self.hf_to_mcore(hf_config, meta, validate=False).items()}

    def linear_names(self, hf_config) -> list[str]:
        """The model's linears as the engines name them (HF names without `.weight`; the router and lm_head
        too, not the token embedding)."""
        return [_linear(t.format(**w)) for r, w in self._entries(hf_config) if not r.embedding
                for t, shape in zip(r.hf, r.hf_shapes(hf_config)) if t.endswith(_WEIGHT) and len(shape) == 2]

    def representative_linears(self, hf_config) -> dict[str, str]:
        """One linear (no `.weight`) of each quantization group the config has: what a process that imports no
        family asks a checkpoint's ignore list about (vllm_server)."""
        out = {}
        for name in self.linear_names(hf_config):
            group = self.linear_group(name)
            if group is not None:
                out.setdefault(group, name)
        return out

    # ---------------------------------------------------------------- both directions
    def _mcore_row(self, mcore_name: str) -> tuple[StateDictMapping, dict]:
        for pattern, row in self._mcore_patterns:
            match = pattern.match(mcore_name)
            if match:
                return row, match.groupdict()
        raise WeightMappingError(f"no HF name for mcore parameter {mcore_name!r}")

    def hf_names(self, mcore_name: str) -> list[str]:
        """HF names of the tensors one mcore tensor becomes, in split order (qkv -> q, k, v; fc1 -> gate, up).
        Expert ids are copied as they are (global in a full state; any id answers the scope question); names are
        answered whatever a config has (a dense layer's MLP of a family whose build has none: a scope asks)."""
        row, wild = self._mcore_row(mcore_name)
        return [t.format(**wild) for t in row.hf]

    def hf_linear_name(self, mcore_module: str) -> str | None:
        """The HF linear (first of a fused one) that megatron module `mcore_module` computes, or None when it is
        none of the family's parameter owners; what a quantization scope is asked about."""
        try:
            return self.hf_names(mcore_module + _WEIGHT)[0]
        except WeightMappingError:
            return None

    def unused_hf_tensor(self, hf_config, name: str) -> bool:
        """Whether checkpoint tensor `name` is one the model leaves unread (the family's `unused_hf`)."""
        return self._unused_hf is not None and self._unused_hf(hf_config, name)

    def used_hf_state(self, hf_config, hf_state: Mapping[str, Any]) -> dict[str, Any]:
        """`hf_state` (tensors, or shapes) without what the model leaves unread: what every HF-side check sees."""
        return {n: t for n, t in hf_state.items() if not self.unused_hf_tensor(hf_config, n)}

    def hf_to_mcore(self, hf_config, hf_state: Mapping[str, torch.Tensor], *, validate: bool = True
                    ) -> dict[str, torch.Tensor]:
        """HF checkpoint tensors -> full mcore state (global expert ids). Tensors are not copied when 1:1; tensors
        the model leaves unread (`unused_hf_tensor`) are not checked and not mapped."""
        if validate:
            validate_state(self.used_hf_state(hf_config, hf_state), self.expected_hf_shapes(hf_config),
                           "HF checkpoint")
        return {r.mcore.format(**w): r.join(hf_config, [hf_state[t.format(**w)] for t in r.hf])
                for r, w in self._entries(hf_config)}

    def from_hf(self, hf_config, mcore_name: str, tensors: Sequence[torch.Tensor], *,
                query_groups: int | None = None) -> torch.Tensor:
        """`hf_to_mcore` for one tensor: its mcore tensor from its HF tensors in `hf_names` order. Row slices give
        the matching slice (a tensor-parallel slice of linear_qkv: q / k / v holding `query_groups` whole groups)."""
        return self._mcore_row(mcore_name)[0].join(hf_config, tensors, query_groups)

    def to_hf(self, hf_config, mcore_name: str, parts: Mapping[str, torch.Tensor], shape
              ) -> list[tuple[str, dict[str, torch.Tensor], tuple[int, ...]]]:
        """(HF name, parts, weight shape) of each HF tensor one full mcore tensor becomes. `parts` are its tensors
        in any encoding whose rows follow the weight's rows (the weight; int4 packed codes and group scales; fp8
        codes and block scales): fused qkv rows are de-interleaved per head, fc1 cut into gate / up, alike."""
        row, wild = self._mcore_row(mcore_name)
        return [(t.format(**wild), piece, piece_shape)
                for t, (piece, piece_shape) in zip(row.hf, row.split(hf_config, parts, shape))]

    def mcore_to_hf(self, hf_config, mcore_state: Mapping[str, torch.Tensor], *, validate: bool = True
                    ) -> dict[str, torch.Tensor]:
        """Full mcore state (global expert ids) -> HF checkpoint tensors. Exact inverse of hf_to_mcore."""
        if validate:
            validate_state(mcore_state, self.expected_mcore_shapes(hf_config), "mcore state")
        out = {}
        for name, tensor in mcore_state.items():
            for hf_name, parts, _ in self.to_hf(hf_config, name, {"weight": tensor}, tuple(tensor.shape)):
                out[hf_name] = parts["weight"]
        return out

    # ---------------------------------------------------------------- layout and quantization names
    @staticmethod
    def is_expert_param(mcore_name: str) -> bool:
        """A routed-expert parameter or module of megatron's MoE layer (local, global or grouped-GEMM naming;
        shared experts are `mlp.shared_experts` and do not count): split over expert-TP x EP, not TP."""
        return _MC_EXPERTS in f".{mcore_name}"

    def param_layout(self, mcore_name: str) -> ParamLayout:
        """How full megatron tensor `mcore_name` splits over TP (expert-TP for routed experts): the layout of the
        rows whose megatron name ends alike (grouped-GEMM `linear_fc1.weight<e>` as `linear_fc1.weight`); what no
        row names (norms aside, none) is replicated."""
        leaf = _leaf(_GROUPED_WEIGHT.sub(_WEIGHT, mcore_name))
        return dataclasses.replace(self._leaf_layout.get(leaf, REPLICATED), expert=self.is_expert_param(mcore_name))

    def linear_group(self, hf_name: str) -> str | None:
        """"experts" / "attention" / "dense_mlp" for an HF linear name (with or without `.weight`), None for
        everything else (router, norms, embeddings, lm_head, the linears a family keeps bf16)."""
        return next((g for g, pattern in self._group_patterns.items() if pattern.match(hf_name)), None)

    def fused_linear_group(self, hf_name: str) -> tuple[str, tuple[str, ...]] | None:
        """(group key, HF names of every linear in it) of a linear an engine fuses with others into one that
        megatron holds as one weight too (q/k/v_proj -> linear_qkv; gate/up_proj -> linear_fc1), so a scale over
        the whole tensor spans them all; None for the others."""
        suffix = _WEIGHT if hf_name.endswith(_WEIGHT) else ""
        for tensor, linear, row, _ in self._hf_patterns:
            match = (tensor if suffix else linear).match(hf_name) if linear else None
            if match and len(row.hf) > 1:
                wild = match.groupdict()
                members = tuple(_linear(_scoped(t)).format(**wild) + suffix for t in row.hf)
                base = _linear(_scoped(row.hf[0])).rsplit(".", 1)[0].format(**wild)
                tags = "".join(_linear(t).rsplit(".", 1)[1].removesuffix("_proj") for t in row.hf)
                return f"{base}.{tags}", members
        return None

    def compressed_tensors_ignore(self, quantized_groups: tuple[str, ...]) -> list[str]:
        """The compressed-tensors ``ignore`` list that leaves exactly the linears of `quantized_groups` quantized:
        what the family never quantizes, plus the entries of every group not asked for."""
        unknown = set(quantized_groups) - set(self.groups)
        if unknown:
            raise ValueError(f"unknown {self.family} linear group(s) {sorted(unknown)}; groups: {self.groups}")
        return list(self.never_quantized) + [e for g in self.groups if g not in quantized_groups for e in self.ignore[g]]

    def engine_load_group(self, engine_name: str) -> tuple[str, ...] | None:
        """Every engine tensor name that must arrive in the same update call as `engine_name` (`load_together`),
        None for a tensor an engine loads alone."""
        for group, patterns in self._load_together:
            match = next((m for m in (p.match(engine_name) for p in patterns) if m), None)
            if match:
                return tuple(t.format(**match.groupdict()) for t in group)
        return None

    # ---------------------------------------------------------------- transformers' in-memory layout
    def module_of(self, hf_name: str) -> ModuleSlot | None:
        """Which transformers module holds checkpoint tensor or linear `hf_name` (a linear: its name without
        `.weight`), and how: a routed expert's linear lives in the fused ``mlp.experts`` module (rows of its
        `fused_as` tensor at the expert's index); every other in its own module. None for a name of no row."""
        for tensor, linear, row, i in self._hf_patterns:
            match = tensor.match(hf_name)
            is_linear = match is None
            match = match or (linear.match(hf_name) if linear else None)
            if match is None:
                continue
            if row.fused_as:
                wild = match.groupdict()
                return ModuleSlot(self._experts_module(_scoped(row.hf[i])).format(**wild), row.fused_as,
                                  int(wild["expert"]), i, len(row.hf))
            return ModuleSlot(hf_name) if is_linear else ModuleSlot(*hf_name.rsplit(".", 1))
        return None

    def expert_gemms(self, experts_module: str, expert: int) -> tuple[tuple[str, tuple[str, ...]], ...]:
        """(tensor of the fused experts module, the HF linears of expert `expert` it holds in row order) of each
        of an expert's GEMMs, in forward order (gate_up_proj: gate, up; down_proj: down)."""
        out = []
        for module, _, row in self._fused_experts:
            match = module.match(experts_module)
            if match:
                wild = dict(match.groupdict(), expert=expert)
                out.append((row.fused_as, tuple(_linear(_scoped(t)).format(**wild) for t in row.hf)))
        if not out:
            raise WeightMappingError(f"{experts_module!r} is no fused experts module of {self.family}")
        return tuple(out)

    def transformers_tensor(self, state: Mapping[str, torch.Tensor], hf_name: str) -> torch.Tensor | None:
        """The tensor of a transformers state (`state_dict()` / `named_parameters()`) that checkpoint name
        `hf_name` lives in: a view of the fused experts tensor for a per-expert name. None when it has none."""
        slot = self.module_of(hf_name)
        if slot is None or not slot.fused_experts:
            return state.get(hf_name)
        fused = state.get(f"{slot.module}.{slot.tensor}")
        if fused is None or slot.expert >= fused.shape[0]:
            return None
        return slot.view(fused)

    def hf_state_from_model(self, model) -> dict[str, torch.Tensor]:
        """Checkpoint-named tensors (views, detached) of a transformers model (its persistent buffers included),
        the fused experts split per expert."""
        out = {}
        for name, tensor in model.state_dict().items():
            row, wild = self._fused_tensor_row(name)
            if row is None:
                out[name] = tensor.detach()
                continue
            for e in range(tensor.shape[0]):
                pieces = torch.chunk(tensor[e].detach(), len(row.hf), dim=0)
                out.update({_scoped(t).format(**wild, expert=e): piece for t, piece in zip(row.hf, pieces)})
        return out

    def _fused_tensor_row(self, transformers_name: str) -> tuple[StateDictMapping | None, dict]:
        """The routed-expert row whose HF tensors fused experts tensor `transformers_name` holds, with its layer."""
        for _, pattern, row in self._fused_experts:
            match = pattern.match(transformers_name)
            if match:
                return row, match.groupdict()
        return None, {}

    @torch.no_grad()
    def load_hf_state_into_model(self, model, hf_state: Mapping[str, torch.Tensor]) -> None:
        """Copy checkpoint-named tensors into a transformers model (fused or per-expert layout), after checking
        them against the config's expected shapes."""
        validate_state(hf_state, self.expected_hf_shapes(model.config), "HF state")
        state = model.state_dict()
        for name, tensor in hf_state.items():
            self.transformers_tensor(state, name).copy_(tensor)

    # ---------------------------------------------------------------- the family's adapter module
    ADAPTER_API = ("hf_to_mcore", "mcore_to_hf", "to_hf", "from_hf", "hf_names", "expected_hf_shapes",
                   "expected_mcore_shapes", "hf_linear_name", "is_expert_param", "param_layout", "linear_group",
                   "fused_linear_group", "compressed_tensors_ignore", "engine_load_group", "module_of", "expert_gemms",
                   "linear_names", "representative_linears", "transformers_tensor",
                   "hf_state_from_model", "load_hf_state_into_model", "unused_hf_tensor", "used_hf_state")

    def bind(self, namespace: dict) -> None:
        """Make a family's ``state_dict_adapter`` module answer as this naming (`ModelFamily.adapter`): each name of
        `ADAPTER_API` bound once (``adapter.hf_to_mcore = NAMING.hf_to_mcore``), with validate_state and
        WeightMappingError beside them."""
        namespace.update({name: getattr(self, name) for name in self.ADAPTER_API})
        namespace.update(validate_state=validate_state, WeightMappingError=WeightMappingError)
