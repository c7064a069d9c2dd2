"""The targets of the deviceless compile commands (`aot`, `aot_pod`), described without the
hardware.

One chip of each accelerator `aot` compiles its kernels for (`TARGETS`), the multi-chip
topologies `aot_pod` compiles training steps for (`TOPOLOGIES`), how jax describes either
on a CPU host (a GPU's from its target description file under ``targets/``; a TPU's after
libtpu's partitioner is registered where a step needs it), the environment of the commands'
compile processes, and the end of their report (the table, its summary, the files)."""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import pathlib

import jax
import numpy as np
from jax.experimental import topologies

from gmm_jax._src import cli
from gmm_jax._src.core.jax_private import register_tpu_partitioner

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


def _topology_desc(platform: str, name: str, target_config: str | None):
  """jax's deviceless description of topology `name` of `platform` ("tpu", else a GPU whose
  target description file under `TARGET_DIR` is `target_config`)."""
  if platform == "tpu":
    return topologies.get_topology_desc(platform="tpu", topology_name=name)
  return topologies.get_topology_desc(platform="cuda", topology=name,
                                      target_config=(TARGET_DIR / target_config).read_text())


def topology_of(target: str):
  """The deviceless topology of a name of `TARGETS` (one chip)."""
  return _topology_desc(*TARGETS[target])


@functools.cache
def chip(target: str):
  """The first device of one chip of `target` (a name of `TARGETS`), described without the
  hardware (a TPU after libtpu's partitioner is registered where it still can be: a one-chip
  program has no custom partitioning, so it compiles either way)."""
  if target not in TARGETS:
    raise ValueError(f"unknown deviceless target {target!r}; use one of {sorted(TARGETS)}")
  if TARGETS[target][0] == "tpu":
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # another process may hold it
    register_tpu_partitioner(strict=False)
  return topology_of(target).devices[0]


def on_chip(target: str, args):
  """`args` (arrays, abstract values, QArrays: any pytree) as abstract values placed on one
  chip of `target`: what a deviceless compile is traced with."""
  sharding = jax.sharding.SingleDeviceSharding(chip(target))
  return jax.tree.map(
      lambda a: None if a is None else jax.ShapeDtypeStruct(np.shape(a), a.dtype,
                                                            sharding=sharding),
      args, is_leaf=lambda a: a is None)


def compile_for(target: str, fn, args):
  """``jax.jit(fn)`` lowered and compiled for one chip of `target` on `args`' shapes and
  dtypes, with that chip as the default device (so gmm picks its kernels): nothing runs."""
  abstract = on_chip(target, args)
  with jax.default_device(chip(target)):
    return jax.jit(fn).lower(*abstract).compile()


def compiling_timer(target: str):
  """A timer of `autotune.min_wall_time`'s signature, ``(fn, args, repeats) -> seconds``,
  that compiles ``fn`` for `target` (`compile_for`) instead of running it: its seconds
  are NaN. The device script's dry run times with it."""
  def timer(fn, args, repeats: int = 1) -> float:
    del repeats
    compile_for(target, fn, args)
    return math.nan
  return timer


# The device kinds of the GPU targets, as jax names the local device.
GPU_TARGET_KINDS = {"NVIDIA H100": "h100", "NVIDIA H200": "h200", "NVIDIA B200": "b200"}


def local_target(kind: str | None = None) -> str:
  """The GPU target of `TARGETS` whose kind the local GPU (or device kind `kind`) is:
  "h100" for "NVIDIA H100 80GB HBM3". ValueError for a GPU gmm_jax has no target for."""
  kind = jax.devices()[0].device_kind if kind is None else kind
  for name, target in sorted(GPU_TARGET_KINDS.items(), key=lambda item: -len(item[0])):
    if name in kind:
      return target
  raise ValueError(f"no deviceless target for the device kind {kind!r}; known: "
                   f"{sorted(GPU_TARGET_KINDS)}")


def describe(topology: Topology):
  """The deviceless topology (TPU: with the partitioner registered first)."""
  if topology.platform == "tpu":
    register_tpu_partitioner()
  return _topology_desc(topology.platform, topology.name, topology.target_config)


def child_env(marker: str) -> dict[str, str]:
  """The environment of a compile process: this one's, with `marker` set, the CPU as jax's
  only platform and libtpu loadable by several processes at once."""
  env = dict(os.environ)
  env[marker] = "1"
  env["JAX_PLATFORMS"] = "cpu"  # the plugins register without touching a device
  env["ALLOW_MULTIPLE_LIBTPU_LOAD"] = "1"  # the compile processes each load libtpu
  return env


def report(rows: list[dict], table: str, lines: list[str], json_path: str | None,
           markdown_path: str | None) -> None:
  """Prints the Markdown `table` after a blank line, then `lines` (the summary and what
  failed), and writes the rows and the table where asked."""
  print()
  print(table)
  for line in lines:
    print(line)
  cli.save_tables(rows, table, json_path, markdown_path)
