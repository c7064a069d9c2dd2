"""Pallas TPU kernels of gmm_jax (Mosaic), installed as ``gmm_jax.pallas.tpu``."""

from gmm_jax.pallas.tpu.gmm import FEATURES as FEATURES
from gmm_jax.pallas.tpu.gmm import check_operands as check_operands
from gmm_jax.pallas.tpu.gmm import default_tiling as default_tiling
from gmm_jax.pallas.tpu.gmm import gmm_tpu as gmm_tpu

__all__ = ["FEATURES", "check_operands", "default_tiling", "gmm_tpu"]
