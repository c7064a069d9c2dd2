"""How many bytes the host-side cost models (`cost_models`) count as read from HBM.

* `L2`: the GPU's L2 as an LRU cache of whole tiles, filled by waves of one program per SM
  (`cost_models.triton_static_cost`).
* `block_bytes`, `dma_bytes`: the blocks a TPU grid fetches when their index changes from
  one step to the next (`cost_models.tpu_static_cost`).
"""

from __future__ import annotations

import collections

import numpy as np


class L2:
  """An LRU cache of whole tiles: counts the bytes that miss (read from HBM).

  Programs run in waves of `num_sms` (one 8-warp program per SM); the programs of a wave
  stream K in step, so a tile they share is read once per wave however long it is. Across
  waves a tile is reused only if it is still cached.
  """

  def __init__(self, capacity: int, num_sms: int):
    self.capacity, self.num_sms, self.used, self.missed = capacity, num_sms, 0, 0
    self.lines = collections.OrderedDict()
    self.wave, self.programs = {}, 0

  def read(self, key, size: int):
    self.wave.setdefault(key, size)

  def program_done(self):
    self.programs += 1
    if self.programs % self.num_sms == 0:
      self.flush()

  def flush(self):
    for key, size in self.wave.items():
      if key in self.lines:
        self.lines.move_to_end(key)
        continue
      self.missed += size
      self.lines[key] = size
      self.used += size
    while self.used > self.capacity:
      _, evicted = self.lines.popitem(last=False)
      self.used -= evicted
    self.wave = {}


def block_bytes(index, tile: int, dim: int) -> np.ndarray:
  """Elements of blocks `index` of `tile` along a dim of `dim` (the edge block is short)."""
  return np.clip(dim - np.asarray(index) * tile, 0, tile)


def dma_bytes(keys: np.ndarray, sizes: np.ndarray) -> int:
  """Bytes fetched along a sequence of grid steps: a block is fetched when its index
  (a row of `keys`) differs from the previous step's."""
  if keys.shape[0] == 0:
    return 0
  changed = np.ones(keys.shape[0], bool)
  changed[1:] = np.any(keys[1:] != keys[:-1], axis=1)
  return int(np.sum(sizes[changed]))
