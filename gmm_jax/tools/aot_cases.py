"""The programs `gmm_jax.tools.aot` compiles.

MoE shapes, the cases (forward, training step and fp8 training programs of every kernel
variant) and their abstract arguments.

A case's function calls gmm as a user does; tiling callables that leave the choice to gmm
note the role of each gmm of the program (`ROLE_OF`: forward, dlhs, drhs)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

import gmm_jax
from gmm_jax._src.core.config import is_gated

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
# On these targets a kernel whose row tile holds at least `TCGEN05_MIN_ROWS` rows (the
# smallest M of Blackwell's tcgen05.mma) must multiply with tcgen05.mma, its accumulator in
# tensor memory; smaller row tiles (decode's 16 rows) may use the warp-level mma.sync.
TCGEN05_TARGETS = ("b200",)
TCGEN05_MIN_ROWS = 64
# Routed experts per token of the fused MoE cases: M = tokens * MOE_TOP_K grouped rows.
MOE_TOP_K = 2


@dataclasses.dataclass(frozen=True)
class Case:
  """One program: ``kind`` "fwd" (gmm), "train" (grad of a loss: forward, dlhs, drhs) or
  "fp8-train" (fp8 training's three gmms on blockwise-quantized QArrays, as
  ``gmm(..., quantization="fp8")`` issues them: the forward with e4m3 activations in 1 x 128
  blocks and e4m3 weights in 128 x 128 blocks, the dlhs of a `grad_dtype` output gradient
  in 1 x 128 blocks with the same weights transposed, the k-grouped drhs of activations and
  gradients in 128 x 1 blocks, both written in bf16; `activation` and `bias` apply to the
  forward)."""

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
  # "train" in fp8 (gmm's ``quantization=``, e.g. "fp8"): the three gmms on blockwise
  # scales that fp8 training issues.
  quantization: str | None = None

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
    for flag, text in ((self.quantization, f"quantization={self.quantization}"),
                       (self.lhs_activation, f"lhs_activation {self.lhs_activation}"),
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
    # The same in fp8 training: the dlhs gmm multiplies blockwise fp8 operands and writes
    # the [M, 2F] cotangent from its epilogue.
    Case("mixtral-moe-down-prologue-fp8-train", "mixtral-down", "train",
         lhs_activation="swiglu", moe="combine", quantization="fp8", fp8_mma=True),
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
    # The shapes of the modelled share of peak (`aot_model`) on GPUs: Mixtral-like and
    # DeepSeek-V3-like training in bf16 and fp8, decode in bf16 and fp8, and the same
    # programs on `jax.lax.ragged_dot` (XLA's own kernels, modelled from the compiled
    # program's cost analysis).
    Case("deepseek-v3-train", "deepseek-v3-ep8", "train", activation="silu",
         platforms=("gpu",)),
    Case("mixtral-fp8-train", "mixtral", "fp8-train", implementation="pallas_triton",
         platforms=("gpu",), fp8_mma=True),
    Case("decode-fp8xfp8", "decode", weights="float8_e4m3fn", activations_q="float8_e4m3fn",
         dtype="float32", implementation="pallas_triton", platforms=("gpu",)),
    *(Case(f"{name}-ragged-dot", shape, kind, activation="silu",
           implementation="lax_ragged_dot", platforms=("gpu",))
      for name, shape, kind in (("mixtral-train", "mixtral", "train"),
                                ("deepseek-v3-train", "deepseek-v3-ep8", "train"),
                                ("decode-fwd", "decode", "fwd"))),
)


def _abstract(shape, dtype, sharding):
  return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)


# The role of each gmm of a program, noted by tiling callables that leave the choice to gmm.
ROLE_OF: dict = {}


def _note(role):
  def note(problem):
    ROLE_OF[problem] = role
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
    # The gradients in the operands' dtype (bf16), as fp8 training writes them.
    dx = gmm_jax.gmm(dy, w, sizes, transpose_rhs=True, preferred_element_type=jnp.bfloat16,
                     tiling=_note("dlhs"), **options)
    dw = gmm_jax.gmm(x_rows, dy_rows, sizes, group_type="k", transpose_lhs=True,
                     preferred_element_type=jnp.bfloat16, tiling=_note("drhs"), **options)
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
  if case.quantization:
    options.update(quantization=case.quantization, preferred_element_type=dtype)
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
