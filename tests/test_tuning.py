"""How a gmm's tiling is chosen: the user's (a Tiling, a callable, per-gmm Tilings), the
autotuner's cache, the built-in per-target tile tables (data, checked for duplicate keys),
or the kernel's heuristic; and `gmm_jax.autotune` writing the cache gmm then reads."""

from __future__ import annotations

import json
import os

import gmm_jax
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gmm_jax._src.tiling import tuning
from gmm_jax._src.core.config import GmmConfig, Problem, Tiling, Tilings
from gmm_jax.pallas.gpu import triton as triton_gmm
from gmm_jax.pallas.gpu import mosaic_gpu
from gmm_jax.pallas.tpu import mosaic_tpu_plan
from oracle import f64, gmm_oracle, tolerances

M, K, N, G = 64, 48, 40, 4
SIZES = np.array([20, 0, 31, 13], np.int32)
TRITON = dict(implementation="pallas_triton", interpret=True)


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
  # Every test gets its own (empty) autotune cache.
  monkeypatch.setenv(tuning.CACHE_ENV, str(tmp_path / "autotune.json"))


def _operands(seed=0):
  rng = np.random.default_rng(seed)
  x = rng.standard_normal((M, K)).astype(np.float32)
  w = rng.standard_normal((G, K, N)).astype(np.float32)
  return x, w


def _choices(fn, *args):
  with tuning.record() as choices:  # a new function each time: jax's trace cache misses
    jax.jit(lambda *a: fn(*a)).lower(*args)
  return choices


# ------------------------------------------------------------------------------ tables


def test_builtin_table_rows_are_unique_and_usable_by_their_kernels():
  table = tuning.builtin_table()
  checks = {"pallas_triton": triton_gmm.check_tiling, "pallas_tpu": mosaic_tpu_plan.check_tiling}
  for (implementation, kind, group_type, dtype, cls), tiling in table.items():
    assert cls in (*tuning.SHAPE_CLASSES, "*"), cls
    check = checks.get(implementation)
    if check is not None:  # the kernel accepts the tiles on a shape that needs them all
      cfg = GmmConfig(group_type=group_type, num_local=8)
      check(tiling, 1 << 16, 1 << 16, 1 << 16, cfg)


def test_builtin_table_rows_fit_their_chips_shared_memory():
  # Each GPU row's pipeline fits the chip: Triton's two stages (lhs tile and the weight tile,
  # or both halves of a gated one) and Mosaic GPU's stages beside its output staging tile.
  # The full deviceless compile of every target (`python -m gmm_jax.tools.aot --targets all`) is
  # the proof; this holds the rows to the same limits in every run.
  table = tuning.builtin_table()
  assert table
  for (implementation, kind, group_type, dtype, _), tiling in table.items():
    itemsize = np.dtype(dtype).itemsize
    if implementation == "pallas_triton":
      for halves in (1, 2):
        per_stage = (tiling.tile_m * tiling.tile_k + halves * tiling.tile_k * tiling.tile_n)
        assert 2 * per_stage * itemsize + 8192 <= triton_gmm.SMEM_BYTES, (kind, tiling, halves)
    elif implementation == "pallas_mosaic_gpu":
      assert mosaic_gpu._stages(tiling, 1 << 16, itemsize, 4) >= 2, (kind, tiling)
    else:
      raise AssertionError(f"a tile-table row of {implementation} has no limit checked here")


def test_table_with_duplicate_rows_is_rejected():
  row = {"implementation": "pallas_tpu", "device_kind": "TPU v5 lite", "group_type": "m",
         "dtype": "bfloat16", "shape_class": "large",
         "tiling": {"tile_m": 512, "tile_k": 1024, "tile_n": 1024}}
  with pytest.raises(ValueError, match="duplicate key.*TPU v5 lite"):
    tuning.parse_table({"rows": [row, dict(row, tiling={"tile_m": 256})]})
  with pytest.raises(ValueError, match="shape_class"):
    tuning.parse_table({"rows": [dict(row, shape_class="huge")]})
  with pytest.raises(ValueError, match="missing"):
    tuning.parse_table({"rows": [{"implementation": "pallas_tpu"}]})
  with pytest.raises(ValueError, match="bad tiling"):
    tuning.parse_table({"rows": [dict(row, tiling={"tile_m": 0})]})


def test_json_with_duplicate_keys_is_rejected(tmp_path):
  path = tmp_path / "t.json"
  path.write_text('{"rows": [], "rows": []}')
  with pytest.raises(ValueError, match="duplicate JSON key 'rows'"):
    tuning._read_json(path)


def test_table_lookup_prefers_the_most_specific_row():
  base = {"implementation": "pallas_triton", "group_type": "m"}
  rows = [dict(base, device_kind="*", dtype="*", shape_class="*",
               tiling={"tile_m": 16, "tile_k": 16, "tile_n": 16}),
          dict(base, device_kind="NVIDIA H200", dtype="*", shape_class="*",
               tiling={"tile_m": 32, "tile_k": 32, "tile_n": 32}),
          dict(base, device_kind="NVIDIA H200", dtype="bfloat16", shape_class="large",
               tiling={"tile_m": 128, "tile_k": 64, "tile_n": 256})]
  table = tuning.parse_table({"rows": rows})

  def problem(kind, dtype, m):
    return Problem("pallas_triton", "gpu", kind, "m", m, 4096, 14336, 8, 8, np.dtype(dtype),
                   np.dtype(dtype), np.dtype(dtype))

  assert tuning.table_lookup(problem("NVIDIA H200", jnp.bfloat16, 16384), table)[0].tile_n == 256
  assert tuning.table_lookup(problem("NVIDIA H200", jnp.float16, 16384), table)[0].tile_n == 32
  assert tuning.table_lookup(problem("NVIDIA H200", jnp.bfloat16, 64), table)[0].tile_n == 32
  assert tuning.table_lookup(problem("NVIDIA H100", jnp.bfloat16, 16384), table)[0].tile_n == 16
  assert tuning.shape_class("m", 64, 4096, 8) == "decode"
  assert tuning.shape_class("m", 8192, 2048, 64) == "small"
  assert tuning.shape_class("k", 8192, 2048, 2) == "large"


def test_device_kind_follows_the_default_device():
  cpu = jax.devices("cpu")[0]
  with jax.default_device(cpu):
    assert tuning.device_kind("cpu") == cpu.device_kind
  assert tuning.device_kind("tpu") is None  # no TPU in this process
  assert tuning.device_kind(None) is None


# -------------------------------------------------------------------------- the choice


def test_explicit_callable_cache_and_heuristic_in_that_order():
  x, w = _operands()
  sizes = jnp.asarray(SIZES)
  fn = lambda x, w, s, t=None: gmm_jax.gmm(x, w, s, tiling=t, **TRITON)
  [heuristic] = _choices(fn, x, w, sizes)
  assert heuristic.source in ("heuristic",) or heuristic.source.startswith("table")
  problem = heuristic.problem
  assert (problem.implementation, problem.platform, problem.group_type) == (
      "pallas_triton", "gpu", "m")
  assert (problem.m, problem.k, problem.n, problem.num_groups, problem.num_local) == (
      M, K, N, G, G)
  assert problem.lhs_dtype == np.float32 and problem.quant_mode == "none"

  tuned = Tiling(tile_m=16, tile_k=32, tile_n=16)
  tuning.cache_store(problem, tuned, {"seconds": 1.0})
  [cached] = _choices(fn, x, w, sizes)
  assert (cached.source, cached.tiling) == ("autotune cache", tuned)

  seen = []
  pick = lambda p: seen.append(p) or Tiling(tile_m=32, tile_k=16, tile_n=32)
  [called] = _choices(lambda x, w, s: fn(x, w, s, pick), x, w, sizes)
  assert called.source == "callable" and called.tiling.tile_m == 32 and seen == [problem]

  fixed = Tiling(tile_m=16, tile_k=16, tile_n=16)
  [user] = _choices(lambda x, w, s: fn(x, w, s, fixed), x, w, sizes)
  assert (user.source, user.tiling) == ("user", fixed)

  # A callable returning None leaves the choice to the cache.
  [fallback] = _choices(lambda x, w, s: fn(x, w, s, lambda p: None), x, w, sizes)
  assert fallback.source == "autotune cache"


def test_results_do_not_depend_on_where_the_tiling_came_from():
  x, w = _operands(1)
  want = gmm_oracle(f64(x), f64(w), SIZES, "m")
  outs = []
  for tiling in (None, Tiling(tile_m=16, tile_k=16, tile_n=16),
                 lambda p: Tiling(tile_m=32, tile_k=32, tile_n=16)):
    outs.append(np.asarray(gmm_jax.gmm(x, w, jnp.asarray(SIZES), tiling=tiling, **TRITON)))
  for out in outs:
    np.testing.assert_allclose(out, want, **tolerances(np.float32, k=K))


def test_a_callable_must_return_a_tiling():
  x, w = _operands()
  with pytest.raises(ValueError, match="must return a gmm_jax.Tiling or None"):
    gmm_jax.gmm(x, w, jnp.asarray(SIZES), tiling=lambda p: (16, 16, 16), **TRITON)
  with pytest.raises(ValueError, match="tiling must be None, a gmm_jax.Tiling"):
    gmm_jax.gmm(x, w, jnp.asarray(SIZES), tiling=(16, 16, 16), **TRITON)
  with pytest.raises(ValueError, match="Tilings.dlhs must be"):
    Tilings(dlhs=(16, 16, 16))


def _role(problem):
  """fwd, dlhs or drhs of an m-grouped [M, K] x [G, K, N] forward."""
  if problem.group_type == "k":
    return "drhs"
  return "dlhs" if problem.transpose_rhs else "fwd"


def test_tilings_give_each_gmm_of_a_training_step_its_own():
  x, w = _operands(2)
  sizes = jnp.asarray(SIZES)
  fwd, dlhs, drhs = (Tiling(tile_m=16, tile_k=16, tile_n=32),
                     Tiling(tile_m=32, tile_k=16, tile_n=16),
                     Tiling(tile_m=16, tile_k=32, tile_n=16))

  def loss(x, w, tiling):  # squared: the forward's value is needed
    return jnp.sum(gmm_jax.gmm(x, w, sizes, tiling=tiling, **TRITON) ** 2)

  grad = jax.grad(loss, argnums=(0, 1))
  choices = _choices(lambda x, w: grad(x, w, Tilings(fwd, dlhs, drhs)), x, w)
  assert {_role(c.problem): (c.source, c.tiling) for c in choices} == {
      "fwd": ("user", fwd), "dlhs": ("user", dlhs), "drhs": ("user", drhs)}
  assert len(choices) == 3
  # A plain Tiling is the forward's only; a callable serves all three.
  choices = _choices(lambda x, w: grad(x, w, fwd), x, w)
  assert sorted((_role(c.problem), c.source == "user") for c in choices) == [
      ("dlhs", False), ("drhs", False), ("fwd", True)]
  roles = []
  pick = lambda p: roles.append(_role(p)) or None
  _choices(lambda x, w: grad(x, w, pick), x, w)
  assert sorted(roles) == ["dlhs", "drhs", "fwd"]
  # And the gradients are right.
  gx, gw = jax.jit(lambda x, w: grad(x, w, Tilings(fwd, dlhs, drhs)))(x, w)
  rx, rw = jax.grad(lambda x, w: jnp.sum(gmm_jax.gmm(x, w, sizes) ** 2), argnums=(0, 1))(x, w)
  np.testing.assert_allclose(gx, rx, **tolerances(np.float32, k=K))
  np.testing.assert_allclose(gw, rw, **tolerances(np.float32, k=K))


def test_cache_file_round_trip_and_format_check(tmp_path):
  problem = Problem("xla", "cpu", "cpu", "m", 8, 8, 8, 2, 2, np.dtype(np.float32),
                    np.dtype(np.float32), np.dtype(np.float32))
  path = tmp_path / "c.json"
  tuning.cache_store(problem, Tiling(tile_m=64), {"seconds": 0.5}, path)
  tuning.cache_store(problem, Tiling(tile_m=128), {"seconds": 0.25}, path)  # replaces
  data = json.loads(path.read_text())
  assert data["format"] == tuning.CACHE_FORMAT and len(data["entries"]) == 1
  assert tuning.cache_lookup(problem, path) == Tiling(tile_m=128)
  other = Problem("xla", "cpu", "cpu", "m", 16, 8, 8, 2, 2, np.dtype(np.float32),
                  np.dtype(np.float32), np.dtype(np.float32))
  assert tuning.cache_lookup(other, path) is None
  path.write_text('{"format": 99, "entries": {}}')
  with pytest.raises(ValueError, match="not a gmm_jax autotune cache"):
    tuning.cache_lookup(problem, path)


# ------------------------------------------------------------------------------ autotune


def test_autotune_writes_the_fastest_tiling_that_gmm_then_uses(tmp_path):
  cache = tmp_path / "tuned.json"
  candidates = [Tiling(tile_m=16, tile_k=16, tile_n=16), Tiling(tile_m=32, tile_k=32, tile_n=32),
                Tiling(tile_m=24, tile_k=16, tile_n=16)]  # Triton refuses 24
  sizes = [SIZES, np.array([0, 64, 0, 0], np.int32)]
  results = gmm_jax.autotune(M, K, N, G, dtype=jnp.float32, group_sizes=sizes,
                             candidates=candidates, repeats=1, cache=cache, backward=True,
                             **TRITON)
  assert [r.role for r in results] == ["fwd", "dlhs", "drhs"]
  fwd = results[0]
  assert [t for t, _ in fwd.timings] == candidates
  assert fwd.timings[2][1] is None  # refused, not timed on another implementation
  assert fwd.best in candidates[:2] and fwd.seconds == min(s for _, s in fwd.timings if s)
  entries = json.loads(cache.read_text())["entries"]
  assert len(entries) == 3
  assert all(e["group_sizes"] == [s.tolist() for s in sizes] for e in entries.values())
  # gmm reads the cache for exactly these problems.
  x, w = _operands()
  fn = lambda x, w, s: jax.grad(lambda x, w: jnp.sum(gmm_jax.gmm(x, w, s, **TRITON)),
                                argnums=(0, 1))(x, w)
  os.environ[tuning.CACHE_ENV] = str(cache)  # restored by the fixture's monkeypatch
  choices = _choices(fn, x, w, jnp.asarray(SIZES))
  assert [c.source for c in choices] == ["autotune cache"] * 2  # the forward is unused
  best = {r.role: r.best for r in results}
  assert {_role(c.problem): c.tiling for c in choices} == {"dlhs": best["dlhs"],
                                                           "drhs": best["drhs"]}
  [forward] = _choices(lambda x, w, s: gmm_jax.gmm(x, w, s, **TRITON), x, w, jnp.asarray(SIZES))
  assert (forward.source, forward.tiling) == ("autotune cache", best["fwd"])


def test_autotune_on_a_given_device_times_there(tmp_path):
  """`device=` a local device: the operands are placed there and the results are times."""
  device = jax.devices()[1]
  results = gmm_jax.autotune(M, K, N, G, dtype=jnp.float32, repeats=1, write=False,
                             candidates=[Tiling(tile_m=16, tile_k=16, tile_n=16)],
                             device=device, **TRITON)
  assert results[0].seconds > 0 and results[0].timings[0][1] > 0


def test_autotune_rejects_bad_arguments():
  with pytest.raises(ValueError, match="positive int dims"):
    gmm_jax.autotune(0, K, N, G)
  with pytest.raises(ValueError, match="group_sizes"):
    gmm_jax.autotune(M, K, N, G, group_sizes=[[M, 1, 0, 0]], write=False)
