"""Reading the Triton IR (TTIR) of the Pallas Triton kernels in a program lowered for CUDA on
this CPU host: which pointer offsets are 32-bit, and into which kernel operand.

jax serializes each kernel's TTIR as MLIR bytecode into its custom call's backend config
("ir"); the Triton dialect registered in a fresh MLIR context reads it back. Where this
jax cannot (no Triton dialect in its jaxlib), `kernel_modules` raises `Unreadable`.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
from jax._src.lib.mlir import ir


class Unreadable(Exception):
  """This jax's lowered module holds no TTIR that can be read back here."""


class Offsets(NamedTuple):
  """One ``tt.addptr`` of a kernel: the kernel argument its pointer derives from, that
  argument's element count (the custom call's operand or result), and the offsets' bit
  width."""

  argument: int
  elements: int
  bits: int


def _walk(operation, visit):
  for region in operation.regions:
    for block in region.blocks:
      for op in block.operations:
        visit(op)
        _walk(op.operation, visit)


def kernel_modules(module) -> list[tuple[object, list[int]]]:
  """(TTIR module, element count of each kernel argument) of each Triton custom call in a
  lowered StableHLO module (``jax.stages.Lowered.compiler_ir()``)."""
  try:  # jaxlib's Triton dialect: an optional part of it
    from jax._src.lib import triton
    register = triton.dialect.register_dialect
  except (ImportError, AttributeError) as err:
    raise Unreadable(f"no Triton dialect in this jaxlib: {err}") from None
  calls = []

  def visit(op):
    if op.operation.name == "stablehlo.custom_call":
      calls.append(op.operation)

  _walk(module.operation, visit)
  found = []
  for call in calls:
    if "mhlo.backend_config" not in call.attributes:
      continue
    config = ir.DictAttr(call.attributes["mhlo.backend_config"])
    if "ir" not in config:
      continue
    data = ir.StringAttr(config["ir"]).value_bytes
    context = ir.Context()
    register(context)
    context.allow_unregistered_dialects = True
    with context:
      ttir = ir.Module.parse(data)
    shapes = [ir.RankedTensorType(v.type).shape for v in call.operands]
    shapes += [ir.RankedTensorType(r.type).shape for r in call.results]
    found.append((ttir, [math.prod(shape) for shape in shapes]))
  if not found:
    raise Unreadable("no Triton custom call with a readable 'ir' in the lowered module")
  return found


_THROUGH = ("tt.splat", "tt.broadcast", "tt.expand_dims", "tt.addptr", "tt.reshape")


def _argument(value) -> int:
  """The entry-block argument a pointer value derives from (through splats, broadcasts and
  earlier pointer additions)."""
  while True:
    if isinstance(value, ir.BlockArgument):
      return value.arg_number
    owner = value.owner
    name = owner.name if hasattr(owner, "name") else owner.operation.name
    if name not in _THROUGH:
      raise AssertionError(f"a pointer derived through {name}: extend _THROUGH")
    value = owner.operands[0]


def offsets(fn, *args, lowering) -> list[Offsets]:
  """Every pointer addition of the Triton kernels of ``jax.jit(fn)(*args)`` lowered for CUDA
  by `lowering` (a context manager, `lowering.gpu_model`)."""
  with lowering():
    lowered = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
  result = []
  for ttir, elements in kernel_modules(lowered.compiler_ir()):
    additions = []

    def visit(op, additions=additions):
      if op.operation.name == "tt.addptr":
        additions.append(op.operation)

    _walk(ttir.operation, visit)
    for addition in additions:
      offset_type = addition.operands[1].type
      try:  # a tensor of offsets, or a scalar one
        offset_type = ir.RankedTensorType(offset_type).element_type
      except ValueError:
        pass
      argument = _argument(addition.operands[0])
      result.append(Offsets(argument, elements[argument],
                            ir.IntegerType(offset_type).width))
  return result


class Dot(NamedTuple):
  """One ``tt.dot`` of a kernel: its operands' element types (as Triton names them:
  "f8E4M3FN", "f8E5M2", "bf16", ...) and its ``maxNumImpreciseAcc`` (0 when absent; Triton
  takes fp8 with an f32 accumulator to Hopper's wgmma only from 32 up)."""

  lhs: str
  rhs: str
  max_num_imprecise_acc: int


def dots(fn, *args, lowering) -> list[Dot]:
  """Every ``tt.dot`` of the Triton kernels of ``jax.jit(fn)(*args)`` lowered for CUDA by
  `lowering` (as in `offsets`)."""
  with lowering():
    lowered = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
  result = []
  for ttir, _ in kernel_modules(lowered.compiler_ir()):
    found = []

    def visit(op, found=found):
      if op.operation.name == "tt.dot":
        found.append(op.operation)

    _walk(ttir.operation, visit)
    for dot in found:
      lhs, rhs = (str(ir.RankedTensorType(v.type).element_type) for v in dot.operands[:2])
      limit = 0
      if "maxNumImpreciseAcc" in dot.attributes:
        limit = ir.IntegerAttr(dot.attributes["maxNumImpreciseAcc"]).value
      result.append(Dot(lhs, rhs, limit))
  return result
