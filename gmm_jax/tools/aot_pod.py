"""Compiles whole MoE training steps for multi-chip TPU and GPU topologies without the hardware.

``python -m gmm_jax.tools.aot_pod`` (also ``python -m gmm_jax.tools.aot --pod``) builds, per (model,
topology, strategy), one training step of a `gmm_jax.nn.MoE` layer as a user writes it:
`nnx.split` the layer, ``loss = mean(y**2) + 0.01 * load balancing + 0.001 * z-loss``,
`jax.value_and_grad` over the parameters, an SGD update; bf16 parameters and compute,
4096 tokens per chip sharded over the mesh's ("data", "expert") axes, the expert kernels'
leading dim sharded over "expert", every other parameter (the router, shared experts)
replicated. It lowers and compiles the step (`jax.jit` with ``in_shardings`` and
``out_shardings``, the parameters donated) deviceless for the topology, and prints a row per
step: whether it compiled (or the first line of the error), the compile time, per-device
memory (arguments, outputs, temporaries, and the peak ``args + out + temp - aliased``)
against the chip's HBM, the bytes of each kind of collective, the bytes of all-gathers whose
result is a whole expert weight (a step that gathers its experts does not scale), the gmm
implementations the dispatcher chose and the kernel custom calls in the compiled program.

Strategies:
  default:  ``nn.MoE(...)`` with no mesh arguments under plain jit (the fused path).
  default+set_mesh: the same step, the layer built (``nnx.eval_shape``) and the step traced
            under ``jax.set_mesh(mesh)`` (Auto axes).
  ep:       ``nn.MoE(expert_parallel=(mesh, "expert"), data_parallel=(mesh, ("data",
            "expert")))``: expert parallelism through `gmm_jax.routed_apply`.
  default+blind: the default step given abstract arguments without their sharding (only
            jit's ``in_shardings`` place them), so that the trace sees no mesh: on TPU each
            gmm runs as the dense reference that XLA partitions, elsewhere the routed
            experts are split by their partitioning rule.
  explicit: the mesh's axes Explicit, the layer built (``nnx.eval_shape``) and the step
            traced under ``jax.set_mesh(mesh)``: the layout is in the types.
  unfused:  ``nn.MoE(fused=False)`` under plain jit (sorted copies, gate and up as two gmms).
  grouped_linear: the gradients of one ``nn.GroupedLinear`` of the expert input kernel's
            shape on the tokens as E equal groups, under plain jit.
  default+a2a, ep+a2a: default / ep with ``transport="all_to_all"`` (fixed buffers; libtpu's
            ragged all-to-all refuses TPU slices with limited ICI routing, e.g. v5e 8x8).
  ragged_dot: a baseline without gmm_jax: the same MoE math (router, top-k, tokens sorted by
            expert, ``jax.lax.ragged_dot`` for both projections, shared expert) written here.

Buffer factor (``--buffer-factor``, the gmm_jax strategies): ``nn.MoE(buffer_factor=b)``,
the expert-parallel receive buffers bounded to ``ceil(b * T_shard * k / D)`` rows per source
device (rows past it dropped); ``none`` (the default) is the dropless worst case. Several
values give a row each; the table names a step with a factor ``ep@b=1``.

Mesh: ("data", "expert") with expert = min(#experts, #chips) (``--expert`` overrides it) and
data = #chips / expert: every chip holds E / expert whole experts; tokens are split over all
chips.

Each step compiles in a process of its own, with a time limit (``--timeout``), so that a
hang or a crash is one row of the table. Collective bytes are the result sizes of the
collectives in the compiled program, each counted once where it appears (a collective in a
loop body is not multiplied by the trip count); the async forms count at their ``-done``.

Needs jax >= 0.12 with libtpu (TPU topologies) and the CUDA plugin (GPU topologies), and
flax; ``bash .ci/aot_env.sh`` prints such a virtual environment. Run with
``JAX_PLATFORMS=cpu``.

Usage::

  python -m gmm_jax.tools.aot_pod --small                          # the CI configuration
  python -m gmm_jax.tools.aot_pod --models mixtral --topologies v5e:2x2 h200:1x1x8
  python -m gmm_jax.tools.aot_pod --small --require ep unfused ragged_dot --json rows.json
  python -m gmm_jax.tools.aot_pod --topologies v5e:4x4 --strategies ep --buffer-factor none 1
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import json
import math
import os
import pathlib
import re
import subprocess
import sys
import tempfile
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags
from flax import nnx
from jax._src import custom_partitioning  # noqa: F401  (its plugin callback; private)
from jax._src import xla_bridge  # private: the PJRT plugin registry
from jax._src.lib import xla_client  # private: the PJRT plugin loader
from jax.experimental import topologies
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from gmm_jax import nn
from gmm_jax._src import cli
from gmm_jax._src.backends import registry as dispatch

TARGET_DIR = pathlib.Path(__file__).with_name("targets")
GIB = 2 ** 30


@dataclasses.dataclass(frozen=True)
class Topology:
  """A multi-chip topology jax can describe deviceless, and its chips' memory."""

  platform: str  # "tpu" or "cuda"
  name: str  # the topology as get_topology_desc takes it
  hbm: int  # bytes per chip
  target_config: str | None = None  # GPU: the target description file under targets/


TOPOLOGIES = {
    "v5e:2x2": Topology("tpu", "v5e:2x2", 16 * GIB),
    "v5e:4x4": Topology("tpu", "v5e:4x4", 16 * GIB),
    "v5e:4x8": Topology("tpu", "v5e:4x8", 16 * GIB),
    "v5e:8x8": Topology("tpu", "v5e:8x8", 16 * GIB),
    "v5e:16x16": Topology("tpu", "v5e:16x16", 16 * GIB),
    "v5p:2x2x4": Topology("tpu", "v5p:2x2x4", 95 * GIB),
    "v6e:4x4": Topology("tpu", "v6e:4x4", 32 * GIB),
    # One host with 8 H200s, and two such hosts (141 GB each).
    "h200:1x1x8": Topology("cuda", "1x1x8", 141 * 10 ** 9, "nvidia_h200.txtpb"),
    "h200:2x1x8": Topology("cuda", "2x1x8", 141 * 10 ** 9, "nvidia_h200.txtpb"),
}
DEFAULT_TOPOLOGIES = ("v5e:2x2", "v5e:4x4", "v5e:16x16", "v5p:2x2x4", "h200:1x1x8",
                      "h200:2x1x8")
SMALL_TOPOLOGIES = ("v5e:2x2", "h200:1x1x8")


@dataclasses.dataclass(frozen=True)
class Model:
  """A `nn.MoE` preset, optionally shrunk, and the tokens each chip trains on."""

  preset: str
  scale: float = 1.0
  tokens_per_chip: int = 4096
  overrides: tuple[tuple[str, object], ...] = ()


MODELS = {
    "mixtral": Model("mixtral-8x7b"),
    "deepseek-v3": Model("deepseek-v3"),
    # Small shapes: the same routing and expert counts, widths / 16, 256 tokens per chip.
    "mixtral-small": Model("mixtral-8x7b", scale=1 / 16, tokens_per_chip=256),
    "deepseek-v3-small": Model("deepseek-v3", scale=1 / 16, tokens_per_chip=256),
}
DEFAULT_MODELS = ("mixtral", "deepseek-v3")
# --small (CI): one small model, 2-3 minutes for every strategy on the small topologies.
SMALL_MODELS = ("mixtral-small",)
STRATEGIES = ("default", "default+set_mesh", "explicit", "ep", "unfused", "grouped_linear",
              "ragged_dot", "default+blind", "default+a2a", "ep+a2a")
# The strategies without nn.MoE: a buffer factor does not apply to them.
BASELINES = ("ragged_dot",)
DEFAULT_STRATEGIES = STRATEGIES[:8]  # the "+a2a" variants on request
# The strategies whose layer is built (`nnx.eval_shape`) and whose step is traced under
# ``jax.set_mesh(mesh)``, and the axis types of their mesh.
IN_MESH = {"default+set_mesh": "Auto", "explicit": "Explicit"}
LEARNING_RATE = 1e-3
# The collectives counted, as XLA's HLO names them (their async forms end at "-done").
COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "ragged-all-to-all",
               "collective-permute")
# Substrings of the custom-call targets of each kind of kernel.
KERNEL_CALLS = {"tpu_custom_call": "tpu_custom_call", "triton": "triton",
                "mosaic_gpu": "mosaic_gpu"}
_CHILD_ENV = "GMM_JAX_AOT_POD_CHILD"
# The custom-call target of a `custom_partitioning` call in a lowered program.
CUSTOM_PARTITIONING = "CustomSPMDPartitioning"


# --------------------------------------------------------------------- reading the program


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


def first_line(error: BaseException) -> str:
  """`error`'s type and the first line of its message that says something (jax prefixes
  some errors with a blank line or a traceback note)."""
  for line in str(error).splitlines():
    line = line.strip()
    if line and not line.startswith(("jax.errors.SimplifiedTraceback", "---")):
      return f"{type(error).__name__}: {line}"[:400]
  return type(error).__name__


# ---------------------------------------------------------------------- the topologies


def register_tpu_partitioner():
  """Registers `custom_partitioning`'s partitioner with libtpu, as jax does when a TPU
  backend starts: describing a topology loads libtpu without running the plugin callbacks,
  and a deviceless compile of a program with a custom partitioning then fails with "Custom
  emitter for CustomSPMDPartitioning not found" (an artifact of compiling deviceless).
  Call it before the first TPU topology is described (the plugin's C API is only handed
  out by the load). Only that callback runs: the others register CPU and CUDA handlers."""
  if xla_client.pjrt_plugin_loaded("tpu"):
    raise RuntimeError("libtpu is loaded already: register the partitioner before describing "
                       "a TPU topology")
  c_api = xla_client.load_pjrt_plugin_dynamically("tpu", xla_bridge.get_tpu_library_path())
  if not xla_client.pjrt_plugin_initialized("tpu"):
    xla_client.initialize_pjrt_plugin("tpu")
  callbacks = [c for c in xla_bridge._plugin_callbacks
               if getattr(c, "keywords", {}).get("name") == "CustomSPMDPartitioning"]
  if not callbacks:
    raise RuntimeError("jax registered no CustomSPMDPartitioning plugin callback")
  for callback in callbacks:
    callback(c_api=c_api)


def describe(topology: Topology):
  """The deviceless topology (TPU: with the partitioner registered first)."""
  if topology.platform == "tpu":
    register_tpu_partitioner()
    return topologies.get_topology_desc(platform="tpu", topology_name=topology.name)
  config = (TARGET_DIR / topology.target_config).read_text()
  return topologies.get_topology_desc(platform="cuda", topology=topology.name,
                                      target_config=config)


def mesh_shape(num_chips: int, num_experts: int, expert: int | None = None) -> tuple[int, int]:
  """(data, expert) sizes: expert = min(#experts, #chips) unless given; it must divide both
  the chips and the experts."""
  expert = min(num_experts, num_chips) if expert is None else expert
  if num_chips % expert or num_experts % expert:
    raise ValueError(f"an expert axis of {expert} must divide the {num_chips} chips and the "
                     f"{num_experts} experts")
  return num_chips // expert, expert


# ------------------------------------------------------------------------ the steps


def parse_buffer_factor(text: str) -> float | None:
  """A ``--buffer-factor`` value: ``none`` (dropless) or a positive number."""
  if text.strip().lower() == "none":
    return None
  value = float(text)
  if not value > 0 or math.isinf(value):
    raise ValueError(f"a buffer factor must be a positive number or none, got {text!r}")
  return value


def label(strategy: str, buffer_factor: float | None) -> str:
  """A step's name in the table: the strategy, and ``@b=<factor>`` when it has one."""
  return strategy if buffer_factor is None else f"{strategy}@b={buffer_factor:g}"


def steps(models, topologies_, strategies, buffer_factors) -> list[tuple]:
  """The (model, topology, strategy, buffer factor) steps to compile, in table order: each
  gmm_jax strategy once per factor, a baseline once (without a factor: it has no nn.MoE)."""
  todo = []
  for m in models:
    for t in topologies_:
      for s in strategies:
        for b in ((None,) if s in BASELINES else buffer_factors):
          if (m, t, s, b) not in todo:
            todo.append((m, t, s, b))
  return todo


def _layer_kwargs(strategy: str, mesh: Mesh, buffer_factor: float | None = None) -> dict:
  kwargs = {} if buffer_factor is None else dict(buffer_factor=buffer_factor)
  if strategy.endswith("+a2a"):
    kwargs.update(transport="all_to_all")
    strategy = strategy[:-len("+a2a")]
  if strategy == "ep":
    kwargs.update(expert_parallel=(mesh, "expert"), data_parallel=(mesh, ("data", "expert")))
  if strategy == "unfused":
    kwargs.update(fused=False)
  return kwargs


def abstract_layer(model: Model, strategy: str = "default", mesh: Mesh | None = None,
                   buffer_factor: float | None = None):
  """The `nn.MoE` of `model` for `strategy` (with `buffer_factor`), bf16 parameters and
  compute, with abstract parameters (nothing is allocated: a Mixtral layer's experts are
  2.8 GB)."""
  kwargs = _layer_kwargs(strategy, mesh, buffer_factor) if mesh is not None else {}
  return nnx.eval_shape(lambda: nn.MoE.from_preset(
      model.preset, rngs=nnx.Rngs(0), scale=model.scale, dtype=jnp.bfloat16,
      param_dtype=jnp.bfloat16, **dict(model.overrides), **kwargs))


def param_spec(axes, ndim: int) -> P:
  """The mesh layout of a parameter with logical axes `axes` (`gmm_jax.nn`'s metadata): the
  expert weights (leading axis "expert", rank >= 2: kernels and biases) over the mesh's
  "expert" axis; everything else (the router, whose "expert" axis is its columns, the
  shared experts) replicated."""
  if ndim >= 2 and axes and axes[0] == "expert":
    return P("expert")
  return P()


def _axes(variable) -> tuple:
  for name in ("out_sharding", "sharding_names", "sharding"):
    axes = getattr(variable, name, None)
    if axes:
      return tuple(axes)
  return ()


def _loss(y, load_balancing, z_loss):
  return (jnp.mean(jnp.square(y.astype(jnp.float32))) + 0.01 * load_balancing
          + 0.001 * z_loss)


def nnx_loss(layer):
  """(loss(params, rest, x), abstract params, their specs, abstract rest) of a `nn.MoE`:
  the layer split into its `nnx.Param`s (flat list) and the rest (a routing bias)."""
  graphdef, params, rest = nnx.split(layer, nnx.Param, ...)
  is_variable = lambda v: isinstance(v, nnx.Variable)
  variables = jax.tree.leaves(params, is_leaf=is_variable)
  leaves, treedef = jax.tree.flatten(params)
  rest_leaves, rest_def = jax.tree.flatten(rest)
  specs = [param_spec(_axes(v), leaf.ndim) for v, leaf in zip(variables, leaves)]

  def loss(params, rest, x):
    layer = nnx.merge(graphdef, jax.tree.unflatten(treedef, params),
                      jax.tree.unflatten(rest_def, rest))
    y, aux = layer(x)
    return _loss(y, aux["load_balancing_loss"], aux["router_z_loss"])

  return loss, leaves, specs, rest_leaves


def ragged_dot_loss(layer):
  """The same as `nnx_loss` for the baseline: `layer`'s MoE math (router, top-k, renormalized
  and scaled weights, a gated FFN per expert, the shared expert) written with
  ``jax.lax.ragged_dot`` on tokens sorted by expert, without gmm_jax. Routing is plain
  top-k (no group limit, no routing bias): the same shapes and work."""
  num_experts, embed, mlp, top_k = layer.num_experts, layer.embed, layer.mlp, layer.top_k
  dtype = layer.dtype or jnp.float32  # the layer's compute dtype, for its parameters too
  shapes_ = [(embed, num_experts), (num_experts, embed, 2 * mlp), (num_experts, mlp, embed)]
  specs = [P(), P("expert"), P("expert")]
  if layer.shared is not None:
    shared = layer.shared.down.kernel.shape[0]
    shapes_ += [(embed, 2 * shared), (shared, embed)]
    specs += [P(), P()]
  leaves = [jax.ShapeDtypeStruct(s, dtype) for s in shapes_]

  def gated(z):
    half = z.shape[-1] // 2
    return (jax.nn.silu(z[..., :half].astype(jnp.float32)) * z[..., half:]).astype(dtype)

  def loss(params, rest, x):
    del rest
    router, w_in, w_down, *shared_weights = params
    num_tokens = x.shape[0]
    logits = jnp.dot(x, router, preferred_element_type=jnp.float32)
    scores = (jax.nn.softmax(logits, axis=-1) if layer.score == "softmax"
              else jax.nn.sigmoid(logits))
    top_p, top_e = jax.lax.top_k(scores, top_k)
    if layer.normalize_top_k:
      top_p = top_p / jnp.sum(top_p, axis=-1, keepdims=True)
    top_p = top_p * layer.routed_scaling_factor
    flat_e = top_e.reshape(-1)
    order = jnp.argsort(flat_e)
    sizes = jnp.bincount(flat_e, length=num_experts).astype(jnp.int32)
    rows = x[order // top_k]
    h = gated(jax.lax.ragged_dot(rows, w_in, sizes, preferred_element_type=dtype))
    out = jax.lax.ragged_dot(h, w_down, sizes, preferred_element_type=dtype)
    out = jnp.zeros_like(out).at[order].set(out).reshape(num_tokens, top_k, embed)
    y = jnp.sum(out.astype(jnp.float32) * top_p[..., None], axis=1)
    if shared_weights:
      up, down = shared_weights
      y = y + jnp.dot(gated(jnp.dot(x, up)), down, preferred_element_type=jnp.float32)
    load = jnp.mean(jnp.sum(jax.nn.one_hot(top_e, num_experts), axis=1), axis=0) / top_k
    balance = scores / jnp.sum(scores, axis=-1, keepdims=True)
    load_balancing = num_experts * jnp.sum(load * jnp.mean(balance, axis=0))
    z_loss = jnp.mean(jax.nn.logsumexp(logits, axis=-1) ** 2)
    return _loss(y, load_balancing, z_loss)

  return loss, leaves, specs, []


def grouped_linear_loss(layer):
  """The same as `nnx_loss` for one `nn.GroupedLinear` with the shape of `layer`'s expert
  input kernel (``[E, D, 2F]``) on the tokens as group-contiguous rows, E equal groups:
  the layer's gradients (its weight gradient is a k-grouped gmm) under plain jit."""
  num_experts, embed, width = layer._in_layer().kernel.shape
  grouped = nnx.eval_shape(lambda: nn.GroupedLinear(
      num_experts, embed, width, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16,
      rngs=nnx.Rngs(0)))
  graphdef, params = nnx.split(grouped, nnx.Param)
  leaves, treedef = jax.tree.flatten(params)

  def loss(params, rest, x):
    del rest
    linear = nnx.merge(graphdef, jax.tree.unflatten(treedef, params))
    sizes = jnp.full((num_experts,), x.shape[0] // num_experts, jnp.int32)
    return jnp.mean(jnp.square(linear(x, sizes).astype(jnp.float32)))

  return loss, leaves, [P("expert") for _ in leaves], []


def sgd_step(loss):
  """One training step: the loss's value and gradient w.r.t. the params, an SGD update."""

  def step(params, rest, x):
    value, grads = jax.value_and_grad(loss)(params, rest, x)
    new = [p - (LEARNING_RATE * g.astype(jnp.float32)).astype(p.dtype)
           for p, g in zip(params, grads)]
    return new, value

  return step


def expert_weight_shapes(layer) -> list[tuple[int, ...]]:
  """The global shapes of the expert kernels, and of the gate and up halves of a gated
  one: what a weight all-gather's result looks like."""
  found = []
  for grouped in (layer.gate_up, layer.up, layer.down):
    if grouped is None:
      continue
    shape = tuple(grouped.kernel.shape)
    found += [shape, shape[1:]]  # all of them, or one expert's
    if grouped is layer.gate_up:
      half = shape[:-1] + (shape[-1] // 2,)
      found += [half, half[1:]]
  return found


# ----------------------------------------------------------------------------- a row


@dataclasses.dataclass
class Row:
  """One compiled (or failed) training step. Bytes are per device."""

  model: str
  topology: str
  strategy: str
  buffer_factor: float | None = None  # nn.MoE(buffer_factor=...); None: dropless
  mesh: str = ""  # "data x expert"
  status: str = "ok"  # "ok", "FAIL", "timeout", "skipped"
  error: str = ""  # the first line of the error
  seconds: float = 0.0  # lower + compile
  argument_bytes: int = 0
  output_bytes: int = 0
  temp_bytes: int = 0
  alias_bytes: int = 0
  peak_bytes: int = 0  # arguments + outputs + temporaries - aliased
  hbm_bytes: int = 0
  collective_bytes: dict = dataclasses.field(default_factory=dict)
  weight_gather_bytes: int = 0
  implementations: dict = dataclasses.field(default_factory=dict)
  kernels: dict = dataclasses.field(default_factory=dict)
  # custom_partitioning calls in the lowered program (a TPU program must have none)
  custom_partitionings: int = 0
  detail: str = ""  # the end of the traceback of a failure


def compile_step(model_name: str, topology_name: str, strategy: str,
                 expert: int | None = None, buffer_factor: float | None = None) -> Row:
  """Builds, lowers and compiles one training step deviceless; a failure is a row too."""
  model, topology = MODELS[model_name], TOPOLOGIES[topology_name]
  if strategy in BASELINES:
    buffer_factor = None
  row = Row(model_name, topology_name, strategy, buffer_factor, hbm_bytes=topology.hbm)
  start = time.perf_counter()
  try:
    devices = describe(topology).devices
    probe = abstract_layer(model)
    data, ep = mesh_shape(len(devices), probe.num_experts, expert)
    row.mesh = f"{data}x{ep}"
    kind = getattr(jax.sharding.AxisType, IN_MESH.get(strategy, "Auto"))
    mesh = Mesh(np.array(devices).reshape(data, ep), ("data", "expert"),
                axis_types=(kind, kind))
    context = jax.set_mesh(mesh) if strategy in IN_MESH else contextlib.nullcontext()
    if strategy == "ragged_dot":
      loss, params, specs, rest = ragged_dot_loss(probe)
    elif strategy == "grouped_linear":
      loss, params, specs, rest = grouped_linear_loss(probe)
    else:
      with context:  # a sharded model is built (abstractly) under its mesh
        layer = abstract_layer(model, strategy, mesh, buffer_factor)
      loss, params, specs, rest = nnx_loss(layer)
    shard = lambda spec: NamedSharding(mesh, spec)
    tokens = P(("data", "expert"))
    in_shardings = ([shard(s) for s in specs], [shard(P()) for _ in rest], shard(tokens))
    out_shardings = ([shard(s) for s in specs], shard(P()))
    placed = (lambda spec: None) if strategy == "default+blind" else shard
    args = ([jax.ShapeDtypeStruct(p.shape, p.dtype, sharding=placed(s))
             for p, s in zip(params, specs)],
            [jax.ShapeDtypeStruct(r.shape, r.dtype, sharding=placed(P())) for r in rest],
            jax.ShapeDtypeStruct((model.tokens_per_chip * len(devices), probe.embed),
                                 jnp.bfloat16, sharding=placed(tokens)))
    step = jax.jit(sgd_step(loss), in_shardings=in_shardings, out_shardings=out_shardings,
                   donate_argnums=0)
    context = jax.set_mesh(mesh) if strategy in IN_MESH else contextlib.nullcontext()
    # Pallas reads the platform and device kind from the default device, at trace time and
    # when the partitioner lowers a gmm per device at compile time.
    with context, jax.default_device(devices[0]), dispatch.record() as decisions:
      lowered = step.lower(*args)
      row.custom_partitionings = lowered.as_text().count(CUSTOM_PARTITIONING)
      compiled = lowered.compile()
    row.seconds = time.perf_counter() - start
  except Exception as err:  # noqa: BLE001  (a failure is a reported result)
    row.seconds = time.perf_counter() - start
    row.status, row.error = "FAIL", first_line(err)
    row.detail = traceback.format_exc()[-3000:]
    return row
  memory = compiled.memory_analysis()
  row.argument_bytes = memory.argument_size_in_bytes
  row.output_bytes = memory.output_size_in_bytes
  row.temp_bytes = memory.temp_size_in_bytes
  row.alias_bytes = memory.alias_size_in_bytes
  row.peak_bytes = row.argument_bytes + row.output_bytes + row.temp_bytes - row.alias_bytes
  hlo = compiled.as_text()
  row.collective_bytes = collective_bytes(hlo)
  row.weight_gather_bytes = weight_gather_bytes(hlo, expert_weight_shapes(probe))
  for decision in decisions:
    name = decision.implementation
    row.implementations[name] = row.implementations.get(name, 0) + 1
  row.kernels = kernel_calls(hlo)
  return row


# --------------------------------------------------------------------------- the table


def size(num_bytes: int | None) -> str:
  """Bytes for a table cell: 0, B, KiB, MiB or GiB."""
  if num_bytes is None:
    return ""
  if num_bytes == 0:
    return "0"
  for unit, scale in (("GiB", GIB), ("MiB", 2 ** 20)):
    if num_bytes >= scale:
      return f"{num_bytes / scale:.{2 if unit == 'GiB' else 1}f} {unit}"
  return f"{num_bytes / 1024:.1f} KiB" if num_bytes >= 1024 else f"{num_bytes} B"


def _counts(counts: dict) -> str:
  return ", ".join(f"{name} x{n}" for name, n in sorted(counts.items())) or "-"


def markdown(rows: list[dict]) -> str:
  """The rows as a Markdown table (bytes per device)."""
  short = {"all-gather": "AG", "all-reduce": "AR", "reduce-scatter": "RS", "all-to-all": "A2A",
           "ragged-all-to-all": "ragged A2A", "collective-permute": "permute"}
  head = ["model", "topology", "mesh (data x expert)", "strategy", "compiles", "compile s",
          "args", "out", "temp", "peak / HBM", *(short[k] for k in COLLECTIVES),
          "weight AG", "gmm implementations", "kernel calls"]
  lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
  for r in rows:
    ok = r["status"] == "ok"
    status = "yes" if ok else f"{r['status']}: {r['error']}".replace("|", "/")[:200]
    cells = [r["model"], r["topology"], r["mesh"], _label(r), status,
             f"{r['seconds']:.0f}"]
    if ok:
      peak = f"{size(r['peak_bytes'])} / {size(r['hbm_bytes'])}"
      if r["peak_bytes"] > r["hbm_bytes"]:
        peak += " (does not fit)"
      cells += [size(r["argument_bytes"]), size(r["output_bytes"]), size(r["temp_bytes"]),
                peak, *(size(r["collective_bytes"].get(k, 0)) for k in COLLECTIVES),
                size(r["weight_gather_bytes"]), _counts(r["implementations"]),
                _counts(r["kernels"])]
    else:
      cells += [""] * (len(head) - len(cells))
    lines.append("| " + " | ".join(cells) + " |")
  return "\n".join(lines) + "\n"


def _label(r: dict) -> str:
  return label(r["strategy"], r.get("buffer_factor"))


def failures(rows: list[dict], required: tuple[str, ...]) -> list[str]:
  """Why the rows of the `required` strategies (with any buffer factor) fail `--require`: a
  step that did not compile, (a gmm_jax strategy) one that all-gathers a whole expert
  weight, or a TPU program with a `custom_partitioning` call."""
  found = []
  for r in rows:
    if r["strategy"] not in required:
      continue
    name = f"{r['model']} {r['topology']} {_label(r)}"
    if r["status"] != "ok":
      found.append(f"{name}: {r['status']}: {r['error']}")
    elif r["strategy"] not in BASELINES and r["weight_gather_bytes"]:
      found.append(f"{name}: all-gathers {size(r['weight_gather_bytes'])} of expert weights")
    topology = TOPOLOGIES.get(r["topology"])
    if topology is not None and topology.platform == "tpu" and r.get("custom_partitionings"):
      found.append(f"{name}: {r['custom_partitionings']} custom_partitioning calls in a TPU "
                   "program (libtpu has no partitioner for them)")
  return found


def _line(r: dict) -> str:
  if r["status"] != "ok":
    return (f"[{r['status']}] {r['model']} {r['topology']} {_label(r)} "
            f"({r['seconds']:.0f} s): {r['error']}")
  collectives_ = ", ".join(f"{k} {size(v)}" for k, v in r["collective_bytes"].items() if v)
  return (f"[ok] {r['model']} {r['topology']} {r['mesh']} {_label(r)} "
          f"({r['seconds']:.0f} s): peak {size(r['peak_bytes'])} of {size(r['hbm_bytes'])} "
          f"(temp {size(r['temp_bytes'])}); {collectives_ or 'no collectives'}; weight "
          f"all-gather {size(r['weight_gather_bytes'])}; {_counts(r['implementations'])}; "
          f"kernels {_counts(r['kernels'])}")


# ----------------------------------------------------------------------------- running


def _define_flags() -> flags.FlagValues:
  fv = cli.flag_values()
  flags.DEFINE_multi_enum("models", list(DEFAULT_MODELS), list(MODELS), "the MoE layers",
                          flag_values=fv)
  flags.DEFINE_multi_enum("topologies", list(DEFAULT_TOPOLOGIES), list(TOPOLOGIES),
                          "the topologies", flag_values=fv)
  flags.DEFINE_multi_enum("strategies", list(DEFAULT_STRATEGIES), list(STRATEGIES),
                          "the ways of writing the step (the module's docstring)",
                          flag_values=fv)
  flags.DEFINE_bool("small", False, "the CI configuration: the small models on "
                    f"{', '.join(SMALL_TOPOLOGIES)} (unless --models / --topologies say)",
                    flag_values=fv)
  flags.DEFINE_multi_string(
      "buffer-factor", ["none"], "nn.MoE(buffer_factor=...) of the gmm_jax strategies: the "
      "expert-parallel receive buffers in units of the expected rows per source device; none: "
      "dropless (the worst case); several values: a step each", flag_values=fv)
  flags.register_validator("buffer-factor", _valid_buffer_factors,
                           "a buffer factor is a positive number or none", flag_values=fv)
  flags.DEFINE_integer("expert", None, "the expert axis size (default: min(#experts, #chips))",
                       lower_bound=1, flag_values=fv)
  flags.DEFINE_integer("timeout", 1800, "seconds one step may take to compile", lower_bound=1,
                       flag_values=fv)
  flags.DEFINE_integer("jobs", 1, "steps compiled at once (each in its own process)",
                       lower_bound=1, flag_values=fv)
  flags.DEFINE_multi_enum("require", [], list(STRATEGIES),
                          "exit 1 unless every step of these strategies compiles (and, for "
                          "the gmm_jax ones, gathers no expert weight)", flag_values=fv)
  flags.DEFINE_string("json", None, "write the rows as JSON here", flag_values=fv)
  flags.DEFINE_string("markdown", None, "write the Markdown table here", flag_values=fv)
  # Internal: a compile process writes its one row here.
  flags.DEFINE_string("child_json", None, "(internal) run as a compile process",
                      flag_values=fv)
  return fv


def _valid_buffer_factors(values) -> bool:
  try:
    for value in values:
      parse_buffer_factor(value)
  except ValueError:
    return False
  return True


def _child_env() -> dict[str, str]:
  env = dict(os.environ)
  env[_CHILD_ENV] = "1"
  env["JAX_PLATFORMS"] = "cpu"  # the plugins register without touching a device
  env["ALLOW_MULTIPLE_LIBTPU_LOAD"] = "1"  # the compile processes each load libtpu
  return env


def child_flags(out, model: str, topology: str, strategy: str, buffer_factor: float | None,
                expert: int | None) -> list[str]:
  """The flags of the compile process of one step, which writes its row to `out`."""
  factor = "none" if buffer_factor is None else repr(buffer_factor)  # repr: exact
  flags_ = ["--child_json", str(out), "--models", model, "--topologies", topology,
            "--strategies", strategy, f"--buffer-factor={factor}"]
  return flags_ if expert is None else flags_ + ["--expert", str(expert)]


def _run_one(model: str, topology: str, strategy: str, buffer_factor: float | None,
             expert: int | None, timeout: int) -> dict:
  """Compiles one step in a process of its own; a hang or crash becomes a row."""
  with tempfile.TemporaryDirectory() as tmp:
    out, log = pathlib.Path(tmp) / "row.json", pathlib.Path(tmp) / "log.txt"
    command = [sys.executable, "-m", "gmm_jax.tools.aot_pod",
               *child_flags(out, model, topology, strategy, buffer_factor, expert)]
    start = time.perf_counter()
    with open(log, "wb") as stderr:
      proc = subprocess.Popen(command, env=_child_env(), stdout=stderr, stderr=stderr,
                              start_new_session=True)
      try:
        code = proc.wait(timeout=timeout)
      except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)  # the compile process and anything it started
        proc.wait()
        code = None
    if out.exists():
      return json.loads(out.read_text())
    row = Row(model, topology, strategy, buffer_factor, seconds=time.perf_counter() - start,
              hbm_bytes=TOPOLOGIES[topology].hbm)
    if code is None:
      row.status, row.error = "timeout", f"no result in {timeout} s"
    else:
      tail = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
      row.status = "FAIL"
      row.error = f"compile process exited {code}: {tail[-1] if tail else ''}"[:400]
      row.detail = "\n".join(tail[-30:])[-3000:]
    return dataclasses.asdict(row)


def main(argv=None) -> int:
  """Compiles the steps of command-line flags `argv` (without the program name; None:
  sys.argv[1:]); prints a line per step and the Markdown table. Returns the exit status."""
  args = cli.parse_flags(_define_flags(), "python -m gmm_jax.tools.aot_pod",
                         sys.argv[1:] if argv is None else argv, __doc__)
  models, topologies_ = args.models, args.topologies
  if args.small:
    models = models if args["models"].present else list(SMALL_MODELS)
    topologies_ = topologies_ if args["topologies"].present else list(SMALL_TOPOLOGIES)
  factors = [parse_buffer_factor(value) for value in args["buffer-factor"].value]
  if args.child_json:
    row = compile_step(models[0], topologies_[0], args.strategies[0], args.expert, factors[0])
    pathlib.Path(args.child_json).write_text(json.dumps(dataclasses.asdict(row)))
    return 0
  todo = steps(models, topologies_, args.strategies, factors)
  bar = cli.Progress(len(todo), cli.show_progress(args))
  bar.begin(f"compiling {len(todo)} training steps")
  start = time.perf_counter()
  rows = []
  with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
    futures = [pool.submit(_run_one, *step, args.expert, args.timeout) for step in todo]
    for future in concurrent.futures.as_completed(futures):
      row = future.result()
      rows.append(row)
      bar.print(_line(row))
      bar.advance(f"{row['model']} {row['topology']} {_label(row)}")
  bar.close()
  order = {key: i for i, key in enumerate(todo)}
  rows.sort(key=lambda r: order[(r["model"], r["topology"], r["strategy"],
                                 r["buffer_factor"])])
  table = markdown(rows)
  print()
  print(table)
  failed = failures(rows, tuple(args.require))
  compiled = sum(r["status"] == "ok" for r in rows)
  print(f"{compiled} of {len(rows)} training steps compiled in "
        f"{time.perf_counter() - start:.0f} s")
  for line in failed:
    print(f"REQUIRED: {line}")
  cli.save_tables(rows, table, args.json, args.markdown)
  return 1 if failed else 0


def run():
  """``python -m gmm_jax.tools.aot_pod``."""
  cli.run(main)


if __name__ == "__main__":
  run()
