"""The error of a malformed operand.

Floor 0: imports nothing from gmm_jax.
"""

from __future__ import annotations


class GmmShapeError(TypeError, ValueError):
  """An operand of the wrong shape, rank, dtype or type (the message names the shapes).

  jax raises TypeError for these (`jax.lax.ragged_dot` and `dot_general` check shapes and
  dtypes while tracing), so code written against jax catches TypeError; gmm_jax raised
  ValueError before. This class is both: either ``except`` catches it.
  """
