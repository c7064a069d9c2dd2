"""Parametrization grids whose default run keeps a covering subset.

A test parametrized over the product of several option lists repeats one check many times;
`covering` keeps, in the default run, a subset in which every value of every axis appears at
least once (the diagonal: case i takes value i mod len of each axis), and marks the other
cases `slow`, so `pytest -m slow` still runs the whole product. The default run stays a
check of every option value, on 2 cores in minutes.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest


def _id(value) -> str:
  if isinstance(value, str):
    return value
  if value is None or isinstance(value, (bool, int, float)):
    return str(value)
  if isinstance(value, (list, tuple)):
    return "_".join(map(_id, value))
  name = getattr(value, "__name__", None)
  if name is not None:
    return name
  try:
    return np.dtype(value).name
  except TypeError:
    return str(value)


def covering(*axes, keep=(), default=None):
  """`pytest.mark.parametrize` over the product of `axes`, the cases off the diagonal slow.

  Args:
    *axes: (argnames, values) pairs; argnames is a comma-separated string, and where it
      names several arguments each value is a tuple of them (or a `pytest.param`).
    keep: extra cases to keep in the default run, as tuples of value indices (one per
      axis).
    default: a predicate on such a tuple of indices that replaces the diagonal (cases for
      which it is true run by default).

  Returns:
    The parametrize mark: argnames of all axes in order, ids joined with "-".
  """
  names = [name.strip() for argnames, _ in axes for name in argnames.split(",")]
  sizes = [len(values) for _, values in axes]
  if default is None:
    kept = {tuple(i % size for size in sizes) for i in range(max(sizes))}
  else:
    kept = {index for index in itertools.product(*map(range, sizes)) if default(index)}
  kept |= set(keep)
  params = []
  for index in itertools.product(*(range(size) for size in sizes)):
    flat, ids = [], []
    marks = [] if index in kept else [pytest.mark.slow]
    for (argnames, values), i in zip(axes, index):
      value = values[i]
      if isinstance(value, type(pytest.param(None))):  # a pytest.param: its id and marks
        flat.extend(value.values)
        ids.append(value.id if value.id is not None else "-".join(map(_id, value.values)))
        marks.extend(value.marks)
        continue
      parts = value if "," in argnames else (value,)
      flat.extend(parts)
      ids.append("-".join(_id(part) for part in parts))
    params.append(pytest.param(*flat, marks=marks, id="-".join(ids)))
  return pytest.mark.parametrize(",".join(names), params)
