"""What the layers decide while a program is traced or lowered, collected inside a block:
each layer keeps a list of the open recorders, and `collecting` opens one for a ``with``
block (`gmm_jax.explain`, the tools and the tests read them).

Floor 0: imports nothing from gmm_jax.
"""

from __future__ import annotations

import contextlib


@contextlib.contextmanager
def collecting(recorders: list[list]):
  """Opens a recorder (a new list) on `recorders` for the block and yields it: every note
  the layer appends to each open recorder while the block runs lands in it."""
  found: list = []
  recorders.append(found)
  try:
    yield found
  finally:
    recorders.remove(found)
