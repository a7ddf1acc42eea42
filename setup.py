"""Packaging: mesa_lite, with its Triton kernels shipped from kernels/ as mesa_lite.kernels."""

import re
from pathlib import Path

from setuptools import setup

_here = Path(__file__).parent
_version = re.search(
    r'^__version__ = "([^"]+)"', (_here / "mesa_lite" / "__init__.py").read_text(), re.M
).group(1)

setup(
    name="mesa_lite",
    version=_version,
    description="Keep training activations for backward in 8 bits: less memory, same forward.",
    long_description=(_here / "README.md").read_text(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=["mesa_lite", "mesa_lite.integrations", "mesa_lite.kernels", "mesa_lite.benchmarks"],
    # kernels/ and benchmarks/ live at the top of the repository but install inside mesa_lite,
    # so there is no top-level `kernels` or `benchmarks` import after install.
    package_dir={"mesa_lite.kernels": "kernels", "mesa_lite.benchmarks": "benchmarks"},
    install_requires=[
        "torch>=2.11",  # the oldest tested (README)
        # Triton ships with torch's Linux builds; elsewhere the PyTorch reference runs.
        "triton>=3.0; platform_system == 'Linux' and platform_machine == 'x86_64'",
    ],
    extras_require={
        "test": [
            "pytest>=7",
            "hypothesis>=6",
            "timm>=1.0",
            "torchvision",
            "scikit-learn>=1.0",
            # the benchmark scripts' tests draw their charts and progress bars
            "matplotlib",
            "tqdm",
            # the Hugging Face integration's tests: 5.17 is the GPU image's, 5.23 the newest
            # tested (newer releases are not)
            "transformers>=5.0,<5.24",
            # the Hugging Face Trainer recipe's test: the Trainer cannot run without it
            "accelerate>=1.1",
            # the LoRA recipe's test (PEFT on a wrapped model, either order)
            "peft>=0.13",
        ],
        "bench": [
            "timm>=1.0",
            "torchvision",
            "tqdm",
            "matplotlib",
            "scikit-learn>=1.0",
            # as in test: 5.17 is the GPU image's, 5.23 the newest tested
            "transformers>=5.0,<5.24",
        ],  # fmt: skip
        "dev": ["ruff>=0.4", "pytest>=7", "hypothesis>=6", "timm>=1.0", "torchvision"],
    },
    entry_points={
        "console_scripts": [
            # each benchmark script, installed: mesa-lite-deit-memory runs deit_memory.py
            *(
                f"mesa-lite-{name.replace('_', '-')}=mesa_lite.benchmarks.{name}:main"
                for name in (
                    "ablate",
                    "accuracy",
                    "budget",
                    "compile_check",
                    "compile_speed",
                    "coverage",
                    "deit_memory",
                    "grad_fidelity",
                    "kernels",
                    "llm_memory",
                    "overhead",
                    "peak_memory",
                    "profile_step",
                    "quant_bandwidth",
                    "quant_tuning",
                    "text_accuracy",
                    "train_deit",
                )
            ),  # fmt: skip
            # timm's own train.py with wrap applied (see the README)
            "mesa-lite-timm-train=mesa_lite.timm_train:main",
        ]
    },
)
