from setuptools import find_packages, setup

setup(
    name="fmoe",
    version="0.1.0",
    description="Mixture-of-Experts training for PyTorch: grouped GEMMs in Triton, expert parallelism, "
                "FasterMoE shadowing; pure Python, FastMoE-compatible",
    long_description=open("README.md").read() if __import__("os").path.exists("README.md") else "",
    long_description_content_type="text/markdown",
    packages=find_packages(include=["fmoe", "fmoe.*"]),
    python_requires=">=3.9",
    # The floors are the oldest releases `make test-compat` runs (torch 2.4.1 with its triton 3.0.0,
    # numpy 1.26.4, transformers 5.0.0, pytest 8.0.0); README "Requirements" says which feature needs more.
    install_requires=["torch>=2.4", "numpy>=1.26", "tqdm", "matplotlib", "triton>=3.0; platform_system == \"Linux\""],
    extras_require={
        "triton": ["triton>=3.0"],
        "test": ["pytest>=8", "pytest-timeout", "triton>=3.0", "deepspeed==0.19.8", "transformers==5.24.0",
                 "megatron-core==0.16.1", "accelerate>=1.1.0", "tensorboard", "wandb"],
        "deepspeed": ["deepspeed==0.19.8"],
        "hf": ["transformers>=5,<6"],
        "megatron": ["megatron-core==0.16.1"],
        # fmoe.integrations.torchtitan; flash-linear-attention for torchtitan's Qwen3.5 (its linear attention).
        # Its datasets pin conflicts with the test venv's constraints: `make test-torchtitan` has a venv of its own.
        "torchtitan": ["torchtitan==0.3.0", "flash-linear-attention==0.6.0"],
        "bench": ["triton>=3.0"],
        # `make docs` (and `make test`, which builds the site); constraints.txt pins the versions CI builds with.
        "docs": ["mkdocs>=1.6,<2", "mkdocs-material>=9.5", "mkdocstrings[python]>=1.0", "mkdocstrings-python>=2.0"],
    },
    entry_points={"console_scripts": ["fmoe=fmoe.app.cli:main"]},
)
