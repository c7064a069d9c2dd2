"""Pallas TPU kernels of gmm_jax (Mosaic), installed as ``gmm_jax.pallas.tpu``."""

from gmm_jax.pallas.tpu.mosaic_tpu import FEATURES as FEATURES
from gmm_jax.pallas.tpu.mosaic_tpu import check_operands as check_operands
from gmm_jax.pallas.tpu.mosaic_tpu import gmm_tpu as gmm_tpu
from gmm_jax.pallas.tpu.mosaic_tpu_plan import default_tiling as default_tiling

__all__ = ["FEATURES", "check_operands", "default_tiling", "gmm_tpu"]
