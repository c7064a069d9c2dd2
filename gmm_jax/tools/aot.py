"""Compiles every gmm kernel variant for real accelerators without the hardware.

``python -m gmm_jax.tools.aot`` lowers and fully compiles (deviceless, ahead of time) the gmms of
MoE-shaped forward and training-step programs for one chip of each family by default,
NVIDIA H200 (sm_90a) and TPU v5e, on a CPU host; ``--targets all`` adds NVIDIA H100
(sm_90a), B200 (sm_100a), TPU v6e and TPU7x: the full run, made before a kernel or a
tile-table change lands. gmm picks its kernels itself: each program is traced under
``jax.default_device(<target device>)``, so the dispatcher serves the target's platform and
the tile tables its device kind. It prints one row per kernel launch: the implementation,
the operands it multiplies, the tiles and where they came from, the grid, and (GPU)
registers, spills and shared memory from ptxas and the tensor-core instructions of the
kernel's code ("mma": Triton's from the LLVM IR it hands to the PTX backend, Mosaic GPU's
from its PTX). A compile error, a register spill, shared-memory or VMEM overflow, a gmm
that falls back to the XLA path on an accelerator, or (cases marked ``fp8_mma``) a Hopper
kernel without fp8 MMA instructions is a failure (exit status 1).

Needs jax >= 0.12 with the CUDA plugin (GPU targets) and libtpu (TPU targets); see
docs/kernels.md ("Compiled for real targets"). ``--setup DIR`` creates such a virtual
environment. Targets whose compiler this jax lacks are reported as skipped (or fail with
``--require``).

Usage::

  python -m gmm_jax.tools.aot                       # H200 and v5e, every case
  python -m gmm_jax.tools.aot --targets all         # every target: the full run
  python -m gmm_jax.tools.aot --targets b200 tpu7x  # B200 and TPU7x
  python -m gmm_jax.tools.aot --targets h200 v5e --cases mixtral-train
  python -m gmm_jax.tools.aot --list                # the cases
  python -m gmm_jax.tools.aot --json out.json --markdown table.md

``gmm-jax-aot`` is the same command. ``--targets`` and ``--cases`` take their values after
one name, comma-separated, or by repeating the flag; ``--progress`` (default: when stderr is
a terminal) shows a progress bar on stderr.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import queue
import re
import subprocess
import sys
import tempfile
import threading
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags
from jax.experimental import topologies

import gmm_jax
from gmm_jax._src import cli
from gmm_jax._src.backends import registry as dispatch
from gmm_jax._src.tiling import tuning
from gmm_jax._src.core.config import is_gated

TARGET_DIR = pathlib.Path(__file__).with_name("targets")
# name -> (platform, topology, target config file (GPU)). A program is compiled for the
# topology's first device (one chip; a TPU7x chip shows its two TensorCores as two devices).
TARGETS = {
    "h100": ("gpu", "1x1x1", "nvidia_h100.txtpb"),
    "h200": ("gpu", "1x1x1", "nvidia_h200.txtpb"),
    "v5e": ("tpu", "v5e:1x1", None),
    "v6e": ("tpu", "v6e:1x1", None),
    # B200: Triton only (the Mosaic GPU kernel is Hopper's); TPU7x: no int8 MXU.
    "b200": ("gpu", "1x1x1", "nvidia_b200.txtpb"),
    "tpu7x": ("tpu", "tpu7x:1x1x1", None),
}
# What ``--targets`` defaults to (and so what ``--require`` requires without it): one chip
# of each family, what CI compiles. The others share its compilers (H100 with H200: sm_90a;
# v6e with v5e: Mosaic TPU) or add a family member (B200, TPU7x); ``--targets all`` compiles
# them too.
DEFAULT_TARGETS = ("h200", "v5e")
# MoE shapes: (M, K, N, G).
SHAPES = {
    "mixtral": (16384, 4096, 14336, 8),   # Mixtral-8x7B-like expert FFN, 16k tokens
    "deepseek": (8192, 2048, 1408, 64),   # DeepSeek-MoE-like fine-grained experts
    "decode": (64, 4096, 14336, 8),       # decode: a few tokens per expert
    # Decode with many experts: 64 tokens x top-8 over 64 experts, ~8 rows per group (the
    # Mosaic GPU kernel's 8-row windows; M spans several tiles).
    "decode-moe": (512, 1024, 2048, 64),
    "small": (512, 256, 384, 4),          # quick coverage of the other variants
    # Fused MoE down projections (the [R, F] hidden rows back to D columns).
    "mixtral-down": (16384, 14336, 4096, 8),
    "deepseek-down": (8192, 1408, 2048, 64),
    # DeepSeek-V3's routed experts (256 of D=7168, F=2048; 8 routed per token): 3.76e9
    # weight elements, past what 32-bit offsets address in 1-byte dtypes.
    "deepseek-v3": (16384, 7168, 2048, 256),
    # fp8 training of an MoE layer's expert gmms: 4096 routed rows, D = 2048, F = 1024, 16
    # local experts; and DeepSeek-V3's expert shape (D = 7168, F = 2048) with 32 local
    # experts (256 over 8-way expert parallelism), 8192 routed rows.
    "fp8-moe": (4096, 2048, 1024, 16),
    "deepseek-v3-ep8": (8192, 7168, 2048, 32),
}
# GPU targets whose kernels must multiply 8-bit floats with fp8 MMA (``Case.fp8_mma``):
# Hopper's wgmma takes e4m3/e5m2 operands.
FP8_MMA_TARGETS = ("h100", "h200")
# Routed experts per token of the fused MoE cases: M = tokens * MOE_TOP_K grouped rows.
MOE_TOP_K = 2
_CHILD_ENV = "GMM_JAX_AOT_CHILD"
_SPILL_FLAG = "--xla_gpu_fail_ptx_compilation_on_register_spilling=true"
# A compile process's line after each (target, case): the parent's progress bar counts them.
_DONE = "#done "


# ---------------------------------------------------------------------------------- cases


@dataclasses.dataclass(frozen=True)
class Case:
  """One program: ``kind`` "fwd" (gmm), "train" (grad of a loss: forward, dlhs, drhs) or
  "fp8-train" (fp8 training's three gmms on blockwise-quantized QArrays, as
  ``gmm(..., quantization="fp8")`` issues them: the forward with e4m3 activations in 1 x 128
  blocks and e4m3 weights in 128 x 128 blocks, the dlhs of a `grad_dtype` output gradient
  in 1 x 128 blocks with the same weights transposed, the k-grouped drhs of activations and
  gradients in 128 x 1 blocks; `activation` and `bias` apply to the forward)."""

  name: str
  shape: str
  kind: str = "fwd"
  dtype: str = "bfloat16"
  group_type: str = "m"
  activation: str | None = None
  bias: bool = False
  transpose_lhs: bool = False
  transpose_rhs: bool = False
  weights: str | None = None  # quantized rhs: "int8", "int4", "float8_e4m3fn"
  weight_tile: int | None = None  # per-group scales along K
  activations_q: str | None = None  # quantized lhs (scaled mode): "int8", "float8_e4m3fn"
  group_offset: bool = False  # expert parallelism: half the groups held locally
  # Fused MoE rows: "gather" (lhs [M / MOE_TOP_K, K] read through lhs_indices [M]) or
  # "combine" (row_weights [M] and out_indices [M] scattering to M slots).
  moe: str | None = None
  implementation: str | None = None  # None: the platform's chain picks
  platforms: tuple[str, ...] = ("gpu", "tpu")
  grad_dtype: str = "float8_e4m3fn"  # "fp8-train": the output gradient's values
  # On `FP8_MMA_TARGETS`, every kernel must hold fp8 MMA instructions.
  fp8_mma: bool = False
  # A gated prologue: lhs [M, 2K] is the pre-activation the product reads through it; the
  # training step's dlhs gmm writes its [M, 2K] cotangent (the TPU kernel's epilogue).
  lhs_activation: str | None = None

  def describe(self) -> str:
    m, k, n, g = SHAPES[self.shape]
    if self.kind == "fp8-train":
      parts = [f"fp8 training fwd/dlhs/drhs M={m} K={k} N={n} G={g}, blockwise e4m3 "
               f"(gradients {self.grad_dtype})"]
    else:
      parts = [f"{self.kind} {self.group_type}-grouped M={m} K={k} N={n} G={g} {self.dtype}"]
    if self.weights:
      parts.append(f"{self.weights} weights" + (f" (K blocks of {self.weight_tile})"
                                                if self.weight_tile else ""))
    if self.activations_q:
      parts.append(f"{self.activations_q} activations")
    if self.moe:
      parts.append({"gather": f"lhs rows gathered from {m // MOE_TOP_K} tokens",
                    "combine": "row weights, rows scattered"}[self.moe])
    if self.implementation:
      parts.append(self.implementation)
    for flag, text in ((self.lhs_activation, f"lhs_activation {self.lhs_activation}"),
                       (self.activation, f"{self.activation}"), (self.bias, "bias"),
                       (self.transpose_lhs, "lhs^T"), (self.transpose_rhs, "rhs^T"),
                       (self.group_offset, "group_offset")):
      if flag:
        parts.append(text)
    return ", ".join(parts)


CASES = (
    # The MoE training steps: forward, dlhs (m-grouped, rhs^T) and drhs (k-grouped).
    Case("mixtral-train", "mixtral", "train", activation="silu"),
    Case("deepseek-train", "deepseek", "train", activation="silu"),
    Case("decode-fwd", "decode", "fwd", activation="silu"),
    Case("decode64-fwd", "decode-moe", "fwd"),
    Case("mixtral-gelu-bias", "mixtral", "fwd", activation="gelu", bias=True),
    Case("deepseek-rhsT-train", "deepseek", "train", transpose_rhs=True, bias=True),
    Case("small-f16-train", "small", "train", dtype="float16", activation="relu"),
    Case("small-f32-train", "small", "train", dtype="float32", activation="gelu"),
    Case("small-lhsT", "small", "fwd", transpose_lhs=True),
    Case("small-offset-train", "small", "train", group_offset=True, bias=True),
    Case("small-k-grouped", "small", "fwd", group_type="k", activation="silu", bias=True),
    # Quantized: weight-only (dequantized in-kernel) and both operands (scaled mode).
    Case("mixtral-int8-weights", "mixtral", weights="int8"),
    Case("decode-int8-weights", "decode", weights="int8"),
    Case("deepseek-int4-blocked", "deepseek", weights="int4", weight_tile=128),
    Case("mixtral-fp8-weights", "mixtral", weights="float8_e4m3fn"),
    Case("mixtral-int8xint8", "mixtral", weights="int8", activations_q="int8",
         dtype="float32"),
    Case("mixtral-fp8xfp8", "mixtral", weights="float8_e4m3fn",
         activations_q="float8_e4m3fn", dtype="float32"),
    # Fused MoE expert FFN (gmm_jax.route's operands): the gate/up projection gathers the
    # tokens' rows and applies SwiGLU to [gate | up] columns; the down projection weights
    # the rows by the router probabilities and scatters them to their slots.
    Case("mixtral-moe-up", "mixtral", activation="swiglu", moe="gather",
         implementation="pallas_triton", platforms=("gpu",)),
    Case("mixtral-moe-down", "mixtral-down", moe="combine", implementation="pallas_triton",
         platforms=("gpu",)),
    Case("deepseek-moe-up", "deepseek", activation="swiglu_clamped", bias=True, moe="gather",
         implementation="pallas_triton", platforms=("gpu",)),
    Case("deepseek-moe-down", "deepseek-down", moe="combine", implementation="pallas_triton",
         platforms=("gpu",)),
    Case("decode-moe-up", "decode", activation="swiglu", moe="gather",
         implementation="pallas_triton", platforms=("gpu",)),
    Case("mixtral-moe-up-int8-weights", "mixtral", activation="swiglu", moe="gather",
         weights="int8", transpose_rhs=True, implementation="pallas_triton",
         platforms=("gpu",)),
    Case("small-moe-train", "small", "train", activation="swiglu", moe="gather"),
    # The down projection reading the gate|up pre-activation through a gated prologue: its
    # dlhs gmm writes the [M, 2F] cotangent (TPU: in the kernel's epilogue, by DMA).
    Case("mixtral-moe-down-prologue-train", "mixtral-down", "train", lhs_activation="swiglu",
         moe="combine"),
    # 1-byte weights of 2**31+ elements (read as 16-bit words): fp8 x fp8 on the tensor
    # cores, and fp8 weights dequantized in-kernel for bf16 tokens.
    Case("deepseek-v3-fp8xfp8", "deepseek-v3", weights="float8_e4m3fn",
         activations_q="float8_e4m3fn", dtype="float32", implementation="pallas_triton",
         platforms=("gpu",)),
    Case("deepseek-v3-fp8-weights", "deepseek-v3", weights="float8_e4m3fn",
         implementation="pallas_triton", platforms=("gpu",)),
    # fp8 training (blockwise scales, "blocked" mode): the chain's kernels on every target,
    # and the Triton kernels alone on GPUs (fp8 wgmma on Hopper in all three gmms).
    Case("fp8-train", "fp8-moe", "fp8-train", fp8_mma=True),
    Case("fp8-train-e5m2", "fp8-moe", "fp8-train", grad_dtype="float8_e5m2", fp8_mma=True),
    Case("deepseek-v3-fp8-train", "deepseek-v3-ep8", "fp8-train", activation="silu",
         bias=True, fp8_mma=True),
    Case("fp8-train-triton", "fp8-moe", "fp8-train", implementation="pallas_triton",
         platforms=("gpu",), fp8_mma=True),
    Case("fp8-train-e5m2-triton", "fp8-moe", "fp8-train", grad_dtype="float8_e5m2",
         implementation="pallas_triton", platforms=("gpu",), fp8_mma=True),
    Case("deepseek-v3-fp8-train-triton", "deepseek-v3-ep8", "fp8-train", activation="silu",
         bias=True, implementation="pallas_triton", platforms=("gpu",), fp8_mma=True),
)


def _abstract(shape, dtype, sharding):
  return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)


# The role of each gmm of a program, noted by tiling callables that leave the choice to gmm.
_ROLE_OF: dict = {}


def _note(role):
  def note(problem):
    _ROLE_OF[problem] = role
  return note


_ROLE_NOTES = gmm_jax.Tilings(fwd=_note("fwd"), dlhs=_note("dlhs"), drhs=_note("drhs"))


def _fp8_training(case: Case, sharding):
  """(function, abstract arguments) of an "fp8-train" case: its three gmms."""
  m, k, n, g = SHAPES[case.shape]
  e4m3, grad = jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(case.grad_dtype)

  def blocks(shape, dtype, channelwise, tiles):
    spec = lambda a: gmm_jax.quantize(a, dtype, channelwise_axes=channelwise,  # noqa: E731
                                      tiled_axes=tiles)
    q = jax.eval_shape(spec, jax.ShapeDtypeStruct(shape, jnp.float32))
    return jax.tree.map(lambda a: _abstract(a.shape, a.dtype, sharding), q)

  args = (blocks((m, k), e4m3, (0,), {1: 128}),             # x, 1 x 128 blocks
          blocks((g, k, n), e4m3, (0,), {1: 128, 2: 128}),  # w, 128 x 128 blocks
          blocks((m, n), grad, (0,), {1: 128}),             # dy, 1 x 128 blocks
          blocks((m, k), e4m3, (1,), {0: 128}),             # x, 128 x 1 blocks
          blocks((m, n), grad, (1,), {0: 128}),             # dy, 128 x 1 blocks
          _abstract((g,), jnp.int32, sharding),
          _abstract((g, n), jnp.float32, sharding) if case.bias else None)
  options = dict(implementation=case.implementation)

  def step(x, w, dy, x_rows, dy_rows, sizes, bias):
    y = gmm_jax.gmm(x, w, sizes, bias=bias, activation=case.activation,
                    preferred_element_type=jnp.bfloat16, tiling=_note("fwd"), **options)
    dx = gmm_jax.gmm(dy, w, sizes, transpose_rhs=True, preferred_element_type=jnp.float32,
                     tiling=_note("dlhs"), **options)
    dw = gmm_jax.gmm(x_rows, dy_rows, sizes, group_type="k", transpose_lhs=True,
                     preferred_element_type=jnp.float32, tiling=_note("drhs"), **options)
    return y, dx, dw

  return step, args


def build(case: Case, sharding):
  """(function, abstract arguments) of a case, placed on the target by `sharding`."""

  if case.kind == "fp8-train":
    return _fp8_training(case, sharding)
  m, k, n, g = SHAPES[case.shape]
  dtype = jnp.dtype(case.dtype)
  local = g // 2 if case.group_offset else g
  n = 2 * n if is_gated(case.activation) else n  # [gate | up] columns
  if case.group_type == "m":
    lhs_rows = m // MOE_TOP_K if case.moe == "gather" else m
    lhs_cols = 2 * k if case.lhs_activation else k
    lhs_shape = (k, lhs_rows) if case.transpose_lhs else (lhs_rows, lhs_cols)
    rhs_shape = (local, n, k) if case.transpose_rhs else (local, k, n)
  else:
    lhs_shape = (k, m) if case.transpose_lhs else (m, k)
    rhs_shape = (n, k) if case.transpose_rhs else (k, n)
  place = lambda tree: jax.tree.map(lambda a: _abstract(a.shape, a.dtype, sharding), tree)
  x = _abstract(lhs_shape, dtype, sharding)
  w = _abstract(rhs_shape, dtype, sharding)
  sizes = _abstract((g,), jnp.int32, sharding)
  bias = _abstract((local, n), dtype, sharding) if case.bias else None
  options = dict(group_type=case.group_type, activation=case.activation, tiling=_ROLE_NOTES,
                 transpose_lhs=case.transpose_lhs, transpose_rhs=case.transpose_rhs,
                 implementation=case.implementation, lhs_activation=case.lhs_activation)
  rows = {}
  if case.moe == "gather":
    rows["lhs_indices"] = _abstract((m,), jnp.int32, sharding)
  elif case.moe == "combine":
    rows["row_weights"] = _abstract((m,), jnp.float32, sharding)
    rows["out_indices"] = _abstract((m,), jnp.int32, sharding)
    options["out_rows"] = m
  if case.group_offset:
    options["group_offset"] = g - local
  if case.weights:
    k_axis = 2 if case.transpose_rhs else 1
    n_axis = 1 if case.transpose_rhs else 2
    tiles = {k_axis: case.weight_tile} if case.weight_tile else None
    spec = lambda a: gmm_jax.quantize(a, jnp.dtype(case.weights),
                                      channelwise_axes=(0, n_axis), tiled_axes=tiles)
    w = place(jax.eval_shape(spec, jax.ShapeDtypeStruct(rhs_shape, jnp.float32)))
  if case.activations_q:
    spec = lambda a: gmm_jax.quantize(a, jnp.dtype(case.activations_q), channelwise_axes=(0,))
    x = place(jax.eval_shape(spec, jax.ShapeDtypeStruct(lhs_shape, jnp.float32)))
    options["preferred_element_type"] = jnp.bfloat16

  def forward(x, w, sizes, bias, rows):
    return gmm_jax.gmm(x, w, sizes, bias=bias, **rows, **options)

  if case.kind == "fwd":
    return forward, (x, w, sizes, bias, rows)

  def loss(x, w, sizes, bias, rows):
    return jnp.sum(jnp.square(forward(x, w, sizes, bias, rows).astype(jnp.float32)))

  argnums = (0, 1, 3) if case.bias else (0, 1)
  return jax.grad(loss, argnums=argnums), (x, w, sizes, bias, rows)


# ------------------------------------------------------------------------------ compiling


@dataclasses.dataclass
class Row:
  """One kernel launch of one compiled case."""

  target: str
  case: str
  gmm: str  # "fwd", "dlhs", "drhs" (in trace order)
  implementation: str
  operands: str = ""  # "<lhs values> x <rhs values> <quantized mode>"
  kernel: str = ""
  tiling: str = ""
  source: str = ""
  grid: str = ""
  registers: int | None = None
  spills: int | None = None
  smem: int | None = None
  vmem_limit: int | None = None
  # GPU: the kernel's tensor-core instructions ("wgmma e4m3.e4m3", ...; "-" none, "?" not
  # reported).
  mma: str = ""
  seconds: float = 0.0
  status: str = "ok"
  error: str = ""


def topology_of(target: str):
  """The deviceless topology of a name of `TARGETS` (one chip)."""
  platform, topology, config = TARGETS[target]
  if platform == "tpu":
    return topologies.get_topology_desc(topology, platform="tpu")
  return topologies.get_topology_desc(platform="cuda", topology=topology,
                                      target_config=(TARGET_DIR / config).read_text())


class _CapturedOutput:
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


def _operands(problem) -> str:
  if problem is None:
    return ""
  names = lambda dtype: np.dtype(dtype).name.replace("float8_", "")  # noqa: E731
  return f"{names(problem.lhs_dtype)} x {names(problem.rhs_dtype)} {problem.quant_mode}"


def compile_case(target: str, case: Case) -> list[Row]:
  """Lowers and compiles one case for one target; one `Row` per kernel launch."""

  platform = TARGETS[target][0]
  topology = topology_of(target)
  mesh = jax.sharding.Mesh(np.array(topology.devices[:1]), ("x",))
  sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  start = time.perf_counter()
  fn, args = build(case, sharding)
  rows: list[Row] = []
  _ROLE_OF.clear()
  launches: list = []
  try:
    with jax.default_device(topology.devices[0]), dispatch.record() as decisions, \
        tuning.record() as choices, tuning.record_launches() as launches:
      lowered = jax.jit(fn).lower(*args)
    with _CapturedOutput() as captured:
      lowered.compile()
    error = None
  except Exception as err:  # noqa: BLE001  (a compile failure is a reported result)
    error = f"{type(err).__name__}: {err}"
    captured = None
  seconds = time.perf_counter() - start
  log = captured.text if captured is not None else ""
  stats = match_kernels(launches, ptxas_report(log), mosaic=False)
  codes = match_kernels(launches, code_report(log))
  for launch, stat, code in zip(launches, stats, codes):
    row = Row(target, case.name, _ROLE_OF.get(launch.problem, "?"),
              launch.implementation, operands=_operands(launch.problem), kernel=launch.name,
              grid="x".join("dyn" if g < 0 else str(g) for g in launch.grid),
              vmem_limit=launch.vmem_limit, seconds=seconds)
    row.tiling = "x".join(str(v) for v in launch.tiles)
    choice = next((c for c in reversed(choices) if c.problem == launch.problem), None)
    row.source = choice.source if choice is not None else ""
    if platform == "gpu" and stat is not None:
      row.registers = stat["registers"]
      row.spills = stat["spills"]
      row.smem = stat["smem"]
    if platform == "gpu" and code is not None and code["smem"] is not None:
      row.smem = code["smem"]  # Triton's dynamic shared memory, told apart by thread
    if platform == "gpu" and captured is not None:
      # "-": the kernel's code holds no MMA instruction; "?": its code was not reported.
      row.mma = "?" if code is None else ", ".join(sorted(code["mma"])) or "-"
    rows.append(row)
  served = [d.implementation for d in decisions]
  problems = []
  if error:
    problems.append(error)
  if any(name in ("xla", "reference") for name in served):
    problems.append(f"a gmm fell back to the XLA path on {platform}: {served}")
  if not launches and not error:
    problems.append("no kernel was launched")
  for row in rows:
    if row.spills:
      problems.append(f"{row.kernel} spills {row.spills} bytes")
    if (case.fp8_mma and target in FP8_MMA_TARGETS and not error and row.mma != "?"
        and not has_fp8_mma(row.mma)):
      problems.append(f"{row.kernel} ({row.gmm}) holds no fp8 MMA instruction: "
                      f"{row.mma or 'none found'}")
  if problems:
    if not rows:
      rows.append(Row(target, case.name, "-", ",".join(served) or "-", seconds=seconds))
    for row in rows:
      row.status, row.error = "FAIL", "; ".join(problems)[:2000]
  return rows


# ------------------------------------------------------------------------------- running


def _child(targets, cases, json_path):
  results = []
  for target in targets:
    try:
      topology_of(target)
    except Exception as err:  # noqa: BLE001  (no libtpu / CUDA plugin: many kinds)
      results.append(dataclasses.asdict(Row(target, "*", "-", "-", status="skipped",
                                            error=f"no {target} compiler: {err}"[:500])))
      for case in cases:
        if TARGETS[target][0] in case.platforms:
          print(f"{_DONE}{target} {case.name} (skipped)", flush=True)
      continue
    for case in cases:
      if TARGETS[target][0] not in case.platforms:
        continue
      try:
        rows = compile_case(target, case)
      except Exception:  # noqa: BLE001  (building the case failed: report, go on)
        rows = [Row(target, case.name, "-", "-", status="FAIL",
                    error=traceback.format_exc()[-2000:])]
      for row in rows:
        print(_line(row), flush=True)
        results.append(dataclasses.asdict(row))
      print(f"{_DONE}{target} {case.name}", flush=True)
  pathlib.Path(json_path).write_text(json.dumps(results, indent=1))


def _line(row: Row) -> str:
  stats = ""
  if row.registers is not None:
    stats = f" regs={row.registers} spills={row.spills} smem={row.smem}"
  if row.vmem_limit:
    stats += f" vmem_limit={row.vmem_limit}"
  if row.mma:
    stats += f" mma=[{row.mma}]"
  operands = f" [{row.operands}]" if row.operands else ""
  text = (f"[{row.status}] {row.target} {row.case} {row.gmm}: {row.implementation}{operands} "
          f"{row.kernel} tiles={row.tiling} ({row.source}) grid={row.grid}{stats} "
          f"{row.seconds:.1f}s")
  return text + (f"\n    {row.error}" if row.error else "")


def markdown(rows: list[dict]) -> str:
  """The results as a Markdown table."""
  head = ("| target | case | gmm | implementation | operands | kernel | tiles (m x k x n) | "
          "tile source | grid | registers | spills (B) | shared memory (B) | VMEM limit (B) | "
          "MMA instructions | compile s | status |")
  lines = [head, "|" + "---|" * 16]
  blank = lambda v: "" if v is None else str(v)
  for r in rows:
    lines.append(
        f"| {r['target']} | {r['case']} | {r['gmm']} | {r['implementation']} | "
        f"{r.get('operands', '')} | {r['kernel']} | "
        f"{r['tiling']} | {r['source']} | {r['grid']} | {blank(r['registers'])} | "
        f"{blank(r['spills'])} | {blank(r['smem'])} | {blank(r['vmem_limit'])} | "
        f"{r.get('mma', '')} | {r['seconds']:.1f} | {r['status']} |")
  return "\n".join(lines) + "\n"


def _child_env() -> dict[str, str]:
  env = dict(os.environ)
  env[_CHILD_ENV] = "1"
  env["JAX_PLATFORMS"] = "cpu"  # the plugins register without touching a device
  env["TF_CPP_MIN_LOG_LEVEL"] = "0"
  # nvjitlink: ptxas's report; xtile_compiler: Triton's shared memory (2) and each Triton
  # kernel's LLVM IR (5), which `mma_report` reads.
  env["TF_CPP_VMODULE"] = "nvjitlink=3,xtile_compiler=5"
  env["MOSAIC_GPU_DUMP_PTXAS"] = "1"
  env["MOSAIC_GPU_DUMP_PTX"] = "1"
  env["ALLOW_MULTIPLE_LIBTPU_LOAD"] = "1"  # the compile processes each load libtpu
  flags = env.get("XLA_FLAGS", "")
  if _SPILL_FLAG not in flags:
    env["XLA_FLAGS"] = (flags + " " + _SPILL_FLAG).strip()
  return env


def _define_flags() -> flags.FlagValues:
  """This command's flags, in a FlagValues of their own (none are registered globally)."""
  fv = cli.flag_values()
  flags.DEFINE_multi_enum("targets", list(DEFAULT_TARGETS), [*TARGETS, "all"],
                          "the targets to compile for (default: one chip per family; 'all': "
                          "every target, the full run)", flag_values=fv)
  flags.DEFINE_multi_enum("cases", [c.name for c in CASES], [c.name for c in CASES],
                          "the programs to compile (--list describes them)", flag_values=fv)
  flags.DEFINE_integer("jobs", 2, "compile processes (targets are split between them)",
                       lower_bound=1, flag_values=fv)
  flags.DEFINE_string("json", None, "write the rows as JSON here", flag_values=fv)
  flags.DEFINE_string("markdown", None, "write the Markdown table here", flag_values=fv)
  flags.DEFINE_bool("require", False,
                    "a target whose compiler is missing is a failure, not a skip", flag_values=fv)
  flags.DEFINE_bool("list", False, "list the cases and exit", flag_values=fv)
  # Internal: a compile process writes its rows here.
  flags.DEFINE_string("child_json", None, "(internal) run as a compile process",
                      flag_values=fv)
  return fv


def _read_lines(proc: subprocess.Popen, lines: queue.Queue):
  for line in proc.stdout:
    lines.put(line.rstrip("\n"))
  lines.put(None)


def main(argv=None) -> int:
  """Compiles the cases for the targets of command-line flags `argv` (without the program
  name; None: sys.argv[1:]); prints one row per kernel launch and the Markdown table.
  Returns the exit status."""
  argv = sys.argv[1:] if argv is None else list(argv)
  if "--pod" in argv:  # whole MoE training steps on multi-chip topologies: gmm_jax.tools.aot_pod
    # (a command of its own: it needs flax and builds on gmm_jax.nn, a floor above this one)
    return subprocess.call([sys.executable, "-m", "gmm_jax.tools.aot_pod",
                            *(arg for arg in argv if arg != "--pod")])
  args = cli.parse_flags(_define_flags(), "gmm-jax-aot", argv,
                         __doc__)
  cases = [c for c in CASES if c.name in args.cases]
  if "all" in args.targets:
    args.targets = list(TARGETS)
  if args.list:
    for case in CASES:
      print(f"{case.name}: {case.describe()}")
    return 0
  if args.child_json:
    _child(args.targets, cases, args.child_json)
    return 0
  jobs = max(1, min(args.jobs, len(args.targets)))
  total = sum(TARGETS[t][0] in c.platforms for t in args.targets for c in cases)
  # Interleave GPU and TPU targets so that each process gets a mix.
  ordered = sorted(args.targets, key=lambda t: list(TARGETS).index(t))
  shards = [ordered[i::jobs] for i in range(jobs)]
  start = time.perf_counter()
  with tempfile.TemporaryDirectory() as tmp:
    procs, lines = [], queue.Queue()
    for i, shard in enumerate(shards):
      out = pathlib.Path(tmp) / f"{i}.json"
      command = [sys.executable, "-m", "gmm_jax.tools.aot", "--child_json", str(out), "--targets",
                 *shard, "--cases", *[c.name for c in cases]]
      proc = subprocess.Popen(command, env=_child_env(), stdout=subprocess.PIPE,
                              stderr=subprocess.DEVNULL, text=True)
      threading.Thread(target=_read_lines, args=(proc, lines), daemon=True).start()
      procs.append((proc, out))
    # The compile processes' rows as they come, and a bar counting the (target, case)s done.
    bar = cli.Progress(total, cli.show_progress(args))
    bar.begin(f"compiling for {', '.join(args.targets)}")
    running = len(procs)
    while running:
      line = lines.get()
      if line is None:
        running -= 1
      elif line.startswith(_DONE):
        bar.advance(line[len(_DONE):])
      else:
        bar.print(line)
    bar.close()
    rows = []
    for proc, out in procs:
      proc.wait()
      if out.exists():
        rows.extend(json.loads(out.read_text()))
      else:
        rows.append(dataclasses.asdict(Row("?", "?", "-", "-", status="FAIL",
                                           error=f"compile process exited {proc.returncode}")))
  order = {t: i for i, t in enumerate(TARGETS)}
  names = [c.name for c in CASES]
  rows.sort(key=lambda r: (order.get(r["target"], 99),
                           names.index(r["case"]) if r["case"] in names else -1))
  table = markdown(rows)
  print()
  print(table)
  failed = [r for r in rows if r["status"] == "FAIL"]
  skipped = [r for r in rows if r["status"] == "skipped"]
  print(f"{len(rows) - len(failed) - len(skipped)} kernel launches compiled, {len(failed)} "
        f"failed, {len(skipped)} targets skipped, in {time.perf_counter() - start:.0f} s")
  for r in skipped:
    print(f"skipped {r['target']}: {r['error']}")
  for r in failed:
    print(f"FAILED {r['target']} {r['case']}: {r['error']}")
  cli.save_tables(rows, table, args.json, args.markdown)
  return 1 if failed or (skipped and args.require) else 0


def run():
  """The `gmm-jax-aot` console script (and ``python -m gmm_jax.tools.aot``)."""
  cli.run(main)


if __name__ == "__main__":
  run()
