"""megatron-qarl: rollout-aligned quantization-aware RL (QaRL + TBPO) on megatron-core."""
from setuptools import find_packages, setup

# Versions pinned to what was tested together on the CPU/CI stack (Python 3.11, torch 2.13.0 CPU).
# transformers 5.19.0 / compressed-tensors 0.18.0 are also what SGLang 0.5.23 accepts.
INSTALL_REQUIRES = [
    "torch==2.13.0",
    "megatron-core==0.16.1",
    "psutil==7.2.2",  # undeclared by megatron-core; dist_checkpointing saves hang without it
    "numpy==2.4.6",
    "transformers==5.19.0",
    "compressed-tensors==0.18.0",
    "safetensors==0.8.0",
    "omegaconf==2.4.0",
    "math-verify==0.9.0",
    "pyarrow==26.0.1",
    "matplotlib==3.11.2",
    "wandb==0.31.0",
    "tqdm==4.70.1",
    "rich==15.0.0",
    "accelerate==1.15.0",  # transformers needs it to load FP8 (fine-grained) checkpoints
]

EXTRAS = {
    # modelopt runs its quantizer plumbing on CPU: the test of the `modelopt` backend uses it.
    "test": ["pytest==9.2.0", "pytest-timeout==2.4.0", "nvidia-modelopt==0.47.0"],
    # GPU-only pieces: never installed on CPU machines (TransformerEngine does not even install there).
    "gpu": ["transformer-engine[pytorch]", "sglang==0.5.23", "nvidia-modelopt==0.47.0"],
}

setup(
    name="megatron-qarl",
    version="0.1.0",
    description="QaRL: rollout-aligned quantization-aware RL with TBPO on megatron-core",
    packages=find_packages(include=["megatron_qarl", "megatron_qarl.*", "conversion"]),
    python_requires=">=3.11",
    install_requires=INSTALL_REQUIRES,
    extras_require=EXTRAS,
    entry_points={
        "console_scripts": [
            "qarl-train=megatron_qarl.cli:train_main",
            "qarl-convert=megatron_qarl.cli:convert_main",
        ]
    },
)
