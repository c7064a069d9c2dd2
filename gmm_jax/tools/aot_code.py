"""Reads what a deviceless GPU compile says about its kernels, for `gmm_jax.tools.aot`.

The compile's stdout and stderr (XLA's C++ logging, ptxas's reports, the Mosaic GPU PTX)
captured into text (`CapturedOutput`); per kernel name, ptxas's registers, spills and
shared memory (`ptxas_report`) and the tensor-core instructions of the kernel's code
(`code_report`); each kernel launch matched to its record (`match_kernels`); and the FLOPs
and bytes of the dots of a compiled HLO module (`hlo_dot_cost`: XLA's own GEMMs)."""

from __future__ import annotations

import math
import os
import re
import sys
import tempfile


class CapturedOutput:
  """Redirects the process's stdout and stderr file descriptors (where XLA's C++ logging
  and ptxas reports go) into a temporary file."""

  def __enter__(self):
    sys.stdout.flush()
    sys.stderr.flush()
    self.file = tempfile.TemporaryFile()
    self.saved = [os.dup(1), os.dup(2)]
    os.dup2(self.file.fileno(), 1)
    os.dup2(self.file.fileno(), 2)
    return self

  def __exit__(self, *exc):
    sys.stdout.flush()
    sys.stderr.flush()
    for fd, saved in zip((1, 2), self.saved):
      os.dup2(saved, fd)
      os.close(saved)
    self.file.seek(0)
    self.text = self.file.read().decode(errors="replace")
    self.file.close()


_ENTRY = re.compile(r"Compiling entry function '([^']+)'")
_REGS = re.compile(r"Used (\d+) registers")
_SPILL = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")
_SMEM = re.compile(r"Shared memory usage: (\d+) B")
_MOSAIC_SMEM = re.compile(r"(\d+) bytes smem")


def ptxas_report(log: str) -> dict[str, list[dict]]:
  """Per kernel name, in compile order: registers, spilled bytes, shared memory (Triton's
  dynamic shared memory as XLA reports it, else ptxas's static smem)."""
  kernels: dict[str, list[dict]] = {}
  pending_smem = None
  current = None
  for line in log.splitlines():
    if (match := _SMEM.search(line)):
      pending_smem = int(match.group(1))
    elif (match := _ENTRY.search(line)):
      current = {"registers": None, "spills": 0, "smem": pending_smem}
      kernels.setdefault(match.group(1), []).append(current)
      pending_smem = None
    elif current is not None and (match := _REGS.search(line)):
      current["registers"] = int(match.group(1))
    elif current is not None and (match := _SPILL.search(line)):
      current["spills"] += int(match.group(1)) + int(match.group(2))
    elif current is not None and current["smem"] is None and (
        match := _MOSAIC_SMEM.search(line)):
      current["smem"] = int(match.group(1))
  return kernels


# The tensor-core instructions of a kernel: Hopper's wgmma, the warp-level mma.sync, and
# Blackwell's tcgen05.mma.
_MMA = re.compile(r"\b(wgmma\.mma_async\.sync\.aligned\.m\d+n\d+k\d+\.[a-z0-9.]+"
                  r"|mma\.sync\.aligned\.m\d+n\d+k\d+\.[a-z0-9.]+|tcgen05\.mma[a-z0-9_:.]*)")
# A glog line: its thread id, its source file, the message.
_GLOG = re.compile(r"^[IWEF]\d{4} [\d:.]+\s+(\d+) ([\w.]+):\d+\] ?(.*)$")
_IR_KERNEL = re.compile(r"define ptx_kernel void @([\w$.]+)\(")
# Triton's warp-level MMA (MMA v2) is an NVVM intrinsic in the IR,
# ``llvm.nvvm.mma.<shape>.row.col.<types>``: the types name the inputs (bf16, tf32, s8,
# e4m3, ...) except for f16 inputs, where they are the accumulator's (f32.f32, f16.f16).
_NVVM_MMA = re.compile(r"@llvm\.nvvm\.mma\.(m\d+n\d+k\d+)((?:\.\w+)*)\(")
_NVVM_INPUTS = ("bf16", "tf32", "s8", "u8", "s4", "u4", "e4m3", "e5m2", "e2m1")
_PTX_ENTRY = re.compile(r"^\s*(?:\.visible\s+)?\.entry\s+([\w$]+)")
_FP8_NAMES = ("e4m3", "e5m2", "f8f6f4")


def mma_kind(instruction: str) -> str:
  """A short name of an MMA instruction: its family and operand types ("wgmma e4m3.e5m2",
  "mma.sync f16.f16", "tcgen05.mma kind::f8f6f4")."""
  parts = instruction.split(".")
  if instruction.startswith("tcgen05"):
    kind = re.search(r"kind::\w+", instruction)
    return "tcgen05.mma" + (f" {kind.group(0)}" if kind else "")
  shape = next((i for i, p in enumerate(parts) if re.fullmatch(r"m\d+n\d+k\d+", p)), None)
  if shape is None:
    return instruction
  types = [p for p in parts[shape + 1:] if p not in ("row", "col", "satfinite")]
  family = "wgmma" if instruction.startswith("wgmma") else "mma.sync"
  return f"{family} {'.'.join(types[1:3])}"  # after the accumulator's type: A's, B's


def has_fp8_mma(kinds: str) -> bool:
  """Whether a row's `Row.mma` names an MMA instruction on 8-bit float operands."""
  return any(name in kinds for name in _FP8_NAMES)


def _nvvm_mma_kind(shape: str, suffix: str) -> str:
  inputs = [part for part in suffix.split(".") if part in _NVVM_INPUTS]
  return f"mma.sync {'.'.join(inputs) or 'f16'} ({shape})"


def code_report(log: str) -> dict[str, list[dict]]:
  """Per kernel name, one record per kernel of that name: ``{"mma": the MMA instructions
  (`mma_kind`), "smem": shared memory in bytes (Triton's, else None)}``.

  Read from a compile's log: the LLVM IR of each Triton kernel that XLA logs
  (``TF_CPP_VMODULE=xtile_compiler=5``: Triton's wgmma lowering is inline PTX, so the
  instructions appear verbatim, its MMA v2 an NVVM intrinsic; a compile thread logs the
  kernel's shared memory, then its IR, so the lines of kernels compiled in parallel are told
  apart by thread id) and the PTX of each Mosaic GPU kernel (``MOSAIC_GPU_DUMP_PTX=1``:
  printed, one ``.entry`` per kernel).
  """
  kernels: dict[str, list[dict]] = {}
  current: dict[str, dict] = {}
  smem: dict[str, int] = {}
  for line in log.splitlines():
    if not any(word in line for word in ("mma", "define ptx_kernel", "Shared memory usage",
                                         ".entry")):
      continue  # most of the IR: no need to parse it
    match = _GLOG.match(line)
    if match:
      thread, source, text = match.groups()
      if source != "xtile_compiler.cc":
        continue
      if (found := _SMEM.search(text)):
        smem[thread] = int(found.group(1))
        continue
      if (found := _IR_KERNEL.search(text)):
        # The IR is logged twice (before and after LLVM's passes): one record per name.
        records = kernels.setdefault(found.group(1), [{"mma": set(), "smem": None}])
        if thread in smem:
          records[0]["smem"] = smem.pop(thread)
        current[thread] = records[0]
        continue
      if text.startswith("declare"):
        # A module's declarations may print before its kernel's definition (after the last
        # kernel's on this thread): only the calls in a kernel's body count.
        continue
      if thread in current:
        current[thread]["mma"].update(_nvvm_mma_kind(*m) for m in _NVVM_MMA.findall(text))
    else:
      thread, text = "stdout", line
      if (found := _PTX_ENTRY.match(text)):
        current[thread] = {"mma": set(), "smem": None}
        kernels.setdefault(found.group(1), []).append(current[thread])
        continue
    if thread in current:
      current[thread]["mma"].update(mma_kind(m) for m in _MMA.findall(text))
  return kernels


def match_kernels(launches, report: dict[str, list], mosaic: bool = True) -> list:
  """The record of `report` (kernel name -> records in compile order) of each launch.

  XLA names repeated Triton kernels ``name``, ``name__1``, ``name__2``, ...: the i-th
  launch of a name gets the i-th record of that sequence (the program's order). Mosaic GPU
  kernels compile as ``anonymous_mosaic_gpu_kernel``: the Mosaic GPU launches take those in
  order, only where there are as many (a kernel that this process compiled before, for an
  earlier case, is not compiled, so not reported, again) and `mosaic` (ptxas reports each
  Mosaic GPU kernel more than once: not matched). None where there is no record.
  """
  records = dict(report)
  anonymous = records.pop("anonymous_mosaic_gpu_kernel", [])
  if not mosaic or len(anonymous) != sum(launch.implementation == "pallas_mosaic_gpu"
                                         for launch in launches):
    anonymous = []
  anonymous = iter(anonymous)
  seen: dict[str, int] = {}
  matched = []
  for launch in launches:
    if launch.implementation == "pallas_mosaic_gpu" and launch.name not in records:
      matched.append(next(anonymous, None))
      continue
    index = seen.get(launch.name, 0)
    seen[launch.name] = index + 1
    flat = list(records.get(launch.name, []))
    suffix = 1
    while f"{launch.name}__{suffix}" in records:
      flat.extend(records[f"{launch.name}__{suffix}"])
      suffix += 1
    matched.append(flat[index] if index < len(flat) else None)
  return matched


_HLO_DEF = re.compile(r"%([\w.\-]+) = (\w+)\[([\d,]*)\]")
_HLO_DOT = re.compile(r"%[\w.\-]+ = (\w+)\[([\d,]*)\]\S* dot\(%([\w.\-]+), %([\w.\-]+)\)"
                      r".*?lhs_contracting_dims=\{([\d,]*)\}")
_HLO_BYTES = {"f64": 8, "f32": 4, "s32": 4, "u32": 4, "bf16": 2, "f16": 2, "s8": 1, "u8": 1,
              "f8e4m3fn": 1, "f8e5m2": 1, "pred": 1}


def hlo_dot_cost(text: str) -> tuple[float, float]:
  """(FLOPs, bytes) of the dots of a compiled HLO module's text: ``2 * output elements *
  contraction`` each, and the bytes of their operands and results (what a GEMM reads and
  writes once)."""
  shapes = {name: (dtype, [int(d) for d in dims.split(",") if d])
            for name, dtype, dims in _HLO_DEF.findall(text)}
  size = lambda dims: math.prod(dims)  # noqa: E731
  flops = moved = 0.0
  for dtype, dims, lhs, rhs, contracting in _HLO_DOT.findall(text):
    out = [int(d) for d in dims.split(",") if d]
    if lhs not in shapes or rhs not in shapes:
      continue
    lhs_dims = shapes[lhs][1]
    contraction = math.prod(lhs_dims[int(i)] for i in contracting.split(",") if i)
    flops += 2.0 * size(out) * contraction
    moved += sum(size(shape) * _HLO_BYTES.get(kind, 4)
                 for kind, shape in (shapes[lhs], shapes[rhs], (dtype, out)))
  return flops, moved
