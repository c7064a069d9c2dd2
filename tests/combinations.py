"""Drawn gmm calls over the whole option space, and the properties every call must have.

A `Case` is one combination of options (implementation x group type x transposes x
activation x bias x row operands x group_offset x quantization x dtype, with a small fixed
shape and drawn group sizes); `cases` draws them with hypothesis. Each ``check_*`` function
states one property as its definition (the float64 numpy oracle of `oracle.py`, a Python
loop over a batch, the unsharded call, a finite difference, ...) and raises AssertionError
when the call breaks it. `tests/test_combinations.py` drives them.

A failing check's exception carries a note with a one-line reproducer (run from tests/).

NotImplementedError is a legal outcome only for combinations the documentation says are
unsupported (`documented_refusal`, from `gmm`'s docstring and docs/support.md); drawn
cases avoid them where they can, and any other exception fails the check.

fp8 training (``quantization="fp8"``) has draws and checks of its own at the end
(`fp8_cases`, ``check_fp8_*``, driven by tests/test_fp8_combinations.py): its blocks need K
and N in multiples of 128, its definition is the blockwise formula of tests/fp8_oracle.py,
and its refusals (k-grouping, a transposed lhs, jvp) are asserted, not skipped.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from typing import Any, Callable

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import fp8_oracle
from oracle import (GATED, activation_rules, f64, gmm_oracle, gmm_oracle_vjp, local_rows,
                    rounding_bound, rows_oracle, rows_oracle_vjp, tolerances)

import gmm_jax

# Implementations in the order hypothesis shrinks towards (the simplest first).
IMPLEMENTATIONS = ("xla", "reference", "pallas_tpu", "pallas_triton", "pallas_mosaic_gpu")
ELEMENTWISE = ("silu", "gelu_tanh")
GATED_NAMES = ("swiglu", "geglu", "swiglu_clamped")
ACTIVATIONS = (None,) + ELEMENTWISE + GATED_NAMES
QUANT_MODES = ("none", "weight_only", "scaled")
FP8_QUANTS = ("fp8", "fp8_e5m2_grads")  # fp8 training (`fp8_cases`), drawn on their own
DTYPES = ("float32", "bfloat16")
ROW_OPERANDS = ("lhs_indices", "row_weights", "out_indices")

# A few fixed shapes per group type, (M, K, N, G) with N the output columns (a gated
# activation's rhs has 2N), so that draws share compilations. Every dimension is a multiple
# of 8 (each can be split over the 8-device mesh) except G, which is split over 2 or 4.
SHAPES = {
    "m": ((16, 8, 8, 4), (32, 16, 4, 2)),
    "k": ((8, 16, 8, 4), (16, 32, 4, 2)),
}

# The shape the TPU kernel's gated epilogue serves (N a multiple of its 128-lane column
# tiles; smaller N falls back to the plain kernel with the activation after it): drawn for
# pallas_tpu with a gated activation, so that the draws reach the in-kernel epilogue too.
EPILOGUE_SHAPES = {"m": (16, 8, 128, 2), "k": (8, 16, 128, 2)}


def shapes_for(implementation: str, group_type: str, activation: str | None) -> tuple:
  """The (M, K, N, G) shapes drawn for one implementation, group type and activation."""
  shapes = SHAPES[group_type]
  if implementation == "pallas_tpu" and activation in GATED_NAMES:
    shapes += (EPILOGUE_SHAPES[group_type],)
  return shapes


# The meshes the sharded property draws from: all 8 host CPU devices (tests/conftest.py).
MESHES = {"8": ((8,), ("x",)), "2x4": ((2, 4), ("x", "y"))}

BATCH = 2  # the batch of the vmap properties


# ------------------------------------------------------------------------------ the case


@dataclasses.dataclass(frozen=True)
class Case:
  """One gmm call: every option, the shape and the group sizes (see `make_operands`).

  Attributes:
    m: rows of the grouped problem (R with row operands) for "m"; lhs rows M for "k".
    k: the contraction length.
    n: output columns (the rhs has 2n with a gated activation).
    sizes: the sizes of all G groups (they may sum to less than the grouped dimension).
    num_local: groups held locally (rhs groups for "m", output groups for "k").
    group_offset: the first group held locally.
    rows: the row operands passed (m-grouping only).
    out_rows: rows of the result with out_indices (m or 2m).
    seed: the operands' random seed.
    quant: "none", "weight_only", "scaled" (QArray operands), or "fp8" /
      "fp8_e5m2_grads": fp8 training of float operands (``quantization=quant``).
    lhs_activation: None or a gated activation applied to lhs ``[M, 2K]`` before the
      product (a gated prologue; m-grouping, untransposed float lhs, not gathered).
  """

  implementation: str = "xla"
  group_type: str = "m"
  transpose_lhs: bool = False
  transpose_rhs: bool = False
  activation: str | None = None
  bias: bool = False
  rows: tuple[str, ...] = ()
  group_offset: int = 0
  num_local: int = 4
  quant: str = "none"
  dtype: str = "float32"
  m: int = 16
  k: int = 8
  n: int = 8
  sizes: tuple[int, ...] = (4, 0, 5, 3)
  out_rows: int = 16
  seed: int = 0
  lhs_activation: str | None = None

  @property
  def lhs_cols(self) -> int:
    """Stored lhs columns: 2K with a gated prologue."""
    return 2 * self.k if self.lhs_activation else self.k

  @property
  def gated(self) -> bool:
    return self.activation in GATED_NAMES or self.activation in GATED

  @property
  def rhs_cols(self) -> int:
    return 2 * self.n if self.gated else self.n

  @property
  def num_groups(self) -> int:
    return len(self.sizes)

  @property
  def tokens(self) -> int:
    """Rows of lhs: half the grouped rows with lhs_indices (each token read twice)."""
    if self.group_type == "m" and "lhs_indices" in self.rows:
      return self.m // 2
    return self.m

  @property
  def result_rows(self) -> int:
    return self.out_rows if "out_indices" in self.rows else self.m

  @property
  def out_dtype(self) -> np.dtype:
    # Weight-only keeps the activations' dtype; QArray x QArray gives f32 (`gmm` docs).
    return np.dtype(jnp.float32) if self.quant == "scaled" else np.dtype(self.dtype)

  @property
  def out_shape(self) -> tuple[int, ...]:
    if self.group_type == "m":
      return (self.result_rows, self.n)
    return (self.num_local, self.m, self.n)

  @property
  def pass_group_offset(self) -> bool:
    return self.group_offset != 0 or self.num_local != self.num_groups

  def replace(self, **changes) -> "Case":
    return dataclasses.replace(self, **changes)


def is_fp8(case: Case) -> bool:
  """Whether `case` is trained in fp8 (``quantization=case.quant``, float operands)."""
  return case.quant in FP8_QUANTS


def reproducer(check: str, *args) -> str:
  """A command that reruns one check of one case (from the tests/ directory)."""
  arguments = ", ".join(repr(a) if not isinstance(a, Case) else "c." + repr(a) for a in args)
  return (f"reproduce: cd tests && python -c \"import conftest, combinations as c; "
          f"c.{check}({arguments})\"")


@contextlib.contextmanager
def _reproducible(check: str, *args):
  try:
    yield
  except Exception as err:  # every failure of a check, its reproducer attached
    err.add_note(reproducer(check, *args))
    raise


def documented_refusal(case: Case) -> str | None:
  """Why the docs say `case` is unsupported (gmm may then raise NotImplementedError), or None.

  From `gmm`'s docstring (row operands) and docs/support.md (the implementations' "-"
  cells).
  """
  if case.rows and case.group_type != "m":
    return "row operands need m-grouping"
  if "lhs_indices" in case.rows and (case.transpose_lhs or case.quant == "scaled"):
    return "lhs_indices need an untransposed float lhs"
  if case.rows and case.quant == "scaled":
    return "row operands with quantized weights are weight-only only"
  if is_fp8(case) and (case.group_type != "m" or case.transpose_lhs):
    return "fp8 training covers m-grouped gmms with an untransposed lhs"
  if case.lhs_activation and (case.group_type != "m" or case.transpose_lhs
                              or case.quant not in ("none",) + FP8_QUANTS
                              or "lhs_indices" in case.rows):
    return ("lhs_activation needs an m-grouped float lhs, not transposed or gathered (fp8 "
            "training included)")
  if case.implementation == "pallas_mosaic_gpu":
    # The draws run the kernels in Pallas's plain interpret mode, which the Mosaic GPU kernel
    # refuses (it runs under jax's GPU simulator: tests/test_simulators.py and
    # tests/test_pallas_mosaic_gpu*.py); it also refuses k-grouping, f32, a transposed lhs
    # and quantized operands other than blocked fp8.
    return "Mosaic GPU in plain interpret mode, or a mode its kernel refuses"
  return None


@functools.lru_cache(maxsize=None)
def available_implementations() -> tuple[str, ...]:
  """The implementations whose plain interpret mode this jax runs through `gmm`.

  A tiny bf16 m-grouped call each (the mode every kernel serves): Mosaic GPU refuses plain
  interpret mode (only jax's GPU simulator runs it), so its value is skipped here.
  """
  lhs = jnp.ones((8, 8), jnp.bfloat16)
  rhs = jnp.ones((1, 8, 8), jnp.bfloat16)
  served = []
  for name in IMPLEMENTATIONS:
    try:
      gmm_jax.gmm(lhs, rhs, jnp.asarray([8], jnp.int32), implementation=name,
                  interpret=name.startswith("pallas"))
    except NotImplementedError:
      continue
    served.append(name)
  return tuple(served)


# An empty local k-group with a bias, past a group_offset: its result is activation(bias[g])
# and its bias gradient sum(ct * activation'(bias[g])). The draws meet it only by chance
# (group_type, bias, group_offset and an empty local group all drawn), so the tests add
# it for every implementation as an explicit example (`for_each_implementation`).
EMPTY_K_GROUP = Case(group_type="k", m=8, k=16, n=8, sizes=(6, 0, 5, 3), group_offset=1,
                     num_local=2, bias=True, activation="silu", seed=1)


def for_each_implementation(case: Case) -> list[Case]:
  """`case` for each of IMPLEMENTATIONS that the docs say serves it."""
  return [c for c in (case.replace(implementation=name) for name in IMPLEMENTATIONS)
          if documented_refusal(c) is None]


# ------------------------------------------------------------------------------ drawing


@st.composite
def group_sizes(draw, num_groups: int, dim: int) -> tuple[int, ...]:
  """G sizes summing to at most `dim`: cut points of a drawn total (empty groups when two
  coincide, rows past the total when it is short of `dim`)."""
  total = draw(st.integers(0, dim))
  cuts = sorted(draw(st.lists(st.integers(0, total), min_size=num_groups - 1,
                              max_size=num_groups - 1)))
  bounds = [0] + cuts + [total]
  return tuple(b - a for a, b in zip(bounds, bounds[1:]))


@st.composite
def cases(draw, *, implementations=None, group_types=("m", "k"), activations=ACTIVATIONS,
          dtypes=DTYPES, quants=QUANT_MODES, rows=True, empty_local_group=False,
          lhs_activations=(None,) + GATED_NAMES) -> Case:
  """Draws a `Case` that the documentation says gmm serves.

  Args:
    implementations: names to draw from (default: `available_implementations()`).
    group_types, activations, dtypes, quants: the values to draw from.
    rows: whether m-grouped cases may have row operands.
    empty_local_group: force at least one locally held group to be empty.
    lhs_activations: the gated prologues to draw (where the case allows one: m-grouping,
      an untransposed float lhs that is not gathered).
  """
  implementation = draw(st.sampled_from(implementations or available_implementations()))
  group_type = draw(st.sampled_from(group_types))
  activation = draw(st.sampled_from(activations))
  m, k, n, num_groups = draw(st.sampled_from(shapes_for(implementation, group_type,
                                                        activation)))
  quant = draw(st.sampled_from(quants))
  row_operands = ()
  if rows and group_type == "m" and quant != "scaled":
    row_operands = tuple(name for name in ROW_OPERANDS if draw(st.booleans()))
  transpose_lhs = draw(st.booleans()) and "lhs_indices" not in row_operands
  num_local = draw(st.integers(1, num_groups))
  group_offset = draw(st.integers(0, num_groups - num_local))
  sizes = list(draw(group_sizes(num_groups, m if group_type == "m" else k)))
  if empty_local_group:
    sizes[group_offset + draw(st.integers(0, num_local - 1))] = 0
  case = Case(
      implementation=implementation, group_type=group_type, transpose_lhs=transpose_lhs,
      transpose_rhs=draw(st.booleans()), activation=activation, bias=draw(st.booleans()),
      rows=row_operands, group_offset=group_offset, num_local=num_local, quant=quant,
      dtype=draw(st.sampled_from(dtypes)), m=m, k=k, n=n, sizes=tuple(sizes),
      out_rows=m * draw(st.sampled_from((1, 2))) if "out_indices" in row_operands else m,
      seed=draw(st.integers(0, 2**16)))
  prologue_allowed = (group_type == "m" and not transpose_lhs and quant == "none"
                      and "lhs_indices" not in row_operands)
  if prologue_allowed:
    case = case.replace(lhs_activation=draw(st.sampled_from(lhs_activations)))
  hypothesis.assume(documented_refusal(case) is None)
  return case


def vmap_operands(case: Case) -> tuple[str, ...]:
  """The operands of `case` a vmap may batch."""
  names = ["lhs", "rhs", "group_sizes"]
  names += ["bias"] if case.bias else []
  names += list(case.rows)
  names += ["group_offset"] if case.pass_group_offset else []
  return tuple(names)


@st.composite
def vmap_cases(draw, *, strategy=None, operands=None, **case_options
               ) -> tuple[Case, str, tuple]:
  """(case, batched operand, its batch of group sizes or offsets where it is one).

  Args:
    strategy: the cases to draw (default: ``cases(**case_options)``).
    operands: the operands to batch (default: any of `vmap_operands`).
  """
  case = draw(cases(**case_options) if strategy is None else strategy)
  operand = draw(st.sampled_from(operands or vmap_operands(case)))
  batch = ()
  if operand == "group_sizes":
    dim = case.m if case.group_type == "m" else case.k
    batch = (case.sizes,) + tuple(
        draw(group_sizes(case.num_groups, dim)) for _ in range(BATCH - 1))
  elif operand == "group_offset":
    batch = (case.group_offset,) + tuple(
        draw(st.integers(0, case.num_groups)) for _ in range(BATCH - 1))
  return case, operand, batch


def _stored_shapes(case: Case) -> dict[str, tuple[int, ...]]:
  """The stored shape of each array operand (a QArray's values)."""
  shapes = {"group_sizes": (case.num_groups,)}
  shapes["lhs"] = (case.k, case.tokens) if case.transpose_lhs else (case.tokens,
                                                                      case.lhs_cols)
  matrix = (case.rhs_cols, case.k) if case.transpose_rhs else (case.k, case.rhs_cols)
  shapes["rhs"] = ((case.num_local,) + matrix) if case.group_type == "m" else matrix
  if case.bias:
    shapes["bias"] = (case.num_local, case.rhs_cols)
  for name in case.rows:
    shapes[name] = (case.m,)
  return shapes


@st.composite
def sharded_cases(draw, **case_options) -> tuple[Case, str, tuple, str]:
  """(case, mesh name, placements, axis types): one or two operand dimensions, each split
  over mesh axes whose size divides it; placements are ``(operand, dim, axes)``; the mesh's
  axes "auto" (plain jit: the partitioner splits the gmm) or "explicit" (the layout in the
  types, under `jax.set_mesh`: the gmm splits itself at trace time)."""
  case = draw(cases(**case_options))
  mesh_name = draw(st.sampled_from(tuple(MESHES)))
  mesh_shape, axis_names = MESHES[mesh_name]
  axis_sizes = dict(zip(axis_names, mesh_shape))
  choices = []
  for operand, shape in _stored_shapes(case).items():
    for dim, size in enumerate(shape):
      for axes in list(axis_names) + ([tuple(axis_names)] if len(axis_names) > 1 else []):
        count = math.prod(axis_sizes[a] for a in (axes if isinstance(axes, tuple) else (axes,)))
        if size % count == 0:
          choices.append((operand, dim, axes))
  hypothesis.assume(choices)
  first = draw(st.sampled_from(choices))
  placements = [first]
  if draw(st.booleans()):
    # A second dimension on axes the first does not use (a spec names each axis once).
    used = set(first[2] if isinstance(first[2], tuple) else (first[2],))
    rest = [c for c in choices if c[0] != first[0] and not used & set(
        c[2] if isinstance(c[2], tuple) else (c[2],))]
    if rest:
      placements.append(draw(st.sampled_from(rest)))
  return case, mesh_name, tuple(placements), draw(st.sampled_from(("auto", "explicit")))


# ---------------------------------------------------------------------------- operands


def _uniform(rng, shape, low=-1.0, high=1.0):
  return rng.uniform(low, high, shape).astype(np.float32)


def _n_axis(case: Case) -> int:
  """The output-column axis of the stored rhs."""
  return (case.group_type == "m") + (0 if case.transpose_rhs else 1)


def make_operands(case: Case, seed_offset: int = 0) -> dict[str, Any]:
  """The operands of `case`: lhs, rhs (QArrays when quantized), group_sizes and, where the
  case has them, bias and row operands; None otherwise. Magnitudes stay small (|z| < 3 in
  the accumulator) so activations are smooth and finite differences are accurate."""
  rng = np.random.default_rng(case.seed + 7919 * seed_offset)
  dtype = jnp.dtype(case.dtype)
  shapes = _stored_shapes(case)
  lhs = _uniform(rng, shapes["lhs"])
  rhs = _uniform(rng, shapes["rhs"]) * math.sqrt(3.0 / case.k)
  if is_fp8(case):
    lhs, rhs = _fp8_magnitudes(case, lhs, rhs)
  lhs, rhs = jnp.asarray(lhs, dtype), jnp.asarray(rhs, dtype)
  if case.quant in ("weight_only", "scaled"):
    rhs = gmm_jax.quantize(rhs, jnp.int8, channelwise_axes=(0, _n_axis(case))
                           if case.group_type == "m" else (_n_axis(case),), scale_dtype=dtype)
  if case.quant == "scaled":  # per token (the M axis of the stored lhs)
    lhs = gmm_jax.quantize(lhs, jnp.int8, channelwise_axes=(int(case.transpose_lhs),),
                           scale_dtype=dtype)
  ops = {"lhs": lhs, "rhs": rhs, "group_sizes": jnp.asarray(case.sizes, jnp.int32),
         "bias": None, "lhs_indices": None, "row_weights": None, "out_indices": None,
         "group_offset": None}
  if case.bias:
    ops["bias"] = jnp.asarray(_uniform(rng, shapes["bias"]), dtype)
  if "lhs_indices" in case.rows:
    ops["lhs_indices"] = jnp.asarray(rng.permutation(np.arange(case.m) % case.tokens),
                                     jnp.int32)
  if "row_weights" in case.rows:
    ops["row_weights"] = jnp.asarray(_uniform(rng, (case.m,), 0.0, 1.0), dtype)
  if "out_indices" in case.rows:
    ops["out_indices"] = jnp.asarray(rng.permutation(case.out_rows)[:case.m], jnp.int32)
  if case.pass_group_offset:
    ops["group_offset"] = case.group_offset
  return ops


def float_operands(case: Case) -> tuple[str, ...]:
  """The operands gradients are taken for (QArrays and integers have none)."""
  names = []
  names += ["lhs"] if case.quant != "scaled" else []
  names += ["rhs"] if case.quant == "none" or is_fp8(case) else []
  names += ["bias"] if case.bias else []
  names += ["row_weights"] if "row_weights" in case.rows else []
  return tuple(names)


def apply(case: Case, ops: dict[str, Any], **options):
  """`gmm_jax.gmm` on `ops` with the options of `case` (and any other `options`)."""
  return gmm_jax.gmm(
      ops["lhs"], ops["rhs"], ops["group_sizes"], group_type=case.group_type,
      num_groups=case.num_local if case.group_type == "k" else None, bias=ops["bias"],
      activation=case.activation, transpose_lhs=case.transpose_lhs,
      transpose_rhs=case.transpose_rhs, group_offset=ops["group_offset"],
      implementation=case.implementation, interpret=case.implementation.startswith("pallas"),
      lhs_indices=ops["lhs_indices"], row_weights=ops["row_weights"],
      out_indices=ops["out_indices"],
      out_rows=case.out_rows if "out_indices" in case.rows else None,
      quantization=case.quant if is_fp8(case) else None,
      lhs_activation=case.lhs_activation, **options)


@functools.lru_cache(maxsize=256)
def jitted(case: Case) -> Callable:
  """One compiled `apply` per case (the loops of the vmap properties reuse it)."""
  return jax.jit(functools.partial(apply, case))


def _loss(case: Case, params: dict, others: dict, cotangent):
  out = apply(case, {**others, **params})
  return jnp.sum(out.astype(jnp.float32) * cotangent)


@functools.lru_cache(maxsize=256)
def jitted_grad(case: Case) -> Callable:
  """``(params, others, cotangent) -> d<out, cotangent>/d params``, compiled."""
  return jax.jit(jax.grad(functools.partial(_loss, case)))


def split(case: Case, ops: dict) -> tuple[dict, dict]:
  """(float operands, the rest)."""
  params = {name: ops[name] for name in float_operands(case)}
  return params, {name: v for name, v in ops.items() if name not in params}


def cotangent(case: Case, seed_offset: int = 0) -> jax.Array:
  rng = np.random.default_rng(case.seed + 104729 + seed_offset)
  return jnp.asarray(_uniform(rng, case.out_shape))


def call(case: Case, fn: Callable, *args):
  """fn(*args); a NotImplementedError is a failure unless the docs say `case` is
  unsupported (then the example is rejected)."""
  try:
    return fn(*args)
  except NotImplementedError as err:
    if documented_refusal(case) is not None:
      hypothesis.reject()
    raise AssertionError(f"gmm raised NotImplementedError for a combination the docs say "
                         f"is supported: {err}") from err


# ------------------------------------------------------------------------------ oracle


def _dequantized(x) -> np.ndarray:
  """float64 values of an operand; a QArray's scale broadcasts (channelwise or per-tensor),
  computed here rather than with gmm_jax.dequantize."""
  if isinstance(x, gmm_jax.QArray):
    return f64(x.qvalue) * f64(x.scale)
  return f64(x)


def oracle(case: Case, ops: dict) -> np.ndarray:
  """float64 expected result of `apply(case, ops)` (ops' group sizes and offset)."""
  lhs, rhs = _dequantized(ops["lhs"]), _dequantized(ops["rhs"])
  sizes = np.asarray(ops["group_sizes"])
  offset = 0 if ops["group_offset"] is None else int(ops["group_offset"])
  bias = None if ops["bias"] is None else f64(ops["bias"])
  rhs = np.swapaxes(rhs, -1, -2) if case.transpose_rhs else rhs
  if case.group_type == "m":
    lhs = _prologue(case, lhs.T if case.transpose_lhs else lhs)
    as_np = lambda x: None if x is None else np.asarray(x)  # noqa: E731
    return rows_oracle(lhs, rhs, sizes, lhs_indices=as_np(ops["lhs_indices"]),
                       row_weights=None if ops["row_weights"] is None else f64(
                           ops["row_weights"]),
                       out_indices=as_np(ops["out_indices"]),
                       out_rows=case.out_rows if "out_indices" in case.rows else None,
                       bias=bias, activation=case.activation, group_offset=offset,
                       num_local=case.num_local)
  out = gmm_oracle(lhs, rhs, sizes, "k", bias=bias,
                   activation=None if case.gated else case.activation,
                   transpose_lhs=case.transpose_lhs, group_offset=offset,
                   num_local=case.num_local)
  return GATED[case.activation](out) if case.gated else out


def _prologue(case: Case, lhs: np.ndarray) -> np.ndarray:
  """The product's lhs of an m-grouped case: a gated prologue in f32, rounded to lhs's
  dtype (float64 `lhs` ``[M, 2K]`` untransposed), else lhs."""
  if not case.lhs_activation:
    return lhs
  return f64(jnp.asarray(GATED[case.lhs_activation](lhs).astype(np.float32),
                         jnp.dtype(case.dtype)))


def oracle_vjp(case: Case, ops: dict, cot, bound: bool = False) -> dict[str, np.ndarray]:
  """float64 gradients of ``<apply(case, ops), cot>`` by float operand (`float_operands`),
  in their stored layouts; with `bound`, each entry's sum of |terms| instead (the
  magnitude of `gradient_bound`)."""
  lhs, rhs = _dequantized(ops["lhs"]), _dequantized(ops["rhs"])
  sizes = np.asarray(ops["group_sizes"])
  offset = 0 if ops["group_offset"] is None else int(ops["group_offset"])
  if case.group_type == "k":
    dlhs, drhs, dbias = gmm_oracle_vjp(
        lhs, rhs, sizes, "k", cot, bias=ops["bias"], activation=case.activation,
        transpose_lhs=case.transpose_lhs, transpose_rhs=case.transpose_rhs,
        group_offset=offset, num_local=case.num_local, bound=bound)
    grads = {"lhs": dlhs, "rhs": drhs, "bias": dbias}
  else:
    lhs = lhs.T if case.transpose_lhs else lhs
    prologue, prologue_vjp = activation_rules(case.lhs_activation, bound)
    as_np = lambda x: None if x is None else np.asarray(x)  # noqa: E731
    grads = rows_oracle_vjp(
        prologue(np.abs(lhs)) if bound else _prologue(case, lhs),
        np.swapaxes(rhs, -1, -2) if case.transpose_rhs else rhs, sizes, cot,
        lhs_indices=as_np(ops["lhs_indices"]), row_weights=ops["row_weights"],
        out_indices=as_np(ops["out_indices"]), bias=ops["bias"], activation=case.activation,
        group_offset=offset, num_local=case.num_local, bound=bound)
    grads["lhs"] = prologue_vjp(np.abs(lhs) if bound else lhs, grads["lhs"])
    grads["lhs"] = grads["lhs"].T if case.transpose_lhs else grads["lhs"]
    grads["rhs"] = np.swapaxes(grads["rhs"], -1, -2) if case.transpose_rhs else grads["rhs"]
  return {name: grads[name] for name in float_operands(case)}


def unwritten_rows(case: Case, ops: dict) -> np.ndarray:
  """Boolean ``[result rows]`` (m-grouping): rows no local group writes, exactly 0."""
  offset = 0 if ops["group_offset"] is None else int(ops["group_offset"])
  local = local_rows(np.asarray(ops["group_sizes"]), case.m, offset, case.num_local)
  if ops["out_indices"] is None:
    return ~local
  written = np.zeros(case.result_rows, bool)
  written[np.asarray(ops["out_indices"])[local]] = True
  return ~written


def tolerance(case: Case, k: int | None = None) -> dict[str, float]:
  dtypes = [case.dtype, case.out_dtype]
  return tolerances(*dtypes, k=case.k if k is None else k)


def _grad_tolerance(case: Case) -> dict[str, float]:
  # A gradient contracts over M, N or K (dlhs over N, drhs and dbias over the rows).
  return tolerance(case, k=max(case.m, case.k, case.rhs_cols))


def gradient_bound(case: Case, magnitude) -> np.ndarray:
  """`rounding_bound` of a gradient of `case` whose entries' sums of |terms| are
  `magnitude` (``oracle_vjp(..., bound=True)``): an entry adds up its pre-activation (K
  terms), then its own sum (the rows of a group or all M for drhs and dbias, N for dlhs
  and a row weight), then at most two more (a token read twice, the tangents of three
  operands)."""
  return rounding_bound(magnitude, case.dtype, case.out_dtype,
                        length=case.k + max(case.m, case.k, case.rhs_cols) + 2)


def assert_close(got, want, tol, what: str):
  got, want = f64(got), f64(want)
  assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
  np.testing.assert_allclose(got, want, err_msg=what, **tol)


def assert_within(got, want, bound, what: str):
  """|got - want| <= bound entrywise (float64 arrays of one shape; NaN is never within)."""
  got, want = f64(got), f64(want)
  assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
  error = np.abs(got - want)
  outside = ~(error <= bound)
  if np.any(outside):
    worst = np.unravel_index(np.argmax(np.where(outside, error / np.maximum(bound, 1e-300),
                                                -1.0)), got.shape)
    raise AssertionError(
        f"{what}: {np.count_nonzero(outside)} of {got.size} entries outside their rounding "
        f"bound; worst at {tuple(int(i) for i in worst)}: got {got[worst]!r}, want "
        f"{want[worst]!r}, |difference| {error[worst]:.3g} > bound {bound[worst]:.3g}")


def assert_bitwise(got, want, what: str):
  got, want = np.asarray(got), np.asarray(want)
  assert got.dtype == want.dtype and got.shape == want.shape, what
  assert got.tobytes() == want.tobytes(), (
      f"{what}: not bitwise equal (max abs difference "
      f"{np.max(np.abs(f64(got) - f64(want))) if got.size else 0})")


# -------------------------------------------------------------------------- properties


def check_oracle(case: Case):
  """gmm equals the float64 numpy oracle, in the documented dtype and shape; rows no local
  group writes are exactly 0."""
  with _reproducible("check_oracle", case):
    ops = make_operands(case)
    out = call(case, jitted(case), ops)
    assert out.shape == case.out_shape and out.dtype == case.out_dtype, (
        f"{jax.typeof(out)}, want {case.out_dtype}{list(case.out_shape)}")
    want = oracle(case, ops)
    assert_close(out, want, tolerance(case), "gmm vs the float64 oracle")
    if case.group_type == "m":
      assert not np.any(f64(out)[unwritten_rows(case, ops)]), "unwritten rows are not 0"


def check_gated_halves(case: Case):
  """A gated activation equals its gate applied (in numpy) to the two halves of the same call
  with no activation: ``gate(z[:, :N]) * z[:, N:]``, then the row weights."""
  assert case.gated, case
  with _reproducible("check_gated_halves", case):
    ops = make_operands(case)
    # The halves in f32, so that only the gated call's own rounding is compared.
    ungated = case.replace(activation=None,
                           rows=tuple(r for r in case.rows if r != "row_weights"))
    halves = call(case, jax.jit(functools.partial(apply, ungated,
                                                  preferred_element_type=jnp.float32)),
                  {**ops, "row_weights": None})
    want = GATED[case.activation](f64(halves))
    if ops["row_weights"] is not None:
      weights = f64(ops["row_weights"])
      if ops["out_indices"] is not None:  # each weight goes where its row is written
        by_row = np.zeros(case.result_rows)
        by_row[np.asarray(ops["out_indices"])] = weights
        weights = by_row
      want = want * weights[:, None]
    got = call(case, jitted(case), ops)
    assert_close(got, want, tolerance(case), f"{case.activation} vs the gate of the halves")


def _batched(case: Case, operand: str, batch: tuple) -> tuple[list[dict], Any]:
  """BATCH operand dicts differing in `operand`, and that operand stacked."""
  base = make_operands(case)
  if operand == "group_sizes":
    values = [jnp.asarray(s, jnp.int32) for s in batch]
  elif operand == "group_offset":
    values = [jnp.asarray(o, jnp.int32) for o in batch]
  else:
    values = [base[operand]] + [make_operands(case, seed_offset=i)[operand]
                                for i in range(1, BATCH)]
  stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *values)
  return [{**base, operand: v} for v in values], stacked


def _with_offsets(case: Case, ops: dict) -> dict:
  # A traced group_offset skips the concrete validation; give each loop call a concrete one.
  if isinstance(ops["group_offset"], jax.Array):
    return {**ops, "group_offset": int(ops["group_offset"])}
  return ops


def check_vmap(case: Case, operand: str, batch: tuple = ()):
  """vmap over one operand equals a Python loop over its batch."""
  with _reproducible("check_vmap", case, operand, batch):
    each, stacked = _batched(case, operand, batch)
    base = each[0]
    mapped = call(case, jax.jit(jax.vmap(
        lambda value: apply(case, {**base, operand: value}))), stacked)
    for i, ops in enumerate(each):
      want = call(case, jitted(case), _with_offsets(case, ops))
      assert_close(mapped[i], want, tolerance(case),
                   f"vmap over {operand}: batch element {i} vs a loop")


def check_grad_of_vmap(case: Case, operand: str, batch: tuple = ()):
  """The gradient of a vmapped call (summed over the batch) equals the loop of gradients:
  the batched operand's gradient stacks, the others' add up."""
  with _reproducible("check_grad_of_vmap", case, operand, batch):
    each, stacked = _batched(case, operand, batch)
    params, others = split(case, each[0])
    assert params, "the property needs a float operand (the strategies draw only such cases)"
    cot = jnp.stack([cotangent(case, i) for i in range(BATCH)])
    rest = {name: v for name, v in params.items() if name != operand}

    def loss(rest, value):
      def one(value, cot_i):
        ops = {**others, **rest, operand: value}
        return jnp.sum(apply(case, ops).astype(jnp.float32) * cot_i)
      return jnp.sum(jax.vmap(one)(value, cot))

    if operand in params:
      got_rest, got_operand = call(case, jax.jit(jax.grad(loss, argnums=(0, 1))), rest,
                                   stacked)
      got = {**got_rest, operand: got_operand}
    else:
      got = call(case, jax.jit(jax.grad(loss)), rest, stacked)
    loops = []
    for i, ops in enumerate(each):
      p, o = split(case, _with_offsets(case, ops))
      loops.append(call(case, jitted_grad(case), p, o, cot[i]))
    for name in params:
      if name == operand:
        want = jnp.stack([g[name] for g in loops])
      else:
        want = sum(f64(g[name]) for g in loops)
      assert_close(got[name], want, _grad_tolerance(case),
                   f"d/d{name} of vmap over {operand} vs the loop of gradients")


def _mesh(name: str, axis_types: str = "auto") -> Mesh:
  shape, names = MESHES[name]
  devices = jax.devices()[:math.prod(shape)]
  assert len(devices) == math.prod(shape), "tests/conftest.py sets 8 host CPU devices"
  kind = {"auto": jax.sharding.AxisType.Auto, "explicit": jax.sharding.AxisType.Explicit}
  return Mesh(np.array(devices).reshape(shape), names,
              axis_types=(kind[axis_types],) * len(names))


def _place(value, ndim_spec: list, mesh: Mesh):
  """device_put with the spec; a QArray's scale is split where it has the full size."""
  if isinstance(value, gmm_jax.QArray):
    scale_spec = [s if value.scale.shape[d] == value.qvalue.shape[d] else None
                  for d, s in enumerate(ndim_spec)]
    return gmm_jax.QArray(_place(value.qvalue, ndim_spec, mesh),
                          _place(value.scale, scale_spec, mesh), tile=value.tile)
  return jax.device_put(value, NamedSharding(mesh, P(*ndim_spec)))


def placed(case: Case, ops: dict, mesh_name: str, placements: tuple,
           axis_types: str = "auto") -> dict:
  """`ops` on the mesh: each placement's dimension split, every other one replicated."""
  mesh = _mesh(mesh_name, axis_types)
  specs = {}
  for operand, dim, axes in placements:
    value = ops[operand]
    ndim = len(value.shape)
    specs.setdefault(operand, [None] * ndim)[dim] = axes
  out = dict(ops)
  for name, value in ops.items():
    if isinstance(value, (jax.Array, gmm_jax.QArray)):
      out[name] = _place(value, specs.get(name, [None] * len(value.shape)), mesh)
  return out


def check_sharded(case: Case, mesh_name: str, placements: tuple, axis_types: str = "auto"):
  """Under plain jit, operands split over the mesh give the unsharded result, forward and
  gradients: on Auto axes (the partitioner splits the gmm) or on Explicit ones under
  `jax.set_mesh` (the gmm splits itself at trace time by the operands' types)."""
  with _reproducible("check_sharded", case, mesh_name, placements, axis_types):
    ops = make_operands(case)
    on_mesh = placed(case, ops, mesh_name, placements, axis_types)
    context = (jax.set_mesh(_mesh(mesh_name, axis_types)) if axis_types == "explicit"
               else contextlib.nullcontext())
    want = call(case, jitted(case), ops)
    with context:
      got = call(case, jitted(case), on_mesh)
    assert_close(got, want, tolerance(case), f"forward sharded {placements}")
    params, others = split(case, ops)
    if not params:
      return
    cot = cotangent(case)
    want_grads = call(case, jitted_grad(case), params, others, cot)
    with context:
      got_grads = call(case, jitted_grad(case), *split(case, on_mesh), cot)
    for name in params:
      assert_close(got_grads[name], want_grads[name], _grad_tolerance(case),
                   f"d/d{name} sharded {placements}")


# Central differences in f32 with step EPS: the truncation error is ~EPS^2 |f'''| / 6
# (< 1e-4 for these smooth activations at |z| < 3) and the rounding error ~2^-24 |f| / EPS
# (~1e-5); FD_TOLERANCE bounds both with a margin.
EPS = 1e-2
FD_TOLERANCE = dict(rtol=2e-3, atol=2e-3)


def _tangent_problem(case: Case, seed: int):
  """(float operands, random tangents for them, ``params -> gmm``) of an f32 case."""
  assert case.dtype == "float32", case
  ops = make_operands(case)
  params, others = split(case, ops)
  assert params, "the property needs a float operand (the strategies draw only such cases)"
  rng = np.random.default_rng(case.seed + seed)
  tangents = {k: jnp.asarray(_uniform(rng, v.shape), v.dtype) for k, v in params.items()}
  return params, tangents, lambda p: apply(case, {**others, **p})


def check_jvp_fd(case: Case):
  """jax.jvp along random tangents of every float operand equals a central finite
  difference (f32 cases)."""
  with _reproducible("check_jvp_fd", case):
    params, tangents, f = _tangent_problem(case, seed=1)
    out, jvp = call(case, jax.jit(lambda p, t: jax.jvp(f, (p,), (t,))), params, tangents)
    step = lambda s: {k: v + s * tangents[k] for k, v in params.items()}  # noqa: E731
    forward = jax.jit(f)
    plus, minus = call(case, forward, step(EPS)), call(case, forward, step(-EPS))
    want = (f64(plus) - f64(minus)) / (2 * EPS)
    assert_close(out, call(case, forward, params), tolerance(case), "jvp's primal")
    assert_close(jvp, want, FD_TOLERANCE, "jvp vs a central finite difference")


def check_vjp_adjoint(case: Case):
  """Reverse mode is the adjoint of forward mode, checked in float64 (f32 cases): for random
  tangents t of the float operands and a random cotangent c of the result, ``<c, jvp(t)>``
  and ``<vjp(c), t>`` both equal ``<oracle_vjp(c), t>``, within the rounding of their sums
  (``<gradient_bound of the sums of |terms| at c, |t|>``: a few f32 ulps of them). With
  `check_jvp_fd` (jvp = a finite difference) it checks every transpose rule against a
  definition."""
  with _reproducible("check_vjp_adjoint", case):
    params, tangents, f = _tangent_problem(case, seed=2)
    ops = make_operands(case)
    cot = cotangent(case, seed_offset=3)
    _, jvp = call(case, jax.jit(lambda p, t: jax.jvp(f, (p,), (t,))), params, tangents)
    grads = call(case, jax.jit(jax.grad(lambda p: jnp.sum(
        f(p).astype(jnp.float32) * cot))), params)
    want, magnitude = oracle_vjp(case, ops, cot), oracle_vjp(case, ops, cot, bound=True)
    exact = sum(float(np.sum(want[k] * f64(tangents[k]))) for k in params)
    bound = sum(float(np.sum(gradient_bound(case, magnitude[k]) * np.abs(f64(tangents[k]))))
                for k in params)
    forward = float(np.sum(f64(jvp) * f64(cot)))
    reverse = sum(float(np.sum(f64(grads[k]) * f64(tangents[k]))) for k in params)
    assert abs(forward - exact) <= bound and abs(reverse - exact) <= bound, (
        f"<c, jvp(t)> = {forward!r} and <vjp(c), t> = {reverse!r}, but the float64 "
        f"<oracle vjp(c), t> = {exact!r} (rounding bound {bound:.3g})")


def check_grads_oracle(case: Case):
  """Every gradient equals the float64 oracle's (`oracle_vjp`), each entry within the
  rounding bound of its sums (`gradient_bound`: a few ulps of the entry's sum of |terms| in
  f32, bf16's in bf16 cases), in the operand's dtype."""
  with _reproducible("check_grads_oracle", case):
    ops = make_operands(case)
    params, others = split(case, ops)
    assert params, "the property needs a float operand (the strategies draw only such cases)"
    cot = cotangent(case)
    grads = call(case, jitted_grad(case), params, others, cot)
    want, magnitude = oracle_vjp(case, ops, cot), oracle_vjp(case, ops, cot, bound=True)
    for name in params:
      assert grads[name].dtype == params[name].dtype, (name, grads[name].dtype)
      assert_within(grads[name], want[name], gradient_bound(case, magnitude[name]),
                    f"d/d{name} vs the float64 oracle")


def check_jit_eager(case: Case):
  """jit(gmm) equals gmm run eagerly, forward and gradients."""
  with _reproducible("check_jit_eager", case):
    ops = make_operands(case)
    eager = call(case, apply, case, ops)
    assert_close(call(case, jitted(case), ops), eager, tolerance(case, k=1), "jit vs eager")
    params, others = split(case, ops)
    if params:
      cot = cotangent(case)
      eager_grads = call(case, jax.grad(functools.partial(_loss, case)), params, others, cot)
      jit_grads = call(case, jitted_grad(case), params, others, cot)
      for name in params:
        assert_close(jit_grads[name], eager_grads[name], tolerance(case, k=1),
                     f"d/d{name}: jit vs eager")


def check_empty_group_grads(case: Case):
  """What no local group reads gets exactly zero gradient: the weight and bias rows of an
  empty local group (m-grouping), lhs rows (tokens) / contraction columns outside every
  local group, and the row weights of rows no local group owns."""
  with _reproducible("check_empty_group_grads", case):
    ops = make_operands(case)
    params, others = split(case, ops)
    assert params, "the property needs a float operand (the strategies draw only such cases)"
    grads = call(case, jitted_grad(case), params, others, cotangent(case))
    sizes = np.asarray(case.sizes)
    empty = [local for local in range(case.num_local)
             if sizes[case.group_offset + local] == 0]
    dim = case.m if case.group_type == "m" else case.k
    outside = ~local_rows(sizes, dim, case.group_offset, case.num_local)
    if case.group_type == "m":
      if "rhs" in grads:
        drhs = f64(grads["rhs"])
        for local in empty:
          assert not np.any(drhs[local]), f"d/drhs of empty local group {local} is not 0"
      if "bias" in grads:
        dbias = f64(grads["bias"])
        for local in empty:
          assert not np.any(dbias[local]), f"d/dbias of empty local group {local} is not 0"
      if "row_weights" in grads:
        assert not np.any(f64(grads["row_weights"])[outside]), (
            "d/drow_weights of rows of no local group is not 0")
      if "lhs" in grads:
        read = np.zeros(case.tokens, bool)
        indices = (np.arange(case.m) if ops["lhs_indices"] is None
                   else np.asarray(ops["lhs_indices"]))
        read[indices[~outside]] = True
        dlhs = f64(grads["lhs"])
        dlhs = dlhs.T if case.transpose_lhs else dlhs
        assert not np.any(dlhs[~read]), "d/dlhs of tokens no local group reads is not 0"
    else:
      if "rhs" in grads:
        drhs = f64(grads["rhs"])
        drhs = drhs.T if case.transpose_rhs else drhs
        assert not np.any(drhs[outside]), "d/drhs rows outside every local group are not 0"
      if "lhs" in grads:
        dlhs = f64(grads["lhs"])
        dlhs = dlhs.T if case.transpose_lhs else dlhs
        assert not np.any(dlhs[:, outside]), (
            "d/dlhs columns outside every local group are not 0")


def check_bitwise(case: Case):
  """Two runs give bitwise identical results and gradients (`deterministic=True`, the
  default)."""
  with _reproducible("check_bitwise", case):
    ops = make_operands(case)
    params, others = split(case, ops)
    cot = cotangent(case)
    forward = jax.jit(functools.partial(apply, case))
    backward = jax.jit(jax.grad(functools.partial(_loss, case)))
    runs = []
    for _ in range(2):
      out = call(case, forward, ops)
      runs.append((out, call(case, backward, params, others, cot) if params else {}))
    assert_bitwise(runs[0][0], runs[1][0], "forward, two runs")
    for name in params:
      assert_bitwise(runs[0][1][name], runs[1][1][name], f"d/d{name}, two runs")


# ------------------------------------------------------------------------ fp8 training
# ``gmm(..., quantization="fp8" | "fp8_e5m2_grads")`` has draws of its own (`fp8_cases`):
# its blocks need K and N in multiples of 128 (the shapes above are 8 wide), and its
# definition is the blockwise formula of tests/fp8_oracle.py (`fp8_expected`), not the
# float oracle. The transformations: jit and eager (`check_fp8_oracle`), vmap over any
# operand with the gradient of the batch (`check_fp8_vmap`), jvp (`check_fp8_jvp`: refused
# by the custom_vjp), and the calls it refuses (`check_fp8_refused`).

FP8_BLOCK = 128
# (M, K, N, G): two K blocks (of different magnitudes, `_fp8_magnitudes`), or two blocks of
# rows for the weight gradient's 128 x 1 blocks (the second one partial).
FP8_SHAPES = ((40, 256, 128, 3), (160, 128, 128, 2))
# What serves fp8 training on CPU; the kernels' interpret mode compiles slower (`-m slow`).
FP8_IMPLEMENTATIONS = ("xla", "reference")
FP8_KERNELS = ("pallas_tpu", "pallas_triton")
# An activation the oracle differentiates (oracle.ACTIVATION_GRADS) and a gated one.
FP8_ACTIVATIONS = (None, "silu", "gelu_tanh", "swiglu")
FP8_PROLOGUES = ("swiglu", "geglu")  # lhs_activation drawn half the time
FP8_GRAD_DTYPES = {"fp8": fp8_oracle.E4M3, "fp8_e5m2_grads": fp8_oracle.E5M2}


@st.composite
def fp8_cases(draw, *, implementations=FP8_IMPLEMENTATIONS, refused: bool = False) -> Case:
  """Draws a float32 `Case` trained in fp8: m-grouped calls it serves (transpose_rhs, bias,
  activation, row operands, group_offset, group sizes with an empty local group half the
  time), or with ``refused=True`` the calls it refuses (k-grouping or a transposed lhs:
  NotImplementedError, `check_fp8_refused`)."""
  implementation = draw(st.sampled_from(implementations))
  m, k, n, num_groups = draw(st.sampled_from(FP8_SHAPES))
  common = dict(implementation=implementation, quant=draw(st.sampled_from(FP8_QUANTS)),
                transpose_rhs=draw(st.booleans()), bias=draw(st.booleans()),
                activation=draw(st.sampled_from(FP8_ACTIVATIONS)), m=m, k=k, n=n,
                seed=draw(st.integers(0, 2**16)))
  if refused:
    group_type = draw(st.sampled_from(("m", "k")))
    transpose_lhs = group_type == "m" or draw(st.booleans())
    sizes = draw(group_sizes(num_groups, m if group_type == "m" else k))
    return Case(group_type=group_type, transpose_lhs=transpose_lhs, num_local=num_groups,
                sizes=sizes, out_rows=m, **common)
  rows = tuple(name for name in ROW_OPERANDS if draw(st.booleans()))
  # A gated prologue (the MoE down gmm reading z) on calls that do not gather lhs.
  lhs_activation = (None if "lhs_indices" in rows
                    else draw(st.sampled_from((None,) + FP8_PROLOGUES)))
  num_local = draw(st.integers(1, num_groups))
  group_offset = draw(st.integers(0, num_groups - num_local))
  sizes = list(draw(group_sizes(num_groups, m)))
  if draw(st.booleans()):
    sizes[group_offset + draw(st.integers(0, num_local - 1))] = 0
  return Case(rows=rows, num_local=num_local, group_offset=group_offset, sizes=tuple(sizes),
              out_rows=m * draw(st.sampled_from((1, 2))) if "out_indices" in rows else m,
              lhs_activation=lhs_activation, **common)


def _fp8_magnitudes(case: Case, lhs: np.ndarray, rhs: np.ndarray):
  """lhs's K blocks and rhs's N blocks alternately scaled by 1 and 1/4 (numpy), so that a
  scale applied to the wrong block shows."""
  def scaled(x, axis, size):
    factor = 0.25 ** (np.arange(size) // FP8_BLOCK % 2)
    return x * factor.astype(x.dtype).reshape([-1 if a == axis else 1
                                              for a in range(x.ndim)])
  lhs = scaled(lhs, 0 if case.transpose_lhs else 1, case.lhs_cols)
  return lhs, scaled(rhs, _n_axis(case), case.rhs_cols)


@functools.lru_cache(maxsize=None)
def _fp8_quantizer(dtype: np.dtype, blocks: tuple[int, ...]) -> Callable:
  recipe = gmm_jax.Fp8Training(dtype=dtype, block=FP8_BLOCK)
  if len(blocks) == 3:
    return jax.jit(recipe.weights)
  return jax.jit(functools.partial(recipe.activations, axis=blocks.index(FP8_BLOCK)))


def fp8_blocks(x, dtype, blocks, e8m0: bool = False) -> np.ndarray:
  """fp8_oracle's `quantizer` fed gmm_jax's quantized blocks (`Fp8Training.activations` /
  `.weights`, read by numpy: `fp8_oracle.expand`): XLA may round a value to the
  neighbouring fp8 value, so the formula is tested on the library's own blocks (the
  quantization itself: tests/test_fp8_training.py)."""
  assert not e8m0, "the drawn recipes have f32 scales"
  q = _fp8_quantizer(np.dtype(dtype), tuple(blocks))(jnp.asarray(x))
  return fp8_oracle.expand(q.qvalue, q.scale, q.tile)


def _fp8_forward(case: Case, ops: dict) -> dict[str, Any]:
  """The numpy pieces of the forward: the library's blocks of lhs and rhs (dequantized,
  rhs as [G_local, K, N]), each grouped row's token and local group (-1: none), and the
  pre-activation z (float64, 0 on rows of no local group)."""
  assert is_fp8(case) and case.group_type == "m" and not case.transpose_lhs, case
  sizes = [int(s) for s in np.asarray(ops["group_sizes"])]
  offset = 0 if ops["group_offset"] is None else int(ops["group_offset"])
  lhs, rhs = np.asarray(ops["lhs"], np.float32), np.asarray(ops["rhs"], np.float32)
  bias = None if ops["bias"] is None else f64(ops["bias"])
  product = _prologue(case, f64(lhs)).astype(np.float32)  # act(z) of a gated prologue
  # 1 x 128 blocks along K: per token, so quantizing before the gather is the same.
  lhs_q = fp8_blocks(product, fp8_oracle.E4M3, (1, FP8_BLOCK))
  rhs_q = fp8_blocks(rhs, fp8_oracle.E4M3, (1, FP8_BLOCK, FP8_BLOCK))
  rhs_q = np.swapaxes(rhs_q, 1, 2) if case.transpose_rhs else rhs_q
  tokens = (np.arange(case.m) if ops["lhs_indices"] is None
            else np.asarray(ops["lhs_indices"]))
  local = np.full(case.m, -1)
  start = 0
  for g, size in enumerate(sizes):
    if 0 <= g - offset < case.num_local:
      local[start:min(start + size, case.m)] = g - offset
    start += size
  z = np.zeros((case.m, case.rhs_cols))
  for r in np.flatnonzero(local >= 0):
    z[r] = lhs_q[tokens[r]] @ rhs_q[local[r]] + (0.0 if bias is None else bias[local[r]])
  return dict(sizes=sizes, offset=offset, lhs=lhs, product=product, rhs=rhs, lhs_q=lhs_q,
              rhs_q=rhs_q, tokens=tokens, local=local, z=z)


def fp8_gmm_cotangent(case: Case, ops: dict, cot) -> tuple[np.ndarray, np.ndarray | None]:
  """(the cotangent of the fp8 gmm's result z, float64 ``[M, N]`` and 0 on rows of no
  local group; d/d row_weights or None) for the result's cotangent `cot`: back through the
  scatter to out_indices, the row weights and the activation, in numpy."""
  forward = _fp8_forward(case, ops)
  z, held = forward["z"], forward["local"] >= 0
  cot = f64(cot)
  ct = cot[np.asarray(ops["out_indices"])] if ops["out_indices"] is not None else cot
  d_weights = None
  activation, activation_vjp = activation_rules(case.activation)
  if ops["row_weights"] is not None:
    d_weights = np.where(held, np.sum(activation(z) * ct, 1), 0.0)
    ct = ct * f64(ops["row_weights"])[:, None]
  ct_z = activation_vjp(z, ct)
  ct_z[~held] = 0
  return ct_z, d_weights


def fp8_expected(case: Case, ops: dict, cot=None, *, gmm_cotangent=None
                 ) -> tuple[np.ndarray, dict | None]:
  """float64 ``(result, gradients by float operand)`` of `apply(case, ops)` trained in fp8
  (gradients only given the result's cotangent `cot`).

  The fp8 gmm is fp8_oracle's blockwise formula on the library's blocks (`fp8_blocks`):
  forward ``Q(lhs, 1 x 128) Q(rhs, 128 x 128)``, dlhs ``Q(ct, 1 x 128) Q(rhs)^T``, drhs
  ``Q(lhs, 128 x 1)^T Q(ct, 128 x 1)`` over the gathered rows (the cotangent zero on rows
  of no local group). Around it, in numpy: the gather of lhs_indices (its gradient summed
  back per token), bias, activation, row weights and the scatter to out_indices.

  `gmm_cotangent` replaces the fp8 gmm's cotangent (`fp8_gmm_cotangent` of this call): a
  gmm whose result several calls share receives their sum, quantized once.
  """
  forward = _fp8_forward(case, ops)
  sizes, offset = forward["sizes"], forward["offset"]
  out = rows_oracle(forward["lhs_q"], forward["rhs_q"], sizes,
                    lhs_indices=ops["lhs_indices"] if ops["lhs_indices"] is None
                    else np.asarray(ops["lhs_indices"]),
                    row_weights=None if ops["row_weights"] is None
                    else f64(ops["row_weights"]),
                    out_indices=None if ops["out_indices"] is None
                    else np.asarray(ops["out_indices"]),
                    out_rows=case.out_rows if ops["out_indices"] is not None else None,
                    bias=None if ops["bias"] is None else f64(ops["bias"]),
                    activation=case.activation, group_offset=offset,
                    num_local=case.num_local)
  if cot is None:
    return out, None
  ct_z, d_weights = fp8_gmm_cotangent(case, ops, cot)
  ct_z = ct_z if gmm_cotangent is None else gmm_cotangent
  lhs, rhs, tokens = forward["product"], forward["rhs"], forward["tokens"]
  # The formula over all groups, those not held as zero weights (held groups past the
  # list, with a batched group_offset, as empty ones).
  num_all = max(len(sizes), offset + case.num_local)
  full_rhs = np.zeros((num_all,) + rhs.shape[1:], np.float32)
  full_rhs[offset:offset + case.num_local] = rhs
  dx, drhs, dbias = fp8_oracle.fp8_vjp(
      lhs[tokens], full_rhs, sizes + [0] * (num_all - len(sizes)), ct_z.astype(np.float32),
      transpose_rhs=case.transpose_rhs, block=FP8_BLOCK,
      grad_dtype=FP8_GRAD_DTYPES[case.quant], quantizer=fp8_blocks)
  dlhs = np.zeros(lhs.shape)
  np.add.at(dlhs, tokens, dx)
  if case.lhs_activation:  # z's cotangent from act(z)'s, rounded to z's dtype first
    dlhs = activation_rules(case.lhs_activation)[1](
        f64(forward["lhs"]), f64(jnp.asarray(dlhs.astype(np.float32), jnp.dtype(case.dtype))))
  grads = {"lhs": dlhs, "rhs": drhs[offset:offset + case.num_local]}
  if ops["bias"] is not None:
    grads["bias"] = dbias[offset:offset + case.num_local]
  if d_weights is not None:
    grads["row_weights"] = d_weights
  return out, grads


# Relative to the largest expected entry (as tests/test_fp8_training.py): f32 accumulation
# of the same fp8 products. With an activation, the oracle's cotangent of the
# pre-activation is computed in float64 and the library's in f32: where an entry lies at a
# rounding midpoint of its fp8 block, a 1-ulp difference rounds it to the neighbouring fp8
# value (one step, <= 2^-3 of it; rare: within an ulp of a midpoint), which moves one row of dlhs
# and one column of drhs by up to ~1e-2 of the largest entry. Such cases hold every entry
# to FP8_LOOSE and nine in ten to the tight tolerance (a wrong formula moves most).
FP8_TOLERANCE = 2e-5
FP8_LOOSE = 3e-2
FP8_TIGHT_SHARE = 0.9


def assert_fp8_close(got, want, what: str, loose: bool = False):
  got, want = f64(got), f64(want)
  assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
  scale = max(np.max(np.abs(want), initial=0.0), 1e-30)
  if loose and want.size:
    tight = np.mean(np.abs(got - want) <= FP8_TOLERANCE * scale)
    assert tight >= FP8_TIGHT_SHARE, f"{what}: only {tight:.3f} of the entries are close"
  tolerance = FP8_LOOSE if loose else FP8_TOLERANCE
  np.testing.assert_allclose(got, want, rtol=0, atol=tolerance * scale, err_msg=what)


def _loose(case: Case, name: str) -> bool:
  """Whether the gradient `name` goes through an fp8 quantization of the pre-activation's
  cotangent computed in float64 by the oracle, or the result (``"out"``) or a gradient
  through one of act(z) of a gated prologue, which the oracle computes in float64 and the
  library in f32 (see FP8_LOOSE)."""
  if case.lhs_activation and name in ("out", "lhs", "rhs"):
    return True
  return case.activation is not None and name in ("lhs", "rhs")


def check_fp8_oracle(case: Case, jit: bool = True):
  """fp8 training equals its blockwise formula (`fp8_expected`), the result in the
  operands' dtype with rows no local group writes exactly 0, and every gradient (one
  `jax.vjp`, under jit or eagerly)."""
  with _reproducible("check_fp8_oracle", case, jit):
    ops = make_operands(case)
    params, others = split(case, ops)
    cot = cotangent(case)

    def run(params, cot):
      out, vjp = jax.vjp(lambda p: apply(case, {**others, **p}), params)
      return out, vjp(cot)[0]

    out, grads = (jax.jit(run) if jit else run)(params, cot)
    assert out.shape == case.out_shape and out.dtype == case.out_dtype, (
        f"{jax.typeof(out)}, want {case.out_dtype}{list(case.out_shape)}")
    want, want_grads = fp8_expected(case, ops, cot)
    assert_fp8_close(out, want, "fp8 gmm vs the blockwise formula", _loose(case, "out"))
    assert not np.any(f64(out)[unwritten_rows(case, ops)]), "unwritten rows are not 0"
    for name in params:
      assert grads[name].dtype == params[name].dtype, name
      assert_fp8_close(grads[name], want_grads[name], f"d/d{name} vs the blockwise formula",
                       _loose(case, name))


# Operands applied after the fp8 gmm (`epilogue.finish`): batching only them leaves the
# gmm unbatched.
FP8_AFTER_THE_GMM = ("row_weights", "out_indices")


def check_fp8_vmap(case: Case, operand: str, batch: tuple = ()):
  """vmap over one operand: each batch element's result is its own formula
  (`fp8_expected`), and the gradient of the batch (summed against a cotangent per element)
  stacks the batched operand's gradients and adds up the others'. Batching only operands
  applied after the fp8 gmm (FP8_AFTER_THE_GMM) leaves one gmm, whose backward quantizes
  the sum of the batch's cotangents: the unbatched operands' gradients are then the
  formula's for that sum, not the sum of each element's formula."""
  with _reproducible("check_fp8_vmap", case, operand, batch):
    each, stacked = _batched(case, operand, batch)
    params, _ = split(case, each[0])
    cot = jnp.stack([cotangent(case, i) for i in range(BATCH)])
    rest = {name: v for name, v in params.items() if name != operand}
    batched = operand in params

    def run(rest, value):
      def loss(rest, value):
        out = jax.vmap(lambda v: apply(case, {**each[0], **rest, operand: v}))(value)
        return jnp.sum(out * cot), out
      grads, out = jax.grad(loss, argnums=(0, 1) if batched else 0, has_aux=True)(rest, value)
      return out, ({**grads[0], operand: grads[1]} if batched else grads)

    out, grads = jax.jit(run)(rest, stacked)
    assert out.shape == (BATCH,) + case.out_shape, out.shape
    each = [_with_offsets(case, ops) for ops in each]
    shared = None
    if operand in FP8_AFTER_THE_GMM:
      # The fp8 gmm is not batched: its one result's cotangent is the batch's sum,
      # quantized once (its backward is not linear in it: no loop of gradients).
      shared = sum(fp8_gmm_cotangent(case, ops, cot[i])[0] for i, ops in enumerate(each))
    expected = [fp8_expected(case, ops, cot[i], gmm_cotangent=shared)
                for i, ops in enumerate(each)]
    for i, (want, _) in enumerate(expected):
      assert_fp8_close(out[i], want, f"vmap over {operand}: element {i} vs its formula",
                       _loose(case, "out"))
    for name in params:
      if name == operand:
        for i, (_, want_grads) in enumerate(expected):
          assert_fp8_close(grads[name][i], want_grads[name],
                           f"d/d{name} of vmap over {operand}: element {i} vs its formula",
                           _loose(case, name))
      elif shared is not None and name != "row_weights":  # the one gmm's gradient
        assert_fp8_close(grads[name], expected[0][1][name],
                         f"d/d{name} of vmap over {operand} vs the formula of the summed "
                         f"cotangent", _loose(case, name))
      else:
        assert_fp8_close(grads[name], sum(g[name] for _, g in expected),
                         f"d/d{name} of vmap over {operand} vs the sum of the formulas",
                         _loose(case, name))


def check_fp8_jvp(case: Case, names: tuple[str, ...]):
  """jax.jvp along the float operands `names`: refused with a TypeError naming the
  custom_vjp (forward mode is not defined) when a tangent reaches the fp8 gmm (lhs, rhs,
  bias); along the row weights alone (applied after it) the tangent is the result with
  the tangent as row weights (the result is linear in them)."""
  with _reproducible("check_fp8_jvp", case, names):
    ops = make_operands(case)
    rng = np.random.default_rng(case.seed + 2)
    primals = {name: ops[name] for name in names}
    tangents = {name: jnp.asarray(_uniform(rng, v.shape), v.dtype)
                for name, v in primals.items()}
    run = jax.jit(lambda p, t: jax.jvp(lambda p: apply(case, {**ops, **p}), (p,), (t,)))
    if set(names) & {"lhs", "rhs", "bias"}:
      try:
        run(primals, tangents)
      except TypeError as err:
        assert "forward-mode" in str(err) and "custom_vjp" in str(err), err
        return
      raise AssertionError(f"jvp along {names} of an fp8-trained gmm did not raise")
    out, tangent = run(primals, tangents)
    assert_fp8_close(out, fp8_expected(case, ops)[0], "jvp's primal vs the formula")
    assert_fp8_close(tangent, fp8_expected(case, {**ops, **tangents})[0],
                     "jvp along the row weights vs the formula with them as row weights")


def check_fp8_refused(case: Case):
  """fp8 training refuses k-grouping and a transposed lhs with a NotImplementedError that
  says what it covers and what it got, eagerly and under jit."""
  assert documented_refusal(case) is not None, case
  with _reproducible("check_fp8_refused", case):
    ops = make_operands(case)
    for fn in (functools.partial(apply, case), jitted(case)):
      try:
        fn(ops)
      except NotImplementedError as err:
        message = str(err)
        assert "fp8 training" in message and "m-grouped" in message, message
        assert (f"group_type={case.group_type!r}" in message
                and f"transpose_lhs={case.transpose_lhs}" in message), message
        continue
      raise AssertionError("an fp8 call fp8 training does not cover did not raise")
