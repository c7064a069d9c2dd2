"""The error of a malformed operand, and how messages name the values they reject.

Floor 0: imports nothing from gmm_jax.
"""

from __future__ import annotations

import numpy as np


class GmmShapeError(TypeError, ValueError):
  """An operand of the wrong shape, rank, dtype or type (the message names the shapes).

  jax raises TypeError for these (`jax.lax.ragged_dot` and `dot_general` check shapes and
  dtypes while tracing), so code written against jax catches TypeError; gmm_jax raised
  ValueError before. This class is both: either ``except`` catches it.
  """


def is_index(value) -> bool:
  """Whether `value` is a Python or numpy integer (not a bool): a size, an index, a count."""
  return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def describe(x) -> str:
  """How an error message names a value: ``dtype[shape]`` for an array or an abstract value
  (``float32[8,16]``, as jax prints types), its repr for anything else (a QArray's repr
  names its parts)."""
  if hasattr(x, "shape") and hasattr(x, "dtype") and not hasattr(x, "qtype"):
    return f"{np.dtype(x.dtype).name}[{','.join(str(d) for d in np.shape(x))}]"
  return repr(x)
