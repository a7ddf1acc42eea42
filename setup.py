"""Packaging: mesa_lite, with its Triton kernels shipped from kernels/ as mesa_lite.kernels."""

import re
from pathlib import Path

from setuptools import find_packages, setup

_here = Path(__file__).parent

# kernels/ and benchmarks/ live at the top of the repository but install inside mesa_lite, so
# there is no top-level `kernels` or `benchmarks` import after install (Hugging Face's `kernels`
# package, which transformers imports, keeps its name).
_INSIDE = {"mesa_lite.kernels": "kernels", "mesa_lite.benchmarks": "benchmarks"}


def _packages() -> list[str]:
    """Every package of the tree, found rather than listed: mesa_lite's and those _INSIDE it."""
    found = find_packages(include=["mesa_lite", "mesa_lite.*"])
    for name, folder in _INSIDE.items():
        found += [name + p[len(folder) :] for p in find_packages(include=[folder, f"{folder}.*"])]
    return sorted(found)


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
    packages=_packages(),  # tests/test_packaging.py checks the wheel and sdist against the tree
    package_dir=_INSIDE,
    install_requires=[
        # the tested range (README, .ci/run): a user's torch in it is kept
        "torch>=2.11,<2.16",
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
            # the Hugging Face integration's tests: CI runs 5.17 (the GPU image's) and the newest
            "transformers>=5.0",
            # the Hugging Face Trainer recipe's test: the Trainer cannot run without it
            "accelerate>=1.1",
            # the LoRA recipe's test (PEFT on a wrapped model, either order)
            "peft>=0.13",
            # tests/test_packaging.py builds the wheel with this environment's setuptools
            # (bdist_wheel built in from 70.1)
            "setuptools>=70.1",
        ],
        "bench": [
            "timm>=1.0",
            "torchvision",
            "tqdm",
            "matplotlib",
            "scikit-learn>=1.0",
            "transformers>=5.0",  # as in test
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
