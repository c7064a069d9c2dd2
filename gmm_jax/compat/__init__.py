"""Facades with other libraries' APIs, names and semantics: the seeds' `onednn` (grouped
memory + matmul) and `ascend` (aclnnGroupedMatmul), and the call sites users already have:
`megablox` (jax's Pallas TPU gmm/tgmm/ops.gmm) and `tokamax` (ragged_dot). Import them as
submodules (``from gmm_jax.compat import megablox``)."""
