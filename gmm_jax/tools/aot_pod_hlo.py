"""Reads a compiled training step's HLO text, for `gmm_jax.tools.aot_pod`.

The array shapes of a result type and their bytes, the collectives and the bytes they
produce (and those of all-gathers whose result is a whole expert weight), and the kernels'
custom calls."""

from __future__ import annotations

import math
import re

# The collectives counted, as XLA's HLO names them (their async forms end at "-done").
COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "ragged-all-to-all",
               "collective-permute")
# Substrings of the custom-call targets of each kind of kernel.
KERNEL_CALLS = {"tpu_custom_call": "tpu_custom_call", "triton": "triton",
                "mosaic_gpu": "mosaic_gpu"}
# The custom-call target of a `custom_partitioning` call in a lowered program.
CUSTOM_PARTITIONING = "CustomSPMDPartitioning"


_DTYPE_BYTES = {"pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "s16": 2, "u16": 2,
                "s32": 4, "u32": 4, "s64": 8, "u64": 8, "f16": 2, "bf16": 2, "f32": 4,
                "f64": 8, "c64": 8, "c128": 16}
_SHAPE = re.compile(r"\b([a-z]+[0-9]*[a-z0-9]*)\[([0-9,<=\s]*)\]")
# One instruction: "[ROOT] %name = <shape or tuple of shapes> opcode(" (the % is optional).
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(?P<shape>.*?)\s+"
                          r"(?P<op>[a-z][a-z0-9\-]*)\(")
_CUSTOM_CALL_TARGET = re.compile(r'custom_call_target="([^"]+)"')


def shapes(text: str) -> list[tuple[str, tuple[int, ...]]]:
  """The (dtype, dims) of every array shape in an HLO result type (a shape or a tuple);
  dynamic bounds (``<=8``) count at their bound."""
  found = []
  for dtype, dims in _SHAPE.findall(text):
    if dtype not in _DTYPE_BYTES and not dtype.startswith("f8"):
      continue
    found.append((dtype, tuple(int(d.replace("<=", "")) for d in dims.split(",")
                               if d.strip())))
  return found


def shape_bytes(dtype: str, dims: tuple[int, ...]) -> int:
  """Bytes of one array (4-bit types: half a byte an element, rounded up)."""
  return math.ceil(_DTYPE_BYTES.get(dtype, 1) * math.prod(dims))


def collectives(hlo: str) -> list[tuple[str, list[tuple[str, tuple[int, ...]]]]]:
  """(kind, result shapes) of each collective in an HLO module's text, in order. A
  synchronous collective counts at its instruction; an async one at its ``-done`` (whose
  result is the collective's result; the ``-start`` tuple also holds the operands)."""
  found = []
  for line in hlo.splitlines():
    match = _INSTRUCTION.match(line)
    if match is None:
      continue
    op = match.group("op")
    kind = op[:-len("-done")] if op.endswith("-done") else op
    if kind in COLLECTIVES:
      found.append((kind, shapes(match.group("shape"))))
  return found


def collective_bytes(hlo: str) -> dict[str, int]:
  """Result bytes per kind of collective (every kind of `COLLECTIVES`, 0 when absent)."""
  totals = dict.fromkeys(COLLECTIVES, 0)
  for kind, results in collectives(hlo):
    totals[kind] += sum(shape_bytes(dtype, dims) for dtype, dims in results)
  return totals


def _significant(dims) -> tuple[int, ...]:
  return tuple(sorted(d for d in dims if d != 1))


def weight_gather_bytes(hlo: str, weight_shapes) -> int:
  """Bytes of the all-gathers whose result is a whole expert weight: its dims (in any
  order: a gathered transpose counts; unit dims ignored) are those of one of
  `weight_shapes` (the global shapes of the expert kernels and their gate / up halves)."""
  wanted = {_significant(s) for s in weight_shapes}
  total = 0
  for kind, results in collectives(hlo):
    if kind != "all-gather":
      continue
    total += sum(shape_bytes(dtype, dims) for dtype, dims in results
                 if _significant(dims) in wanted)
  return total


def kernel_calls(hlo: str) -> dict[str, int]:
  """Custom calls per kind of kernel (`KERNEL_CALLS`; kinds absent are left out)."""
  counts: dict[str, int] = {}
  for target in _CUSTOM_CALL_TARGET.findall(hlo):
    for kind, marker in KERNEL_CALLS.items():
      if marker in target:
        counts[kind] = counts.get(kind, 0) + 1
  return counts
