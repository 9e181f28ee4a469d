"""megatron-qarl: rollout-aligned quantization-aware RL (QaRL + TBPO) on megatron-core."""
from setuptools import find_packages, setup

# Two tested stacks share these requirements; each installs with its own exact pins:
#   CPU/CI (Python 3.11, torch 2.13.0 CPU wheel): requirements/cpu.txt, a constraints file for launch/env.sh;
#   GPU (Python 3.12, torch 2.14.1 CUDA 13, SGLang 0.5.23): requirements/gpu.txt = this + the `gpu` extra,
#   then TransformerEngine's PyTorch extension from source (requirements/gpu-te.txt, README "GPU install").
# torch and numpy are ranges because the two stacks differ there (tests/test_requirements.py checks that
# both files satisfy every line below and that the `gpu` extra matches requirements/gpu.txt).
INSTALL_REQUIRES = [
    "torch>=2.13,<2.15",  # CPU 2.13.0; GPU 2.14.1 (sglang 0.5.23 pins it)
    "megatron-core==0.16.1",
    "psutil==7.2.2",  # undeclared by megatron-core; dist_checkpointing saves hang without it
    "numpy>=2.3,<2.5",  # CPU 2.4.6; GPU 2.3.5 (sglang's mistral_common needs numpy<2.4 on Python <= 3.12)
    # transformers 5.19.0 / compressed-tensors 0.18.0 are also what SGLang 0.5.23 pins.
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
    "pebble==5.2.3",  # reward workers: a process pool that kills and replaces a worker past its deadline
    "datasets==5.2.0",  # data.path may be a local HF `datasets` directory (save_to_disk)
    "tensorboard==2.21.0",  # logging.tensorboard: torch.utils.tensorboard's writer needs it
]

EXTRAS = {
    # pytest-xdist: launch/run_tests.sh runs the default suite on two workers (one test file per worker at a time)
    "test": ["pytest==9.2.0", "pytest-timeout==2.4.0", "pytest-xdist==3.8.0", "execnet==2.1.2"],
    # GPU-only pieces, never installed on CPU machines: the pins of requirements/gpu.txt beyond the shared
    # ones. TransformerEngine's PyTorch extension is not here: it is an sdist that must be compiled against
    # the installed torch, a second step (pip install --no-build-isolation -r requirements/gpu-te.txt).
    "gpu": [
        "torch==2.14.1",
        "numpy==2.3.5",
        "sglang==0.5.23",
        "torch_memory_saver==0.0.10",  # the colocated trainer's release / restore (megatron_qarl/memory_saver.py)
        "transformer-engine[core_cu13]==2.11.0",
        "wheel==0.48.0",  # imported by transformer-engine-torch's setup.py in the second step
        # launch/gpu_check.sh runs the GPU-marked tests: the [test] pins, so a GPU install has what it runs
        "pytest==9.2.0",
        "pytest-timeout==2.4.0",
    ],
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
