"""Computes the package list; all other metadata lives in pyproject.toml."""

from setuptools import find_packages, setup

# `pallas/` is installed as `gmm_jax.pallas` (package-dir mapping in pyproject.toml), so its
# subfolders are found relative to it and renamed under that prefix.
_PALLAS = ["gmm_jax.pallas"] + ["gmm_jax.pallas." + name for name in find_packages("pallas")]

setup(packages=find_packages(include=["gmm_jax", "gmm_jax.*"]) + _PALLAS)
