"""What the contract tests need to import SGLang's CPU-runnable modules beside CPU torch."""
import enum
import sys
import types


def stub_torchvision() -> None:
    """sglang.srt.configs imports multimodal helpers that import torchvision; PyPI's torchvision is a CUDA
    build that fails beside CPU torch. No contract test calls it: stub the three names it needs."""
    import transformers.utils.import_utils as iu

    iu.is_torchvision_available()  # cache "unavailable" for transformers before the stub exists
    if "torchvision" in sys.modules:
        return
    tv, tr, fn = (types.ModuleType(n) for n in ("torchvision", "torchvision.transforms", "torchvision.transforms.functional"))

    class InterpolationMode(enum.Enum):
        NEAREST = "nearest"
        BILINEAR = "bilinear"
        BICUBIC = "bicubic"

    fn.InterpolationMode = tr.InterpolationMode = InterpolationMode
    tr.functional, tv.transforms = fn, tr
    sys.modules.update({"torchvision": tv, "torchvision.transforms": tr, "torchvision.transforms.functional": fn})
