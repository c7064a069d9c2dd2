"""Compiles one training step of `gmm_jax.tools.aot_pod` deviceless and reports it as a row.

The `Row` says whether it compiled (or the first line of its error), its per-device memory,
the bytes of each kind of collective and of whole expert weights all-gathered, the gmm
implementations and the kernel calls; the rows print as lines and as the Markdown table,
and `failures` says which of them fail ``--require``."""

from __future__ import annotations

import contextlib
import dataclasses
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from gmm_jax._src.backends import registry
from gmm_jax.tools.aot_pod_hlo import (COLLECTIVES, CUSTOM_PARTITIONING, collective_bytes,
                                       kernel_calls, weight_gather_bytes)
from gmm_jax.tools.aot_pod_steps import (BASELINES, IN_MESH, MODELS, abstract_layer,
                                         expert_weight_shapes, grouped_linear_loss, label,
                                         mesh_shape, nnx_loss, ragged_dot_loss, sgd_step)
from gmm_jax.tools.deviceless import GIB, TOPOLOGIES, describe


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


def first_line(error: BaseException) -> str:
  """`error`'s type and the first line of its message that says something (jax prefixes
  some errors with a blank line or a traceback note)."""
  for line in str(error).splitlines():
    line = line.strip()
    if line and not line.startswith(("jax.errors.SimplifiedTraceback", "---")):
      return f"{type(error).__name__}: {line}"[:400]
  return type(error).__name__


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
    with context, jax.default_device(devices[0]), registry.record() as decisions:
      lowered = step.lower(*args)
      row.custom_partitionings = lowered.as_text().count(CUSTOM_PARTITIONING)
      compiled = lowered.compile()
    row.seconds = time.perf_counter() - start
  except Exception as err:  # noqa: BLE001  (a failure is a reported result)
    row.seconds = time.perf_counter() - start
    row.status, row.error = "FAIL", first_line(err)
    row.detail = traceback.format_exc()[-3000:]
    return row
  _read_compiled(row, compiled, probe, decisions)
  return row


def _read_compiled(row: Row, compiled, probe, decisions) -> None:
  """Fills `row` with what the compiled step says: its memory, its collectives and weight
  all-gathers (`probe`: the layer, for its expert weights' shapes), the implementations
  the dispatcher chose (`decisions`) and the kernel calls."""
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
    cells = [r["model"], r["topology"], r["mesh"], row_label(r), status,
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


def row_label(r: dict) -> str:
  """A row's step as the table names it (`label`)."""
  return label(r["strategy"], r.get("buffer_factor"))


def failures(rows: list[dict], required: tuple[str, ...]) -> list[str]:
  """Why the rows of the `required` strategies (with any buffer factor) fail `--require`: a
  step that did not compile, (a gmm_jax strategy) one that all-gathers a whole expert
  weight, or a TPU program with a `custom_partitioning` call."""
  found = []
  for r in rows:
    if r["strategy"] not in required:
      continue
    name = f"{r['model']} {r['topology']} {row_label(r)}"
    if r["status"] != "ok":
      found.append(f"{name}: {r['status']}: {r['error']}")
    elif r["strategy"] not in BASELINES and r["weight_gather_bytes"]:
      found.append(f"{name}: all-gathers {size(r['weight_gather_bytes'])} of expert weights")
    topology = TOPOLOGIES.get(r["topology"])
    if topology is not None and topology.platform == "tpu" and r.get("custom_partitionings"):
      found.append(f"{name}: {r['custom_partitionings']} custom_partitioning calls in a TPU "
                   "program (libtpu has no partitioner for them)")
  return found


def row_line(r: dict) -> str:
  """A row as one line of the command's output."""
  if r["status"] != "ok":
    return (f"[{r['status']}] {r['model']} {r['topology']} {row_label(r)} "
            f"({r['seconds']:.0f} s): {r['error']}")
  collectives_ = ", ".join(f"{k} {size(v)}" for k, v in r["collective_bytes"].items() if v)
  return (f"[ok] {r['model']} {r['topology']} {r['mesh']} {row_label(r)} "
          f"({r['seconds']:.0f} s): peak {size(r['peak_bytes'])} of {size(r['hbm_bytes'])} "
          f"(temp {size(r['temp_bytes'])}); {collectives_ or 'no collectives'}; weight "
          f"all-gather {size(r['weight_gather_bytes'])}; {_counts(r['implementations'])}; "
          f"kernels {_counts(r['kernels'])}")
