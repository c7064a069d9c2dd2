"""Facades with the seed APIs' names and semantics: `onednn` (grouped memory + matmul)
and `ascend` (aclnnGroupedMatmul)."""
