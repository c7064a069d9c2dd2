"""Which tiling a backend uses for a gmm: the user's, the autotuner's cache, the built-in
per-target tile table, or the backend's heuristic, in that order.

Floor 1. The tile tables are data (`tile_tables.json` beside this module): rows of
(implementation, device kind, grouping, dtype, shape class) -> tiling, loaded with a
duplicate-key check. The autotuner's cache (`gmm_jax.autotune`) is a JSON file keyed by the
whole `Problem`; gmm reads it at trace time. Backends call `choose` with their heuristic.

Lookup keys:
  * device kind: the kind of the device the call is compiled for (the default device when
    it is of the call's platform, e.g. a deviceless target under `jax.default_device`, else
    the platform's first device), "*" in a table row for any.
  * dtype: the stored operand dtype name, "lhs x rhs" when they differ (e.g.
    "bfloat16xint8" for int8 weights); "*" in a table row for any.
  * shape class: from the grouped dimension per local group (rows for m-grouping, K for
    k-grouping): "decode" under 64, "small" under 512, else "large"; "*" for any.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
import pathlib
import threading
from typing import Callable

import jax
import numpy as np

from gmm_jax._src.core import recording
from gmm_jax._src.core.config import GmmConfig, Problem, Tiling, Tilings

TABLE_PATH = pathlib.Path(__file__).with_name("tile_tables.json")
CACHE_ENV = "GMM_JAX_AUTOTUNE_CACHE"
CACHE_FORMAT = 1
SHAPE_CLASSES = ("decode", "small", "large")
_JAX_PLATFORM = {"gpu": ("cuda", "rocm", "gpu"), "tpu": ("tpu",), "cpu": ("cpu",)}


# ------------------------------------------------------------------------------ problems


def device_kind(platform: str | None) -> str | None:
  """The kind of the device a call on `platform` is compiled for, None if unknown.

  The default device (``jax.default_device``, how a deviceless compile names its target)
  when it is of that platform, else the platform's first local device.
  """
  if platform is None:
    return None
  names = _JAX_PLATFORM.get(platform, (platform,))
  default = jax.config.jax_default_device
  if isinstance(default, jax.Device) and default.platform in names:
    return default.device_kind
  for name in names:
    try:
      return jax.devices(name)[0].device_kind
    except RuntimeError:  # no such backend in this process
      continue
  return None


def shape_class(group_type: str, m: int, k: int, num_local: int) -> str:
  """"decode", "small" or "large": the grouped dimension per local group (see the module
  docstring)."""
  per_group = (m if group_type == "m" else k) / max(1, num_local)
  return "decode" if per_group < 64 else ("small" if per_group < 512 else "large")


def dtype_key(lhs_dtype, rhs_dtype) -> str:
  lhs, rhs = np.dtype(lhs_dtype).name, np.dtype(rhs_dtype).name
  return lhs if lhs == rhs else f"{lhs}x{rhs}"


def make_problem(implementation: str, platform: str | None, lhs, rhs, counts, cfg: GmmConfig,
                 dims: tuple[int, int, int], quant_mode: str = "none") -> Problem:
  """The `Problem` of a canonical call as `implementation` runs it (lhs/rhs: the stored
  values, quantized values for QArrays; a gated prologue quantized in-kernel,
  ``cfg.quantize_prologue``, multiplies its 8-bit values)."""
  m, k, n = dims
  lhs_dtype = (lhs.dtype if getattr(cfg, "quantize_prologue", None) is None
               else cfg.quantize_prologue[0])
  return Problem(implementation=implementation, platform=platform,
                 device_kind=device_kind(platform), group_type=cfg.group_type, m=int(m),
                 k=int(k), n=int(n), num_groups=int(counts.shape[0]),
                 num_local=int(cfg.num_local), lhs_dtype=np.dtype(lhs_dtype),
                 rhs_dtype=np.dtype(rhs.dtype), out_dtype=np.dtype(cfg.out_dtype),
                 quant_mode=quant_mode, transpose_lhs=bool(cfg.transpose_lhs),
                 transpose_rhs=bool(cfg.transpose_rhs))


def forward_tiling(tiling):
  """The entry of ``GmmConfig.tiling`` that applies to the gmm itself (`Tilings.fwd`)."""
  return tiling.fwd if isinstance(tiling, Tilings) else tiling


def backward_tiling(tiling, role: str):
  """The ``GmmConfig.tiling`` of a backward gmm ("dlhs" or "drhs") of a call with
  `tiling`: the `Tilings` entry, the same callable, or None (a fixed `Tiling` was chosen
  for the forward's shapes)."""
  if isinstance(tiling, Tilings):
    return getattr(tiling, role)
  return tiling if callable(tiling) and not isinstance(tiling, Tiling) else None


# ------------------------------------------------------------------------------- tables


TableKey = tuple[str, str, str, str, str]  # implementation, device kind, grouping, dtype, class


def _no_duplicate_keys(pairs):
  seen = {}
  for key, value in pairs:
    if key in seen:
      raise ValueError(f"duplicate JSON key {key!r}")
    seen[key] = value
  return seen


def _read_json(path: pathlib.Path):
  with open(path) as f:
    return json.load(f, object_pairs_hook=_no_duplicate_keys)


def _tiling_from(entry: dict, where: str) -> Tiling:
  try:
    return Tiling(**entry)
  except (TypeError, ValueError) as err:
    raise ValueError(f"{where}: bad tiling {entry!r}: {err}") from None


def parse_table(data, source: str = "tile table") -> dict[TableKey, Tiling]:
  """Rows of a tile table -> {(implementation, device kind, grouping, dtype, class): Tiling}.

  Raises:
    ValueError: a malformed row, an unknown grouping or shape class, or two rows with the
      same key.
  """
  if not isinstance(data, dict) or not isinstance(data.get("rows"), list):
    raise ValueError(f"{source}: expected an object with a list of 'rows'")
  table: dict[TableKey, Tiling] = {}
  fields = ("implementation", "device_kind", "group_type", "dtype", "shape_class")
  for i, row in enumerate(data["rows"]):
    where = f"{source} row {i}"
    missing = [f for f in (*fields, "tiling") if f not in row]
    if missing:
      raise ValueError(f"{where}: missing {missing} in {row!r}")
    key = tuple(str(row[f]) for f in fields)
    if key[2] not in ("m", "k"):
      raise ValueError(f"{where}: group_type must be 'm' or 'k', got {key[2]!r}")
    if key[4] not in (*SHAPE_CLASSES, "*"):
      raise ValueError(f"{where}: shape_class must be one of {SHAPE_CLASSES} or '*', got "
                       f"{key[4]!r}")
    if key in table:
      raise ValueError(f"{where}: duplicate key {key} (rows must be unique)")
    table[key] = _tiling_from(row["tiling"], where)
  return table


@functools.lru_cache(maxsize=None)
def builtin_table() -> dict[TableKey, Tiling]:
  """The tile tables shipped with gmm_jax (`tile_tables.json`)."""
  return parse_table(_read_json(TABLE_PATH), TABLE_PATH.name)


def table_lookup(problem: Problem, table: dict[TableKey, Tiling] | None = None):
  """(Tiling, key) of the most specific table row for `problem`, or (None, None)."""
  table = builtin_table() if table is None else table
  kind = problem.device_kind or ""
  cls = shape_class(problem.group_type, problem.m, problem.k, problem.num_local)
  dtype = dtype_key(problem.lhs_dtype, problem.rhs_dtype)
  for key in ((problem.implementation, kind, problem.group_type, dtype, cls),
              (problem.implementation, kind, problem.group_type, dtype, "*"),
              (problem.implementation, kind, problem.group_type, "*", cls),
              (problem.implementation, kind, problem.group_type, "*", "*"),
              (problem.implementation, "*", problem.group_type, dtype, cls),
              (problem.implementation, "*", problem.group_type, "*", cls),
              (problem.implementation, "*", problem.group_type, "*", "*")):
    if key in table:
      return table[key], key
  return None, None


# -------------------------------------------------------------------- autotuning cache


def cache_path() -> pathlib.Path:
  """The autotuner's cache: ``$GMM_JAX_AUTOTUNE_CACHE``, else
  ``~/.cache/gmm_jax/autotune.json``."""
  path = os.environ.get(CACHE_ENV)
  if path:
    return pathlib.Path(path)
  return pathlib.Path(os.path.expanduser("~")) / ".cache" / "gmm_jax" / "autotune.json"


def problem_key(problem: Problem) -> str:
  """A problem as a string key of the cache (every field; dtypes by name)."""
  values = []
  for field in dataclasses.fields(Problem):
    value = getattr(problem, field.name)
    values.append(np.dtype(value).name if isinstance(value, np.dtype) else str(value))
  return "|".join(values)


_CACHE_LOCK = threading.Lock()


@functools.lru_cache(maxsize=8)
def _load_cache(path: str, mtime_ns: int) -> dict[str, Tiling]:
  del mtime_ns  # part of the memo key: a rewritten file is read again
  data = _read_json(pathlib.Path(path))
  if not isinstance(data, dict) or data.get("format") != CACHE_FORMAT:
    raise ValueError(f"{path}: not a gmm_jax autotune cache of format {CACHE_FORMAT}")
  return {key: _tiling_from(entry["tiling"], f"{path} entry {key!r}")
          for key, entry in data.get("entries", {}).items()}


def cache_lookup(problem: Problem, path: pathlib.Path | None = None) -> Tiling | None:
  """The cached tiling of exactly this problem, or None (no cache file, no entry)."""
  path = cache_path() if path is None else path
  try:
    mtime = path.stat().st_mtime_ns
  except OSError:
    return None
  return _load_cache(str(path), mtime).get(problem_key(problem))


def cache_store(problem: Problem, tiling: Tiling, info: dict,
                path: pathlib.Path | None = None) -> pathlib.Path:
  """Writes (or replaces) the entry of `problem` in the cache; returns the path."""
  path = cache_path() if path is None else path
  with _CACHE_LOCK:
    data = {"format": CACHE_FORMAT, "entries": {}}
    if path.exists():
      data = _read_json(path)
      if data.get("format") != CACHE_FORMAT:
        raise ValueError(f"{path}: not a gmm_jax autotune cache of format {CACHE_FORMAT}")
    entry = {"problem": {f.name: (np.dtype(v).name if isinstance(v, np.dtype) else v)
                         for f in dataclasses.fields(Problem)
                         for v in [getattr(problem, f.name)]},
             "tiling": dataclasses.asdict(tiling), **info}
    data["entries"][problem_key(problem)] = entry
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
    tmp.replace(path)
  return path


# ------------------------------------------------------------------------------ choice


@dataclasses.dataclass(frozen=True)
class Choice:
  """The tiling a backend used for one gmm, and where it came from ("user", "callable",
  "autotune cache", "table <key>", "heuristic")."""

  problem: Problem
  tiling: Tiling
  source: str


_RECORDERS: list[list[Choice]] = []


def record():
  """Collects the `Choice`s of the gmms traced inside the block."""
  return recording.collecting(_RECORDERS)


def choose(problem: Problem, tiling, default: Callable[[], Tiling]) -> Tiling:
  """The tiling of `choose_with_source`."""
  return choose_with_source(problem, tiling, default)[0]


def choose_with_source(problem: Problem, tiling,
                       default: Callable[[], Tiling]) -> tuple[Tiling, str]:
  """The tiling for `problem`: `tiling` (``GmmConfig.tiling``: a Tiling, a callable or
  `Tilings`), else the autotune cache, else the built-in table, else ``default()``.

  Raises:
    ValueError: a callable returned something other than a Tiling or None.
  """
  tiling = forward_tiling(tiling)
  chosen, source = None, None
  if isinstance(tiling, Tiling):
    chosen, source = tiling, "user"
  elif tiling is not None:
    chosen = tiling(problem)
    if chosen is not None and not isinstance(chosen, Tiling):
      raise ValueError(f"a tiling callable must return a gmm_jax.Tiling or None, got "
                       f"{chosen!r} for {problem}")
    source = "callable"
  if chosen is None:
    chosen, source = cache_lookup(problem), "autotune cache"
  if chosen is None:
    chosen, key = table_lookup(problem)
    source = f"table {'/'.join(key)}" if key else None
  if chosen is None:
    chosen, source = default(), "heuristic"
  for recorder in _RECORDERS:
    recorder.append(Choice(problem, chosen, source))
  return chosen, source


# ------------------------------------------------------------------------------ launches


@dataclasses.dataclass(frozen=True)
class Launch:
  """One kernel launch as a backend built it (what `gmm_jax.tools.aot` reports).

  Fields:
    name: the kernel's name (the pallas_call's).
    implementation: the registered implementation.
    problem: the `Problem` it serves (None when the backend did not say).
    grid: the launch grid.
    tiles: (tile_m, tile_k, tile_n) as the kernel blocks them.
    vmem_limit: TPU: the explicit scoped VMEM limit in bytes, else None.
    warps: GPU: the warps of one program (Triton's ``num_warps``; Mosaic GPU's warpgroups
      times 4), else None.
  """

  name: str
  implementation: str | None
  problem: Problem | None
  grid: tuple[int, ...]
  tiles: tuple[int, ...]
  vmem_limit: int | None = None
  warps: int | None = None


_LAUNCH_RECORDERS: list[list[Launch]] = []


def record_launches():
  """Collects the `Launch`es of the kernels traced inside the block."""
  return recording.collecting(_LAUNCH_RECORDERS)


def note_launch(launch: Launch) -> None:
  """Called by a kernel for each pallas_call it builds."""
  for recorder in _LAUNCH_RECORDERS:
    recorder.append(launch)
