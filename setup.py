"""Packaging glue that pyproject.toml cannot express: `kernels/` installs as `decode_worker_kernels`."""
from setuptools import find_packages, setup

setup(
    packages=find_packages(include=["decode_worker", "decode_worker.*"]) + ["decode_worker_kernels"],
    package_dir={"decode_worker_kernels": "kernels"},
    package_data={"decode_worker_kernels": ["*.c", "*.h"]},  # the CPU kernels' source, compiled on first use
)
