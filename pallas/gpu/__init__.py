"""Pallas GPU kernels of gmm_jax (Triton backend), installed as ``gmm_jax.pallas.gpu``."""

from gmm_jax.pallas.gpu.triton import ATOMICS as ATOMICS
from gmm_jax.pallas.gpu.triton import FEATURES as FEATURES
from gmm_jax.pallas.gpu.triton import check_operands as check_operands
from gmm_jax.pallas.gpu.triton import default_tiling as default_tiling
from gmm_jax.pallas.gpu.triton import gmm_triton as gmm_triton

__all__ = ["ATOMICS", "FEATURES", "check_operands", "default_tiling", "gmm_triton"]
