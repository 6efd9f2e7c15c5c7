"""hvdlite: pure-Python, Horovod-compatible data-parallel training (no compiler needed)."""
import os

from setuptools import find_packages, setup

here = os.path.dirname(os.path.abspath(__file__))
version = {}
with open(os.path.join(here, "hvdlite", "version.py")) as f:
    exec(f.read(), version)

with open(os.path.join(here, "README.md"), encoding="utf-8") as f:
    long_description = f.read()

setup(
    name="hvdlite",
    version=version["__version__"],
    description="Horovod-compatible data-parallel training in pure Python over MPI and NCCL",
    long_description=long_description,
    long_description_content_type="text/markdown",
    packages=find_packages(include=["hvdlite", "hvdlite.*"]),
    python_requires=">=3.9",
    install_requires=[
        "numpy>=1.22",
        "ml_dtypes>=0.3",   # bfloat16 arithmetic for numpy
        "mpi4py>=4.0",
        "cloudpickle>=2.0",   # hvdlite.run() sends functions (lambdas, notebook code) by value
        # A working MPI from PyPI (MPICH). Skip it with `pip install --no-deps` plus the other
        # requirements when you use a system MPI; see docs/install.md, "Using a system MPI".
        "mpich>=4.2; platform_system == 'Linux'",
    ],
    extras_require={
        # Pin torch yourself (e.g. torch==2.13.0 for the CPU wheel); an unpinned torch pulls CUDA.
        "torch": ["torch>=2.1"],
        "tensorflow": ["tensorflow-cpu>=2.16"],
        # hvdlite.jax (and Keras 3 on its JAX backend): jax arrays and pytrees, optax optimizers.
        "jax": ["jax>=0.4.30", "optax>=0.2"],
        # The GPU data path: CuPy (CUDA runtime, device arrays, kernels) and its NCCL binding.
        "nccl": ["cupy-cuda13x>=14", "nvidia-nccl-cu13"],
        "nccl-cuda12": ["cupy-cuda12x>=13", "nvidia-nccl-cu12"],
        "examples": ["scikit-learn>=1.2"],
        # hvdlite run --config-file: horovodrun's YAML configuration file.
        "yaml": ["pyyaml>=5.1"],
        # hvdlite.ray: RayExecutor and the Ray Train backend (HvdliteTrainer).
        "ray": ["ray[train]>=2.40"],
        # hvdlite.spark: run/run_elastic on barrier stages and the estimators (Parquet through
        # pyarrow; PySpark's pandas support stops short of pandas 3).
        "spark": ["pyspark>=4.0", "pyarrow>=14", "pandas>=2,<3", "cloudpickle>=3"],
        "test": ["pytest>=7", "pytest-timeout>=2", "scikit-learn>=1.2", "tqdm>=4", "pyyaml>=5.1"],
        # The documentation site (mkdocs.yml, docs/); tests/test_docs.py builds it in strict mode.
        "docs": ["mkdocs>=1.6", "mkdocs-material>=9.5", "mkdocstrings>=1.0",
                 "mkdocstrings-python>=2.0"],
    },
    entry_points={"console_scripts": ["hvdlite = hvdlite.runner.launch:main"]},
    classifiers=[
        "Programming Language :: Python :: 3",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
        "Operating System :: POSIX :: Linux",
    ],
)
