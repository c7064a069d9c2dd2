"""MaxText's gmm calls as data: the cases (MaxText configs of its ``RoutedMoE``), how one
recorded call is stored (npz arrays plus a JSON description), and the harness that replays a
per-device call outside MaxText's layer.

Shared by tests/fixtures/maxtext/make_fixtures.py (which runs MaxText and records) and
tests/test_compat_maxtext.py (which replays the records through gmm_jax.compat, and runs the
layer live when maxtext is installed). Nothing here imports maxtext, qwix or tokamax at
import time.

A recorded call holds the arguments exactly as MaxText passed them: which were positional,
which keywords, the Python values of the static ones (dtypes, tiles, flags, mesh axis names)
and the arrays of one device's shard. Quantized operands (qwix QArrays) are stored as their
qvalue, scale and qtype. Arrays keep their exact bits: npz has no bfloat16 or float8, so
those are stored as unsigned integers of the same width and viewed back.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import types
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

FIXTURE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "maxtext")

# Tiles of the mixed-tiles case: (fwd m, k, n, dlhs m, k, n, drhs m, k, n) of the up and the
# down gmm, in MaxText's config names; every triple different, most smaller than the
# dimension they tile.
MIXED_TILES = dict(
    wi_tile_fwd_batch_seq=16, wi_tile_fwd_embed_dim=8, wi_tile_fwd_mlp_dim=32,
    wi_tile_dlhs_batch_seq=32, wi_tile_dlhs_embed_dim=16, wi_tile_dlhs_mlp_dim=16,
    wi_tile_drhs_batch_seq=8, wi_tile_drhs_embed_dim=32, wi_tile_drhs_mlp_dim=64,
    wo_tile_fwd_batch_seq=16, wo_tile_fwd_embed_dim=16, wo_tile_fwd_mlp_dim=64,
    wo_tile_dlhs_batch_seq=8, wo_tile_dlhs_embed_dim=8, wo_tile_dlhs_mlp_dim=32,
    wo_tile_drhs_batch_seq=32, wo_tile_drhs_embed_dim=16, wo_tile_drhs_mlp_dim=16)

# Tiles no larger than the dimensions they tile: megablox clamps float operands' tiles to the
# dimensions, but qwix's block specs of quantized operands assert they fit. One size for every
# gmm of the layer (its dimensions are 32 and 64), so the up and the down gmm are called alike.
FIT_TILES = {f"{w}_tile_{p}_{d}": 32 for w in ("wi", "wo") for p in ("fwd", "dlhs", "drhs")
             for d in ("batch_seq", "embed_dim", "mlp_dim")}

# The config every case starts from: a Mixtral-style layer, shrunk (emb 32, mlp 64: unequal,
# so a swapped k and n cannot pass; 8 experts, top-2, 8 x 16 tokens), megablox (the Pallas
# TPU kernel, interpreted off TPU), f32, 8-way FSDP.
BASE = dict(
    run_name="gmm_jax_compat", enable_checkpointing=False, skip_jax_distributed_system=True,
    log_config=False, model_name="mixtral-8x7b", override_model_config=True, base_emb_dim=32,
    base_mlp_dim=64, base_moe_mlp_dim=64, num_experts=8, num_experts_per_tok=2,
    dtype="float32", weight_dtype="float32", megablox=True, sparse_matmul=True,
    per_device_batch_size=1, max_target_length=16, ici_fsdp_parallelism=8)

# name: the config overrides of a case.
CASES = {
    "fsdp": {},
    "fsdp2_tensor4": dict(ici_fsdp_parallelism=2, ici_tensor_parallelism=4),
    # ring of experts: each device's gmm takes its experts' group sizes, group_offset 0
    "expert_ring": dict(ici_fsdp_parallelism=1, ici_expert_parallelism=8,
                        use_ring_of_experts=True),
    # ... with the ragged sort: all group sizes and a traced group_offset per device
    "expert_ring_ragged_sort": dict(ici_fsdp_parallelism=2, ici_expert_parallelism=4,
                                    use_ring_of_experts=True, use_ragged_sort=True,
                                    ragged_buffer_factor=4.0, dtype="bfloat16"),
    "expert4_fsdp2": dict(ici_fsdp_parallelism=2, ici_expert_parallelism=4),
    "mixed_tiles": dict(MIXED_TILES),
    "bf16": dict(dtype="bfloat16", weight_dtype="bfloat16"),
    "int8": dict(FIT_TILES, quantization="int8"),
    "fp8": dict(FIT_TILES, quantization="fp8"),
    "nanoo_fp8": dict(FIT_TILES, quantization="nanoo_fp8"),
    "check_vma": dict(check_vma=True),
    # tokamax's gmm (MaxText asks for implementation="mosaic", see SUBSTITUTE)
    "tokamax": dict(use_tokamax_gmm=True),
    "int8_qwix": dict(FIT_TILES, quantization="int8", use_qwix_quantization=True),
    # MaxText's quantized tokamax path: its megablox ops.gmm (custom_vjp) quantizing with
    # qwix and calling tokamax.ragged_dot / ragged_dot_general for the three gmms
    "tokamax_int8": dict(FIT_TILES, quantization="int8", use_tokamax_gmm=True),
}

# Keyword values replaced in a case's calls of an API, in the recording, the replay and the
# live runs alike: MaxText's tokamax path asks for tokamax's Mosaic kernel, which runs on a
# TPU only (on the CPU tokamax raises "Unsupported TPU device kind: cpu", and compat.tokamax
# NotImplementedError), so tokamax's XLA implementation stands in for it.
TOKAMAX_ON_CPU = {"tokamax.ragged_dot": {"implementation": "xla"},
                  "tokamax.ragged_dot_general": {"implementation": "xla"}}
SUBSTITUTE = {case: TOKAMAX_ON_CPU for case in ("tokamax", "tokamax_int8")}


def substituted(module, case: str | None = None):
  """`module` (tokamax or compat.tokamax) with the case's SUBSTITUTE applied to its
  functions (the module itself when the case has none); with no case, TOKAMAX_ON_CPU (for
  MaxText's own variants of a case, which may take its tokamax path)."""
  subs = SUBSTITUTE.get(case, {}) if case is not None else TOKAMAX_ON_CPU
  if not subs:
    return module
  proxy = types.SimpleNamespace(**{k: getattr(module, k) for k in dir(module)
                                   if not k.startswith("__")})
  for api, kwargs in subs.items():
    name = api.split(".", 1)[1]
    setattr(proxy, name, functools.partial(call_with, getattr(module, name), kwargs))
  return proxy


def call_with(fn, forced, *args, **kwargs):
  """fn called with `forced` keyword values over the given ones."""
  return fn(*args, **dict(kwargs, **forced))


@contextlib.contextmanager
def maxtext_tokamax(layer_module, ops_module, case: str | None = None):
  """MaxText's layer (``maxtext.layers.moe``) calling `layer_module` as tokamax and its
  megablox ops.gmm (``maxtext.kernels.megablox.ops``, MaxText's quantized tokamax path)
  calling `ops_module`, each `substituted` for `case`."""
  from maxtext.kernels.megablox import ops  # pylint: disable=import-outside-toplevel
  from maxtext.layers import moe  # pylint: disable=import-outside-toplevel
  saved = moe.tokamax, ops.tokamax
  moe.tokamax, ops.tokamax = substituted(layer_module, case), substituted(ops_module, case)
  try:
    yield
  finally:
    moe.tokamax, ops.tokamax = saved


# The APIs a record may name, and the module MaxText's layer reaches each through.
TOP_LEVEL = ("mblx.gmm", "tokamax.ragged_dot", "tokamax.ragged_dot_general")
KERNEL_LEVEL = ("backend.gmm", "backend.tgmm")

# The module of MaxText's megablox ops.gmm (a custom_vjp): the tokamax calls made from it
# (its quantized tokamax path) are its kernels, not differentiated themselves.
MEGABLOX_OPS = "maxtext.kernels.megablox.ops"


def is_top_level(record: dict) -> bool:
  """Whether moe.py made the call itself (its vjp is MaxText's gradient of it); a tokamax
  call made from megablox's ops.gmm is one of that function's kernels. Records made before
  the caller was kept have no "caller": the API decides."""
  return record["api"] in TOP_LEVEL and record.get("caller") != MEGABLOX_OPS


# --- tolerances ----------------------------------------------------------------------------

def moe_tolerance(dtype) -> dict:
  """MaxText's ``assert_moe_close`` (tests/unit/moe_test.py): rtol 2e-2, atol 1e-2 for
  bfloat16, rtol 1e-5, atol 1e-6 for float32 off TPU; NaN and inf fail."""
  if jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
    return dict(rtol=2e-2, atol=1e-2)
  return dict(rtol=1e-5, atol=1e-6)


# MaxText's ``compare_tree`` (tests/unit/moe_test.py), which its MoE tests use for gradients:
# each leaf's ||a - b|| / ||a|| must stay below 1e-2 (max |a - b| when a is 0; NaN fails).
GRAD_RELATIVE_NORM = 1e-2


def assert_moe_close(actual, expected, dtype, what: str = "") -> None:
  actual = np.asarray(actual, np.float32)
  assert np.isfinite(actual).all(), f"{what}: NaN or inf in the result"
  np.testing.assert_allclose(actual, np.asarray(expected, np.float32), equal_nan=False,
                             err_msg=what, **moe_tolerance(dtype))


def relative_norm_diff(actual, expected) -> float:
  actual = np.asarray(actual, np.float64)
  expected = np.asarray(expected, np.float64)
  norm = np.linalg.norm(expected)
  diff = np.linalg.norm(actual - expected) if norm == 0 else \
      np.linalg.norm(actual - expected) / norm
  return float(np.max(np.abs(actual - expected))) if norm == 0 else float(diff)


def assert_grads_close(actual, expected, what: str = "") -> None:
  diff = relative_norm_diff(actual, expected)
  assert diff < GRAD_RELATIVE_NORM, (
      f"{what}: relative norm difference {diff:.3e} >= {GRAD_RELATIVE_NORM}")


# A quantized case is held to its own noise instead: how far MaxText's result moves when
# only its f32 rounding does (the same quantization, the same math: other tiles, or its
# other kernels). compare_tree's 1e-2 cannot tell a weight gradient taken at the quantized
# lhs, as MaxText takes it, from one at the float lhs (0.5-1% apart at int8).
NOISE_FACTOR = 3.0


def call_variants(values: dict) -> dict:
  """MaxText's own variants of one recorded call, as keyword changes: its tiles halved,
  and its other backend (megablox's kernels for tokamax's, and back)."""
  variants = {}
  if isinstance(values.get("tiling"), (tuple, list)):
    variants["tiles"] = {"tiling": tuple(max(int(t) // 2, 8) for t in values["tiling"])}
  if "use_tokamax_backend" in values:
    variants["backend"] = {"use_tokamax_backend": not values["use_tokamax_backend"]}
  return variants


def layer_variants(overrides: dict) -> dict:
  """MaxText's own variants of a case's layer, as config overrides (as `call_variants`)."""
  tiles = {k: max(int(v) // 2, 8) for k, v in overrides.items() if "_tile_" in k}
  return {"tiles": dict(overrides, **tiles),
          "backend": dict(overrides, use_tokamax_gmm=not overrides.get("use_tokamax_gmm"))}


def spread(variants: dict, reference: dict) -> dict:
  """{tensor: the largest relative norm difference of a variant's from the reference's}
  for `variants` {name: {tensor: array}}."""
  return {key: max(relative_norm_diff(got[key], value) for got in variants.values())
          for key, value in reference.items()}


def assert_within_noise(actual, expected, noise: float, what: str = "") -> None:
  diff = relative_norm_diff(actual, expected)
  assert diff <= NOISE_FACTOR * noise, (
      f"{what}: relative norm difference {diff:.3e} > {NOISE_FACTOR:g} x MaxText's own "
      f"{noise:.3e}")


# --- arrays with their exact bits in npz ---------------------------------------------------

def _storage(dtype) -> np.dtype | None:
  """The unsigned type npz stores a dtype it lacks in, None if npz has it."""
  dtype = np.dtype(dtype)
  if dtype.kind in "biuf" and dtype.name in np.sctypeDict:  # numpy's own types
    return None
  return np.dtype(f"uint{8 * dtype.itemsize}")


def put_array(arrays: dict, value) -> dict:
  """Stores `value` in `arrays` under a key made of its content (equal arrays, e.g. the
  weights every case shares, are stored once); returns the reference JSON keeps."""
  value = np.asarray(value)
  storage = _storage(value.dtype)
  # np.array, not np.ascontiguousarray: that one makes a scalar (group_offset) 1-d
  stored = np.array(value if storage is None else value.view(storage), order="C")
  digest = hashlib.sha1(f"{stored.dtype.str}{stored.shape}".encode() + stored.tobytes())
  key = f"a/{digest.hexdigest()[:20]}"
  arrays[key] = stored
  return {"__array__": key, "dtype": value.dtype.name}


def get_array(arrays, ref: dict) -> np.ndarray:
  value = np.asarray(arrays[ref["__array__"]])
  dtype = jnp.dtype(ref["dtype"])
  return value if value.dtype == dtype else value.view(dtype)


# --- a call's arguments as JSON ------------------------------------------------------------

def _is_qarray(value) -> bool:
  return hasattr(value, "qvalue") and hasattr(value, "scale")


def _is_group_sizes(value) -> bool:
  return hasattr(value, "value") and hasattr(value, "repr_value_or_total_size")


def _is_dtype(value) -> bool:
  if isinstance(value, np.dtype):
    return True
  if isinstance(value, type):
    try:
      np.dtype(value)
      return True
    except TypeError:
      return False
  return False


def encode(value, arrays: dict) -> Any:
  """`value` (one argument of a call, concrete) as JSON; arrays go into `arrays`."""
  if value is None or isinstance(value, (bool, int, float, str)):
    return value
  if _is_dtype(value):
    return {"__dtype__": np.dtype(value).name}
  if isinstance(value, jax.lax.Precision):
    return {"__precision__": value.name}
  if isinstance(value, jax.lax.RaggedDotDimensionNumbers):
    (lhs_contract, rhs_contract), (lhs_batch, rhs_batch) = value.dot_dimension_numbers
    return {"__ragged_dot_dims__": {
        "dot_dimension_numbers": [[list(lhs_contract), list(rhs_contract)],
                                  [list(lhs_batch), list(rhs_batch)]],
        "lhs_ragged_dimensions": list(value.lhs_ragged_dimensions),
        "rhs_group_dimensions": list(value.rhs_group_dimensions)}}
  if isinstance(value, (tuple, list)):
    items = [encode(v, arrays) for v in value]
    return {"__tuple__": items} if isinstance(value, tuple) else items
  if _is_qarray(value):
    qtype = getattr(value, "qtype", None)
    return {"__qarray__": {
        "qvalue": encode(value.qvalue, arrays),
        "scale": encode(value.scale, arrays),
        "zero_point": encode(getattr(value, "zero_point", None), arrays),
        "qtype": None if qtype is None else np.dtype(qtype).name}}
  if _is_group_sizes(value):
    return {"__group_sizes__": {
        "value": encode(value.value, arrays),
        "repr_value_or_total_size": encode(value.repr_value_or_total_size, arrays)}}
  if isinstance(value, (np.ndarray, np.generic, jax.Array)):
    return put_array(arrays, value)
  raise TypeError(f"cannot record {value!r} ({type(value)})")


def decode(obj, arrays, *, qarray: Callable, group_sizes: Callable | None = None,
           as_jax: bool = True) -> Any:
  """The value `encode` stored; `qarray(qvalue, scale, zero_point, qtype)` and
  `group_sizes(value, repr_value_or_total_size)` build those objects."""
  again = lambda o: decode(o, arrays, qarray=qarray, group_sizes=group_sizes, as_jax=as_jax)
  if isinstance(obj, list):
    return [again(o) for o in obj]
  if not isinstance(obj, dict):
    return obj
  if "__array__" in obj:
    value = get_array(arrays, obj)
    return jnp.asarray(value) if as_jax else value
  if "__dtype__" in obj:
    return jnp.dtype(obj["__dtype__"])
  if "__precision__" in obj:
    return jax.lax.Precision[obj["__precision__"]]
  if "__ragged_dot_dims__" in obj:
    dims = obj["__ragged_dot_dims__"]
    (lhs_contract, rhs_contract), (lhs_batch, rhs_batch) = dims["dot_dimension_numbers"]
    return jax.lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=((tuple(lhs_contract), tuple(rhs_contract)),
                               (tuple(lhs_batch), tuple(rhs_batch))),
        lhs_ragged_dimensions=list(dims["lhs_ragged_dimensions"]),
        rhs_group_dimensions=list(dims["rhs_group_dimensions"]))
  if "__tuple__" in obj:
    return tuple(again(o) for o in obj["__tuple__"])
  if "__qarray__" in obj:
    q = obj["__qarray__"]
    return qarray(again(q["qvalue"]), again(q["scale"]), again(q["zero_point"]),
                  None if q["qtype"] is None else jnp.dtype(q["qtype"]))
  if "__group_sizes__" in obj:
    g = obj["__group_sizes__"]
    if group_sizes is None:
      raise ValueError("this record holds a group sizes object; pass group_sizes=")
    return group_sizes(again(g["value"]), again(g["repr_value_or_total_size"]))
  raise ValueError(f"unknown record entry {obj!r}")


def call_arguments(record: dict, arrays, **decode_kwargs) -> tuple[list, dict]:
  """The positional and keyword arguments of a recorded call, as MaxText passed them."""
  values = {name: decode(v, arrays, **decode_kwargs) for name, v in record["args"].items()}
  return ([values[name] for name in record["positional"]],
          {name: values[name] for name in record["keywords"]})


# --- the rows a result defines -------------------------------------------------------------

def defined_rows(group_sizes, group_offset, num_local: int, m: int) -> np.ndarray:
  """The rows of a gmm result (or dlhs) megablox defines: those of the local groups
  ``[group_offset, group_offset + num_local)``; the others hold whatever memory held (NaN
  when interpreted), which MaxText never reads."""
  sizes = np.asarray(group_sizes, np.int64).reshape(-1)
  bounds = np.concatenate([[0], np.cumsum(sizes)])
  first = 0 if group_offset is None else int(np.asarray(group_offset).reshape(-1)[0])
  last = min(first + num_local, sizes.shape[0])
  rows = np.arange(m)
  return (rows >= bounds[first]) & (rows < bounds[last])


# --- the per-device harness ----------------------------------------------------------------

def _pcast_varying(x, axes):
  if not axes:
    return x
  pcast = getattr(jax.lax, "pcast", None)
  if pcast is not None:
    return pcast(x, tuple(axes), to="varying")
  return jax.lax.pvary(x, tuple(axes))


def vma(x) -> tuple:
  return tuple(sorted(getattr(jax.typeof(x), "vma", ()) or ()))


def per_device(fn: Callable, manual_axes, vmas, check_vma: bool) -> Callable:
  """`fn(*leaves)` run as MaxText ran it on one device: inside a shard_map whose manual
  axes are `manual_axes` (each of size 1 here, so the collectives it may hold are exact),
  the i-th input varying over ``vmas[i]``; results are returned whole (summed over their
  varying axes, each of size 1)."""
  manual_axes = tuple(manual_axes)
  if not manual_axes:
    return jax.jit(fn)
  mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:1]).reshape((1,) * len(manual_axes)),
                           manual_axes)

  def body(*leaves):
    leaves = [x if x is None else _pcast_varying(x, axes) if check_vma else x
              for x, axes in zip(leaves, vmas)]
    out = fn(*leaves)
    return jax.tree.map(lambda y: jax.lax.psum(y, vma(y)) if vma(y) else y, out)

  spec = jax.sharding.PartitionSpec()
  return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec,
                               check_vma=check_vma))


# --- MaxText's layer ----------------------------------------------------------------------

def build_layer(overrides: dict, seed: int = 0):
  """(config, RoutedMoE) of a case, built as MaxText's own MoE tests build it (maxtext
  must be installed; jax must see 8 devices)."""
  import maxtext  # pylint: disable=import-outside-toplevel
  from flax import nnx  # pylint: disable=import-outside-toplevel
  from maxtext.configs import pyconfig  # pylint: disable=import-outside-toplevel
  from maxtext.layers import moe, quantizations  # pylint: disable=import-outside-toplevel
  from maxtext.layers.initializers import nd_dense_init  # pylint: disable=import-outside-toplevel
  from maxtext.utils import maxtext_utils  # pylint: disable=import-outside-toplevel

  base_yml = os.path.join(os.path.dirname(maxtext.__file__), "configs", "base.yml")
  cfg = pyconfig.initialize([None, base_yml], **{**BASE, **overrides})
  mesh = jax.sharding.Mesh(maxtext_utils.create_device_mesh(cfg), cfg.mesh_axes)
  model = moe.RoutedMoE(
      config=cfg, num_experts=cfg.num_experts, num_experts_per_tok=cfg.num_experts_per_tok,
      mesh=mesh, kernel_init=nd_dense_init(1.0, "fan_in", "truncated_normal"),
      kernel_axes=("embed", "mlp"), intermediate_dim=cfg.moe_mlp_dim, dtype=cfg.dtype,
      weight_dtype=cfg.weight_dtype, quant=quantizations.configure_quantization(cfg),
      rngs=nnx.Rngs(params=seed))
  return cfg, model


def layer_inputs(cfg, seed: int = 1):
  """The layer's input [batch, length, emb] and the cotangent of its output."""
  x_key, cot_key = jax.random.split(jax.random.key(seed))
  shape = (int(cfg.per_device_batch_size) * jax.device_count(), cfg.max_target_length,
           cfg.emb_dim)
  return (jax.random.normal(x_key, shape, jnp.float32).astype(cfg.dtype),
          jax.random.normal(cot_key, shape, jnp.float32).astype(cfg.dtype))


def layer_vjp(cfg, model, x, cot):
  """The layer's output and its vjp for `cot`: (out, dx, {parameter path: gradient})."""
  from flax import nnx  # pylint: disable=import-outside-toplevel
  from flax.linen import partitioning as nn_partitioning  # pylint: disable=import-outside-toplevel

  graphdef, params, rest = nnx.split(model, nnx.Param, ...)

  @jax.jit
  def run(params, rest, x, cot):
    # The rest of the state (the RNG counters the quantized einsums advance) is an input of
    # the differentiated function too, so the module is built and mutated in one trace.
    def forward(params, rest, x):
      return nnx.merge(graphdef, params, rest)(x)[0]
    out, vjp = jax.vjp(forward, params, rest, x)
    dparams, _, dx = vjp(cot.astype(out.dtype))
    return out, dx, dparams

  with nn_partitioning.axis_rules(cfg.logical_axis_rules):
    out, dx, dparams = run(params, rest, x, cot)
  grads = {"/".join(str(getattr(k, "key", k)) for k in path): np.asarray(v)
           for path, v in jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(dparams))[0]}
  return np.asarray(out), np.asarray(dx), grads


FIXTURE = os.path.join(FIXTURE_DIR, "maxtext_moe.npz")


def run_recorded(fn: Callable, record: dict, values: dict, wrt, cot, check_vma: bool):
  """`fn` called as the record says (its positional and keyword arguments, `values` by
  name, with the record's substitutions), per device as MaxText called it; returns
  (out, {name: gradient}) for the operands named in `wrt` and the cotangent `cot` (None:
  no gradients)."""
  values = dict(values, **record.get("substitute", {}))
  leaves, treedef = jax.tree.flatten(values)
  is_array = [isinstance(leaf, jax.Array) for leaf in leaves]
  inputs = [leaf for leaf, array in zip(leaves, is_array) if array]
  vmas = list(record["input_vmas"]) + [record["out_vma"]]
  if len(vmas) != len(inputs) + 1:
    raise ValueError(f"the record has {len(vmas) - 1} input arrays, the call {len(inputs)}")

  def body(*flat):
    *flat, cot = flat
    it = iter(flat)
    rebuilt = jax.tree.unflatten(treedef, [next(it) if array else leaf
                                           for leaf, array in zip(leaves, is_array)])

    def call(*operands):
      v = dict(rebuilt, **dict(zip(wrt, operands)))
      return fn(*[v[n] for n in record["positional"]],
                **{n: v[n] for n in record["keywords"]})

    if cot is None or not wrt:
      return call(*[rebuilt[name] for name in wrt]), ()
    out, vjp = jax.vjp(call, *[rebuilt[name] for name in wrt])
    return out, vjp(cot)

  if cot is None:
    cot = jnp.zeros((), jnp.float32)
    wrt = ()
  out, grads = per_device(body, record["manual_axes"], vmas, check_vma)(*inputs, cot)
  return out, dict(zip(wrt, grads))


def load_fixture(path: str = FIXTURE):
  """({case: spec}, arrays) of the recorded cases."""
  with np.load(path) as npz:  # read whole: a few MB
    arrays = {key: npz[key] for key in npz.files}
  specs = {key[len("spec/"):]: json.loads(str(arrays.pop(key))) for key in list(arrays)
           if key.startswith("spec/")}
  return specs, arrays

