"""The layered core of ARCHITECTURE.md, read from the source: every import goes down a
floor (never up, never in a circle), no function-level import dodges one, floor-0 modules
import nothing from gmm_jax, the dispatcher names no backend, and test files never import
each other.

`FLOORS` below is the one floor table: docs/architecture.md's is generated from it and each
module's docstring (``python tests/test_architecture.py --write`` rewrites it; a test fails
when the two differ)."""

from __future__ import annotations

import ast
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent

# Module -> floor. The public package `gmm_jax` (its __init__) re-exports floors 0-6; the
# floor-6 modules use the public API through it or through the modules below them.
FLOORS = {
    "gmm_jax._src.core.config": 0,
    "gmm_jax._src.core.epilogue": 0,
    "gmm_jax._src.core.qarray": 0,
    "gmm_jax._src.core.group_list": 0,
    "gmm_jax._src.core.metadata": 0,
    "gmm_jax._src.core.errors": 0,
    "gmm_jax._src.core.recording": 0,  # GmmShapeError, describe, is_index: imports nothing
    "gmm_jax._src.core.jax_private": 0,  # every private jax API, reached through it
    "gmm_jax._src.core.host_limits": 0,  # the warning before the memory-map limit
    "gmm_jax._src.cli": 0,  # absl flags and the progress bar of the console scripts
    "gmm_jax._src.tiling.chips": 0,  # the chip tables and the TPU target reader
    "gmm_jax._src.tiling.traffic": 0,  # the HBM byte counters of the static cost models
    "gmm_jax._src.core.grouped_array": 1,
    "gmm_jax._src.backends.registry": 1,
    "gmm_jax._src.sharding.strategy": 1,
    "gmm_jax._src.tiling.tuning": 1,
    "gmm_jax._src.tiling.cost_models": 1,
    "gmm_jax._src.backends.reference": 2,
    "gmm_jax._src.backends.xla": 2,
    "gmm_jax._src.backends.lax_ragged_dot": 2,
    "gmm_jax._src.op": 2,
    "gmm_jax._src.op.primitive": 2,
    "gmm_jax._src.op.lowering": 2,
    "gmm_jax._src.op.jvp": 2,
    "gmm_jax._src.op.transpose": 2,
    "gmm_jax._src.op.batching": 2,
    "gmm_jax._src.op.prologue_tangent": 2,
    "gmm_jax._src.op.gated_tangent": 2,
    "gmm_jax._src.op.rows_sum": 2,
    "gmm_jax.pallas": 2,
    "gmm_jax.pallas.common": 2,
    "gmm_jax.pallas.jax_pallas": 2,  # the Pallas modules, by the path this jax prefers
    "gmm_jax.pallas.gpu": 2,
    "gmm_jax.pallas.gpu.triton": 2,
    "gmm_jax.pallas.gpu.triton_kernel": 2,
    "gmm_jax.pallas.gpu.triton_fp8": 2,
    "gmm_jax.pallas.gpu.triton_large": 2,
    "gmm_jax.pallas.gpu.mosaic_gpu": 2,
    "gmm_jax.pallas.gpu.mosaic_gpu_kernel": 2,
    "gmm_jax.pallas.tpu": 2,
    **{f"gmm_jax.pallas.tpu.{name}": 2 for name in (
        "mosaic_tpu", "mosaic_tpu_plan", "mosaic_tpu_kernel", "mosaic_tpu_fp8",
        "mosaic_tpu_tile")},
    "gmm_jax._src.backends.builtin": 3,
    "gmm_jax._src.backends.quantized": 3,
    "gmm_jax._src.sharding.spec": 4,
    "gmm_jax._src.backends.fp8_training": 4,
    "gmm_jax._src.api": 5,
    "gmm_jax._src.validate": 5,
    "gmm_jax._src.explain": 6,
    "gmm_jax._src.moe.routing": 6,
    "gmm_jax._src.moe.experts": 6,
    "gmm_jax._src.moe.layout": 6,
    "gmm_jax._src.moe.partitioned": 6,
    "gmm_jax._src.ragged_dot": 6,
    "gmm_jax.nn": 6,
    **{f"gmm_jax.nn.{name}": 6 for name in (
        "params", "grouped_linear", "router", "expert_ffn", "shared", "dispatch", "config",
        "presets", "moe", "linen", "hf", "hf_architectures", "hf_options", "hf_weights",
        "hf_unsupported")},
    "gmm_jax.tools": 6,  # the tools' package face
    "gmm_jax.tools.bench": 6,
    "gmm_jax.tools.bench_host": 6,
    "gmm_jax.tools.bench_accel": 6,
    "gmm_jax.tools.bench_moe": 6,
    "gmm_jax.tools.bench_decode": 6,
    "gmm_jax.tools.bench_fallback": 6,
    "gmm_jax.examples": 7,  # built on gmm_jax.nn (floor 6)
    "gmm_jax.examples.train_moe": 7,
    "gmm_jax.tools.aot": 6,
    "gmm_jax.tools.aot_cases": 6,
    "gmm_jax.tools.aot_code": 6,
    "gmm_jax.tools.aot_model": 6,
    "gmm_jax.tools.aot_measure": 6,
    "gmm_jax.tools.aot_compile": 6,
    "gmm_jax.tools.deviceless": 6,  # the targets of aot and aot_pod
    "gmm_jax.tools.aot_pod": 7,  # compiles gmm_jax.nn (floor 6) training steps
    "gmm_jax.tools.aot_pod_hlo": 7,
    "gmm_jax.tools.aot_pod_steps": 7,
    "gmm_jax.tools.aot_pod_compile": 7,
    "gmm_jax._src.tiling.autotune": 6,
    "gmm_jax.demo": 6,
    "gmm_jax.compat": 6,
    "gmm_jax.compat.onednn": 6,
    "gmm_jax.compat.megablox": 6,
    "gmm_jax.compat.tokamax": 6,
    "gmm_jax.compat.ascend": 6,
    "gmm_jax.compat._ascend_rules": 6,
    "gmm_jax.compat._ascend_scales": 6,
    "gmm_jax._src": 0,
    # The role packages: empty faces (they import nothing), their modules on their floors.
    **{f"gmm_jax._src.{name}": 0 for name in ("core", "backends", "tiling", "sharding", "moe")},
    "gmm_jax": 7,
}
PUBLIC_PACKAGE = "gmm_jax"
# Imports between modules of one floor that are part of one unit: a kernel package and its
# shared preamble, a package and its modules, a facade and its helper modules.
SAME_FLOOR = {
    # The accessors of jax's private APIs: a leaf that imports nothing from gmm_jax, which
    # the floor-0 modules that need one of them use.
    *((f"gmm_jax._src.{name}", "gmm_jax._src.core.jax_private")
      for name in ("tiling.chips",)),
    # Every kernel module takes its Pallas modules from one place.
    *((module, "gmm_jax.pallas.jax_pallas") for module in (
        "gmm_jax.pallas.common", "gmm_jax.pallas.gpu.triton", "gmm_jax.pallas.gpu.triton_kernel",
        "gmm_jax.pallas.gpu.mosaic_gpu", "gmm_jax.pallas.gpu.mosaic_gpu_kernel",
        *(f"gmm_jax.pallas.tpu.{name}" for name in (
            "mosaic_tpu", "mosaic_tpu_plan", "mosaic_tpu_kernel", "mosaic_tpu_fp8")))),
    # The error type and how messages name values: a leaf that imports nothing, which the
    # floor-0 data modules use for their messages.
    ("gmm_jax._src.core.qarray", "gmm_jax._src.core.errors"),
    # The op package: its rules are built on its primitive module.
    *((f"gmm_jax._src.op{suffix}", "gmm_jax._src.op.primitive")
      for suffix in ("", ".lowering", ".jvp", ".transpose", ".batching", ".prologue_tangent")),
    *(("gmm_jax._src.op", f"gmm_jax._src.op.{name}")
      for name in ("lowering", "jvp", "transpose", "batching", "prologue_tangent")),
    # The jvp emits the joint tangent of a gated prologue, whose transpose is built on the
    # gmm's own transpose rule.
    ("gmm_jax._src.op.jvp", "gmm_jax._src.op.prologue_tangent"),
    ("gmm_jax._src.op.prologue_tangent", "gmm_jax._src.op.transpose"),
    ("gmm_jax.pallas.tpu", "gmm_jax.pallas.common"),
    # The Mosaic TPU kernel package: its face takes the op and the tiling rules; the op
    # builds on the plan, the kernel bodies and the fp8 helpers; the kernels on the tiling
    # rules, the fp8 helpers and the tile operations; each on the shared preamble.
    *(("gmm_jax.pallas.tpu", f"gmm_jax.pallas.tpu.{name}")
      for name in ("mosaic_tpu", "mosaic_tpu_plan")),
    *((f"gmm_jax.pallas.tpu.{a}", f"gmm_jax.pallas.tpu.{b}") for a, b in (
        ("mosaic_tpu", "mosaic_tpu_plan"), ("mosaic_tpu", "mosaic_tpu_kernel"),
        ("mosaic_tpu", "mosaic_tpu_fp8"), ("mosaic_tpu_kernel", "mosaic_tpu_plan"),
        ("mosaic_tpu_kernel", "mosaic_tpu_fp8"), ("mosaic_tpu_kernel", "mosaic_tpu_tile"),
        ("mosaic_tpu_plan", "mosaic_tpu_fp8"), ("mosaic_tpu_plan", "mosaic_tpu_tile"),
        ("mosaic_tpu_fp8", "mosaic_tpu_tile"))),
    *((f"gmm_jax.pallas.tpu.{name}", "gmm_jax.pallas.common") for name in (
        "mosaic_tpu", "mosaic_tpu_plan", "mosaic_tpu_kernel", "mosaic_tpu_fp8",
        "mosaic_tpu_tile")),
    ("gmm_jax.pallas.gpu", "gmm_jax.pallas.gpu.triton"),
    ("gmm_jax.pallas.gpu", "gmm_jax.pallas.common"),
    # The Triton op wrapper, its kernel bodies, their fp8 dot and their large-operand words.
    *((f"gmm_jax.pallas.gpu.{a}", f"gmm_jax.pallas.{b}")
      for a, b in (("triton", "common"), ("triton", "gpu.triton_kernel"),
                   ("triton", "gpu.triton_fp8"), ("triton", "gpu.triton_large"),
                   ("triton_kernel", "common"), ("triton_kernel", "gpu.triton_fp8"),
                   ("triton_kernel", "gpu.triton_large"))),
    # The Mosaic GPU op wrapper and its kernel bodies.
    ("gmm_jax.pallas.gpu.mosaic_gpu", "gmm_jax.pallas.common"),
    ("gmm_jax.pallas.gpu.mosaic_gpu", "gmm_jax.pallas.gpu.mosaic_gpu_kernel"),
    ("gmm_jax.pallas.gpu", "gmm_jax.pallas.gpu.mosaic_gpu"),
    # The rules and the primitive's composed form use the op's two small primitives (the
    # one-op gated tangent, the fixed-order row sum).
    *((f"gmm_jax._src.op.{name}", "gmm_jax._src.op.gated_tangent")
      for name in ("primitive", "jvp", "transpose")),
    ("gmm_jax._src.op.transpose", "gmm_jax._src.op.rows_sum"),
    ("gmm_jax.compat.ascend", "gmm_jax.compat._ascend_rules"),
    ("gmm_jax.compat.ascend", "gmm_jax.compat._ascend_scales"),
    ("gmm_jax.compat._ascend_rules", "gmm_jax.compat._ascend_scales"),
    ("gmm_jax.demo", "gmm_jax.tools.bench_host"),  # the demo prints a benchmark table
    # the benchmark times as the autotuner does
    ("gmm_jax.tools.bench_host", "gmm_jax._src.tiling.autotune"),
    # The benchmark command on its tables, the accelerator tables on the shared timing.
    ("gmm_jax.tools.bench", "gmm_jax.tools.bench_host"),
    ("gmm_jax.tools.bench", "gmm_jax.tools.bench_accel"),
    ("gmm_jax.tools.bench_accel", "gmm_jax.tools.bench_host"),
    ("gmm_jax.tools.bench_moe", "gmm_jax._src.tiling.autotune"),
    ("gmm_jax.tools.bench_fallback", "gmm_jax.tools.deviceless"),  # the same targets
    # The deviceless compile commands: a command (its flags and compile processes) on the
    # modules of its parts, and the targets both share.
    *(("gmm_jax.tools.aot", f"gmm_jax.tools.{name}")
      for name in ("aot_cases", "aot_compile", "deviceless")),
    *(("gmm_jax.tools.aot_compile", f"gmm_jax.tools.{name}")
      for name in ("aot_cases", "aot_code", "aot_model", "deviceless")),
    # The device-side check of the model times the cases' programs.
    ("gmm_jax.tools.aot_measure", "gmm_jax.tools.aot_cases"),
    # The device script's tools compile for a deviceless chip in its dry run.
    *((f"gmm_jax.tools.{name}", "gmm_jax.tools.deviceless")
      for name in ("aot_measure", "bench_accel", "bench_moe")),
    *(("gmm_jax.tools.aot_pod", f"gmm_jax.tools.{name}")
      for name in ("aot_pod_compile", "aot_pod_steps")),
    *(("gmm_jax.tools.aot_pod_compile", f"gmm_jax.tools.{name}")
      for name in ("aot_pod_hlo", "aot_pod_steps")),
    # The public gmm routes the call its argument checks made canonical.
    ("gmm_jax._src.api", "gmm_jax._src.validate"),
    # The experts' FFN routes its tokens; the routed-experts op splits it by its layouts and
    # moves rows with the routing transports; the layer composes them (and checks its
    # transport among the routing's).
    ("gmm_jax._src.moe.experts", "gmm_jax._src.moe.routing"),
    *(("gmm_jax._src.moe.partitioned", f"gmm_jax._src.moe.{name}")
      for name in ("experts", "layout", "routing")),
    ("gmm_jax.nn.config", "gmm_jax._src.moe.routing"),
    ("gmm_jax.nn", "gmm_jax._src.moe.experts"),
    # The Flax layers package: its modules build on each other (the circle test still
    # holds) and on the routed-experts op.
    *((a, b) for a in ("gmm_jax.nn", "gmm_jax.nn.params", "gmm_jax.nn.grouped_linear",
                       "gmm_jax.nn.router", "gmm_jax.nn.expert_ffn", "gmm_jax.nn.shared",
                       "gmm_jax.nn.dispatch", "gmm_jax.nn.config", "gmm_jax.nn.presets",
                       "gmm_jax.nn.moe", "gmm_jax.nn.linen", "gmm_jax.nn.hf",
                       "gmm_jax.nn.hf_architectures", "gmm_jax.nn.hf_options",
                       "gmm_jax.nn.hf_weights", "gmm_jax.nn.hf_unsupported")
      for b in ("gmm_jax._src.moe.experts", "gmm_jax.nn.params", "gmm_jax.nn.grouped_linear",
                "gmm_jax.nn.router", "gmm_jax.nn.expert_ffn", "gmm_jax.nn.shared",
                "gmm_jax.nn.dispatch", "gmm_jax.nn.config", "gmm_jax.nn.presets",
                "gmm_jax.nn.moe", "gmm_jax.nn.linen", "gmm_jax.nn.hf",
                "gmm_jax.nn.hf_architectures", "gmm_jax.nn.hf_options",
                "gmm_jax.nn.hf_weights", "gmm_jax.nn.hf_unsupported")),
}
# Function-level (or try-guarded) imports are for optional dependencies only: flax and the
# comparison libraries. (jax's private modules are imported by name in one module,
# `jax_private`, through importlib.)
OPTIONAL = ("flax", "tokamax", "qwix")
# The one module that may reach jax's private modules (``jax._src``).
JAX_PRIVATE = "gmm_jax._src.core.jax_private"


def _module_name(path: pathlib.Path) -> str:
  relative = path.relative_to(ROOT).with_suffix("")
  parts = list(relative.parts)
  if parts[0] == "pallas":  # installed as gmm_jax.pallas
    parts = ["gmm_jax"] + parts
  if parts[-1] == "__init__":
    parts = parts[:-1]
  return ".".join(parts)


def _sources():
  paths = list((ROOT / "gmm_jax").rglob("*.py")) + list((ROOT / "pallas").rglob("*.py"))
  return {_module_name(p): ast.parse(p.read_text(), str(p)) for p in paths}


def _imports(tree: ast.Module, known: set[str]):
  """(target module, line, at module level) of every import of a gmm_jax module."""
  top_level = {id(node) for node in tree.body}
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      targets = [alias.name for alias in node.names]
    elif isinstance(node, ast.ImportFrom) and node.module:
      # `from package import module` imports the module; `from module import name` the module.
      targets = [f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}" in known
                 else node.module for alias in node.names]
    else:
      continue
    for target in targets:
      yield target, node.lineno, id(node) in top_level


@pytest.fixture(scope="module")
def graph():
  sources = _sources()
  edges = {}
  for module, tree in sources.items():
    edges[module] = [(t, line, top) for t, line, top in _imports(tree, set(sources))
                     if t == PUBLIC_PACKAGE or t.startswith(PUBLIC_PACKAGE + ".")]
  return sources, edges


def test_every_module_has_a_floor(graph):
  sources, _ = graph
  assert set(sources) - set(FLOORS) == set(), "give new modules a floor in this test"


def test_imports_go_down_a_floor(graph):
  _, edges = graph
  upward = []
  for module, targets in edges.items():
    for target, line, _ in targets:
      if target == PUBLIC_PACKAGE and FLOORS[module] == 6:
        continue  # floor 6 is built on the public API
      if (module, target) in SAME_FLOOR:
        continue
      if FLOORS[target] >= FLOORS[module] and module != PUBLIC_PACKAGE:
        upward.append(f"{module}:{line} (floor {FLOORS[module]}) imports {target} "
                      f"(floor {FLOORS[target]})")
  assert not upward, "\n".join(upward)


def test_floor_0_imports_nothing_from_gmm_jax(graph):
  _, edges = graph
  offenders = [(m, t) for m, targets in edges.items() if FLOORS[m] == 0
               for t, _, _ in targets if (m, t) not in SAME_FLOOR]
  assert not offenders


def test_no_import_circle(graph):
  _, edges = graph
  adjacency = {m: sorted({t for t, _, _ in targets if t in edges}) for m, targets in edges.items()}
  state, path = {}, []

  def visit(module):
    state[module] = "open"
    path.append(module)
    for target in adjacency[module]:
      if state.get(target) == "open":
        raise AssertionError("import circle: " + " -> ".join(path[path.index(target):] +
                                                              [target]))
      if target not in state:
        visit(target)
    path.pop()
    state[module] = "done"

  for module in sorted(adjacency):
    if module not in state:
      visit(module)


def test_no_function_level_import_of_gmm_jax_or_a_required_dependency():
  offenders = []
  for module, tree in _sources().items():
    top_level = {id(node) for node in tree.body}
    for node in ast.walk(tree):
      if isinstance(node, (ast.Import, ast.ImportFrom)) and id(node) not in top_level:
        names = [node.module] if isinstance(node, ast.ImportFrom) else [
            a.name for a in node.names]
        for name in names:
          if not any(name == o.rstrip(".") or name.startswith(o) for o in OPTIONAL):
            offenders.append(f"{module}:{node.lineno} imports {name} inside a function")
  assert not offenders, "\n".join(offenders)


def test_only_jax_private_reaches_jax_internals():
  """No module but `jax_private` imports ``jax._src`` or ``jaxlib``, or names one of their
  modules in a string outside a docstring (an ``importlib`` path): every private jax API
  gmm_jax uses has its one accessor there, tested on every supported jax."""
  offenders = []
  for module, tree in _sources().items():
    if module == JAX_PRIVATE:
      continue
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef))
                  and node.body and isinstance(node.body[0], ast.Expr)}
    for node in ast.walk(tree):
      if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
      elif isinstance(node, ast.ImportFrom):
        names = [node.module or ""]
      elif (isinstance(node, ast.Constant) and isinstance(node.value, str)
            and id(node) not in docstrings):
        names = [node.value]
      else:
        continue
      offenders += [f"{module}:{node.lineno} {name}" for name in names
                    if name.startswith(("jax._src", "jaxlib"))]
  assert not offenders, "\n".join(offenders)


def test_the_dispatcher_names_no_backend():
  text = (ROOT / "gmm_jax" / "_src" / "backends" / "registry.py").read_text()
  for name in ("\"xla\"", "\"reference\"", "pallas_triton", "pallas_tpu", "gmm_jax.pallas"):
    assert name not in text, name


def test_backends_never_import_the_layers_above_them(graph):
  _, edges = graph
  backends = ["gmm_jax._src.backends.reference", "gmm_jax._src.backends.xla", "gmm_jax._src.backends.lax_ragged_dot",
              "gmm_jax.pallas.common",
              *(f"gmm_jax.pallas.tpu.{name}" for name in (
                  "mosaic_tpu", "mosaic_tpu_plan", "mosaic_tpu_kernel", "mosaic_tpu_fp8",
                  "mosaic_tpu_tile")),
              *(f"gmm_jax.pallas.gpu.{name}" for name in (
                  "triton", "triton_kernel", "triton_fp8", "triton_large", "mosaic_gpu",
                  "mosaic_gpu_kernel"))]
  forbidden = {"gmm_jax._src.backends.registry", "gmm_jax._src.op", "gmm_jax._src.backends.quantized",
               "gmm_jax._src.api"}
  for module in backends:
    assert not {t for t, _, _ in edges[module]} & forbidden, module


def test_test_files_never_import_each_other():
  offenders = []
  for path in (ROOT / "tests").glob("*.py"):
    for node in ast.walk(ast.parse(path.read_text())):
      names = []
      if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
      elif isinstance(node, ast.ImportFrom) and node.module:
        names = [node.module]
      offenders += [f"{path.name} imports {n}" for n in names if n.startswith("test_")]
  assert not offenders, offenders


# ------------------------------------------------------------ the docs' generated floor table

DOCS = ROOT / "docs" / "architecture.md"
TABLE_START = "<!-- floors: generated by `python tests/test_architecture.py --write` -->"
TABLE_END = "<!-- floors: end -->"


def _path(module: str) -> str:
  """The module's file, as the repository holds it (`pallas/` installs as gmm_jax.pallas)."""
  parts = module.split(".")
  if parts[:2] == ["gmm_jax", "pallas"]:
    parts = parts[1:]
  base = ROOT.joinpath(*parts)
  return str((base / "__init__.py" if base.is_dir() else base.with_suffix(".py"))
             .relative_to(ROOT))


def _job(tree: ast.Module) -> str:
  """The first sentence of a module's docstring: its one job."""
  text = " ".join((ast.get_docstring(tree) or "").split("\n\n")[0].split())
  end = text.find(". ")
  return (text if end < 0 else text[:end + 1]).replace("|", "\\|")


def floor_table() -> str:
  """The floor table of docs/architecture.md, from `FLOORS` and the modules' docstrings:
  every module with a docstring, by floor then path."""
  sources = _sources()
  rows = sorted((FLOORS[m], _path(m), _job(tree)) for m, tree in sources.items()
                if m in FLOORS and ast.get_docstring(tree))
  lines = ["| floor | module | its one job (the docstring's first sentence) |", "|---|---|---|"]
  lines += [f"| {floor} | `{path}` | {job} |" for floor, path, job in rows]
  return "\n".join(lines)


def _docs_table(text: str) -> tuple[int, int]:
  start, end = text.find(TABLE_START), text.find(TABLE_END)
  assert 0 <= start < end, f"{DOCS} lost the markers of its generated floor table"
  return start + len(TABLE_START), end


def test_the_docs_floor_table_is_generated_from_floors():
  text = DOCS.read_text()
  start, end = _docs_table(text)
  assert text[start:end].strip() == floor_table(), (
      f"{DOCS}'s floor table differs from FLOORS and the docstrings: run "
      "`python tests/test_architecture.py --write`")


# ------------------------------------------------------- the docs' generated house drawing

HOUSE_START = "<!-- house: generated by `python tests/test_architecture.py --write` -->"
HOUSE_END = "<!-- house: end -->"
# The units of the tree (its folders, the kernels' two families apart), most specific first:
# a module belongs to the first unit whose package it is in.
UNITS = ("gmm_jax.pallas.tpu", "gmm_jax.pallas.gpu", "gmm_jax.pallas", "gmm_jax._src.core",
         "gmm_jax._src.op", "gmm_jax._src.backends", "gmm_jax._src.tiling",
         "gmm_jax._src.sharding", "gmm_jax._src.moe", "gmm_jax._src", "gmm_jax.nn",
         "gmm_jax.compat", "gmm_jax.tools", "gmm_jax.examples", "gmm_jax")
WIDTH = 96


def _unit(module: str) -> str:
  return next(u for u in UNITS if module == u or module.startswith(u + "."))


def _folder(unit: str) -> str:
  """A unit as its folder in the tree: below `gmm_jax/`, and `pallas/` at the top level."""
  if unit == PUBLIC_PACKAGE:
    return "gmm_jax/"
  parts = unit.split(".")[1:]
  return "/".join(parts) + "/"


def _wrapped(head: str, items: list[str], indent: str) -> list[str]:
  """`head` then the items, comma-separated, wrapped at WIDTH with `indent`."""
  lines, line = [], head
  for i, item in enumerate(items):
    text = item + ("," if i < len(items) - 1 else "")
    if len(line) + len(text) + 1 > WIDTH and line.strip() != head.strip():
      lines.append(line.rstrip())
      line = indent
    line += text + " "
  return lines + [line.rstrip()]


def house() -> str:
  """docs/architecture.md's drawing of the house, from the tree: each floor (top first) with
  its rooms (the modules on it, by folder), then which folders each folder's module-level
  imports reach."""
  sources = _sources()
  rooms = {}
  for module in sorted(sources):
    if module in FLOORS and (module == PUBLIC_PACKAGE or FLOORS[module] > 0
                             or not _path(module).endswith("__init__.py")):
      name = "__init__" if module == _unit(module) else module.split(".")[-1]
      rooms.setdefault(FLOORS[module], {}).setdefault(_unit(module), []).append(name)
  lines = []
  for floor in sorted(rooms, reverse=True):
    lines.append(f"+-- floor {floor} " + "-" * (WIDTH - 13))
    for unit in sorted(rooms[floor], key=UNITS.index):
      lines += _wrapped(f"| {_folder(unit):16}", rooms[floor][unit], "|" + " " * 17)
  lines += ["+" + "-" * (WIDTH - 1), "", "Imports (module level), folder -> folders:"]
  reach = {}
  for module, tree in sources.items():
    for target, _, top in _imports(tree, set(sources)):
      if top and target in sources and _unit(target) != _unit(module):
        reach.setdefault(_unit(module), set()).add(_unit(target))
  for unit in UNITS:
    if unit in reach:
      lines += _wrapped(f"  {_folder(unit):15} -> ", [
          _folder(t) for t in sorted(reach[unit], key=UNITS.index)], " " * 21)
  return "```text\n" + "\n".join(lines) + "\n```"


def _marked(text: str, start_marker: str, end_marker: str) -> tuple[int, int]:
  start, end = text.find(start_marker), text.find(end_marker)
  assert 0 <= start < end, f"{DOCS} lost the markers {start_marker!r} ... {end_marker!r}"
  return start + len(start_marker), end


def test_the_docs_house_is_drawn_from_the_tree():
  text = DOCS.read_text()
  start, end = _marked(text, HOUSE_START, HOUSE_END)
  assert text[start:end].strip() == house(), (
      f"{DOCS}'s house drawing differs from the tree: run "
      "`python tests/test_architecture.py --write`")


if __name__ == "__main__" and sys.argv[1:] == ["--write"]:
  current = DOCS.read_text()
  begin, finish = _docs_table(current)
  current = current[:begin] + "\n" + floor_table() + "\n" + current[finish:]
  begin, finish = _marked(current, HOUSE_START, HOUSE_END)
  DOCS.write_text(current[:begin] + "\n" + house() + "\n" + current[finish:])
