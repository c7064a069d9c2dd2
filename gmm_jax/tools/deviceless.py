"""The targets of the deviceless compile commands (`aot`, `aot_pod`), described without the
hardware.

One chip of each accelerator `aot` compiles its kernels for (`TARGETS`), the multi-chip
topologies `aot_pod` compiles training steps for (`TOPOLOGIES`), how jax describes either
on a CPU host (a GPU's from its target description file under ``targets/``; a TPU's after
libtpu's partitioner is registered where a step needs it), the environment of the commands'
compile processes, and the end of their report (the table, its summary, the files)."""

from __future__ import annotations

import dataclasses
import os
import pathlib

from jax._src import custom_partitioning  # noqa: F401  (its plugin callback; private)
from jax._src import xla_bridge  # private: the PJRT plugin registry
from jax._src.lib import xla_client  # private: the PJRT plugin loader
from jax.experimental import topologies

from gmm_jax._src import cli

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
