"""What SGLang 0.5.23 does with each low-bit format's in-place refit (the SGLang kind's `refits`) and the server
knobs a refit needs: the MoE runner backend and whether CUDA graphs stay on.

W4A16 (compressed-tensors WNA16 routed experts) needs SGLang's Marlin MoE path for refit:
``CompressedTensorsWNA16MoE.restore_weights_before_loading`` resizes the repacked parameters back
(layers/quantization/compressed_tensors/schemes/compressed_tensors_wNa16_moe.py:406-418), while the Triton
variant replaces the parameters without ``weight_loader`` after loading (:507-533), so its second refit
fails. ``auto`` selects that Triton path on SM100/SM103 (compressed_tensors.py:924-949); so for W4A16 the
backend is pinned to ``marlin`` (that branch then returns the Marlin method, compressed_tensors.py:949-950)
and anything else is refused.

CUDA graphs and W4A16 refit: every Marlin post-process allocates a NEW lock workspace
(``layer.workspace = marlin_make_workspace(...)``, compressed_tensors_wNa16_moe.py:403) that
``apply_weights`` hands to ``fused_marlin_moe`` (:494). Graphs captured at start-up keep the old,
freed pointer, and nothing in the update session re-captures them (the session's end only post-processes,
model_executor/model_runner_components/weight_updater.py:312-321; only ``update_weights_from_disk`` can
re-capture, :247-255). So ``cuda_graph="auto"`` turns CUDA graphs OFF for W4A16 (decode then runs eager:
kernel-launch bound, typically well under half the decode throughput at small batch sizes; large batches
lose less); ``cuda_graph="on"`` keeps them at the user's risk (hang or corruption after the first refit).
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from megatron_qarl.quant.schemes import NO_SCHEME, scheme_named
from megatron_qarl.rollout.engine_kind import RefitSupport


@dataclass(frozen=True)
class SGLangRefit(RefitSupport):
    """What SGLang does with one format's refit (SGLangKind.refits): RefitSupport plus the server's own knobs."""

    moe_backend: str | None = None  # the --moe-runner-backend its refit needs ('auto' is pinned to it)
    moe_backend_refusals: Mapping[str, str] = field(default_factory=dict)  # backend (or "*") -> why not
    cuda_graphs: bool = True  # what cuda_graph=auto means for this format
    why_no_cuda_graphs: str = ""

    def moe_backend_problem(self, backend: str) -> str | None:
        """Why the MoE runner `backend` cannot refit this format (None: it can)."""
        if self.moe_backend is None or backend in ("auto", self.moe_backend):
            return None
        why = self.moe_backend_refusals.get(backend) or self.moe_backend_refusals.get("*", "")
        return why.format(backend=backend, required=self.moe_backend)

    def resolve_moe_backend(self, backend: str) -> str:
        """The backend to launch with: 'auto' pinned to the one refit needs; others as given."""
        return self.moe_backend if self.moe_backend is not None and backend == "auto" else backend



# 2/3-bit pack-quantized: SGLang's compressed-tensors WNA16 MoE takes 4 and 8 bits only
_WNA16_BITS = ("SGLang 0.5.23's compressed-tensors WNA16 MoE takes 4 or 8 bits only (WNA16_SUPPORTED_BITS, "
               "compressed_tensors_wNa16_moe.py:83-92)")

# Format (a scheme's format_name) -> what SGLang does with its refit; a format missing here is refused by the kind
# (EngineKind.refit_support). The module docstring has the W4A16 evidence.
# NVFP4: SGLang serves it with CompressedTensorsW4A16Nvfp4MoE (FP4 Marlin, sm80+) and CompressedTensorsW4A16Fp4;
# both delete the checkpoint parameters at process_weights_after_loading (MoE: w13/w2_weight_packed ->
# w13/w2_weight repacked for Marlin, the global scales deleted for an inverted weight_scale_2, the group scales
# replaced by Marlin-permuted ones, compressed_tensors_w4a16_nvfp4_moe.py:178-214, 231, marlin_utils_fp4.py:
# 530-572; dense: compressed_tensors_w4a16_nvfp4.py:239-246) and keep a no-op restore_weights_before_loading
# (MoE: the scheme base's, compressed_tensors_scheme.py:102-103; dense: CompressedTensorsLinearMethod defines
# none, so base_config.py:49-54's; the INT4 path refits because CompressedTensorsWNA16MoE resizes its own
# parameters back, compressed_tensors_wNa16_moe.py:406-418, which the update session's begin calls,
# weight_updater.py:312-315). A second weight update has nothing to load into: no in-place refit. Restoring
# would mean re-creating the deleted parameters with FusedMoE's weight loaders inside the SGLang server process
# (a patch of SGLang, unverifiable without a GPU), so it is refused at config time
# (tests/contract/test_sglang_loader_nvfp4.py pins that SGLang still restores nothing).
SGLANG_REFITS: Mapping[str, SGLangRefit] = {
    "w4a16": SGLangRefit(
        scopes=("experts",),
        why_scopes="SGLang replaces dense W4A16 (attention) parameters at its Marlin repack, so they cannot be "
                   "refit in place between steps",
        moe_backend="marlin",
        moe_backend_refusals={
            "triton": "SGLang's triton WNA16 MoE (CompressedTensorsWNA16TritonMoE) converts the weights to its own "
                      "uint8 layout in new Parameters without weight_loader after loading, so in-place refit fails",
            "*": "only 'marlin' (the Marlin WNA16 MoE path, the one that restores its packed weights before a "
                 "reload; 'auto' is pinned to it) supports compressed-tensors W4A16 refit, not {backend!r}",
        },
        cuda_graphs=False,
        why_no_cuda_graphs="the Marlin MoE workspace is reallocated at every refit while captured graphs keep the "
                           "old pointer"),
    "fp8": SGLangRefit(),  # block FP8 (SGLang's block-FP8 methods): in place, every scope of the scheme
    "nvfp4": SGLangRefit(
        refit=False,
        why_not="SGLang 0.5.23's NVFP4 methods (CompressedTensorsW4A16Nvfp4MoE, CompressedTensorsW4A16Fp4) "
                "delete the checkpoint parameters at process_weights_after_loading for Marlin's repacked ones "
                "and restore none before the next load, so a second weight update has nothing to load into"),
    "w3a16": SGLangRefit(refit=False, why_not=_WNA16_BITS),
    "w2a16": SGLangRefit(refit=False, why_not=_WNA16_BITS),
}


def refit_knobs(quant_scheme: str) -> SGLangRefit:
    """The server knobs the refit of `quant_scheme` (a quant.scheme value) needs, for the engine config and its
    launch; bf16, and a format SGLang does not list (the kind refuses it at config time), need none."""
    if quant_scheme == NO_SCHEME:
        return SGLangRefit()
    return SGLANG_REFITS.get(scheme_named(quant_scheme).format_name, SGLangRefit(refit=False))


def resolve_moe_runner_backend(quant_scheme: str, moe_runner_backend: str) -> str:
    """The ``--moe-runner-backend`` to launch with; refuses configurations whose in-place refit SGLang
    cannot do. A scheme that needs one backend (W4A16: Marlin, see the module doc) gets ``auto`` pinned to
    it (``auto`` is Triton on SM100, whose refit breaks); that backend as given; anything else refused."""
    support = refit_knobs(quant_scheme)
    why = support.moe_backend_problem(moe_runner_backend)
    if why:
        raise ValueError(f"{quant_scheme} refit with moe_runner_backend={moe_runner_backend!r} is not supported: "
                         f"{why}. Use moe_runner_backend={support.moe_backend!r} (or 'auto', which is pinned to "
                         f"{support.moe_backend} for {quant_scheme}).")
    return support.resolve_moe_backend(moe_runner_backend)


def check_refit_backend(quant_scheme: str, moe_runner_backend: str) -> None:
    """Raise ValueError for a configuration whose in-place refit SGLang cannot do."""
    resolve_moe_runner_backend(quant_scheme, moe_runner_backend)
