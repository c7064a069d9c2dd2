"""The MoE training-step benchmark runs (tiny shapes) and prints one well-formed row per
block and target, each against its baseline; the moe blocks (`gmm_jax.routed_experts`) are
the same function as the bench's own blocks; the deviceless mode compiles for an H200 and a
TPU v5e where this jax has their compilers. Timing and memory are never asserted."""

from __future__ import annotations


import jax
import jax.numpy as jnp
import numpy as np
import pytest
import lowering
from lowering import has_module

from gmm_jax.tools import bench_moe, deviceless

SHAPE = ["--tokens", "32", "--embed", "16", "--mlp", "32", "--experts", "4", "--top-k", "2"]


def _rows(text: str) -> list[list[str]]:
  lines = [line for line in text.splitlines() if line.startswith("| ") and "---" not in line]
  return [[cell.strip() for cell in line.strip("|").split("|")] for line in lines[1:]]


@pytest.mark.slow
def test_table_compares_each_block_with_its_baseline(capsys):
  rows = bench_moe.main([*SHAPE, "--dtypes", "float32", "--repeats", "0",
                         "--blocks", "fused", "unfused", "moe_fused", "moe_unfused"])
  assert [r.block for r in rows] == ["fused", "unfused", "moe_fused", "moe_unfused"]
  table = _rows(capsys.readouterr().out)
  assert [(r[0], r[2], r[7]) for r in table] == [
      ("fused", "cpu", "unfused"), ("unfused", "cpu", "unfused"),
      ("moe_fused", "cpu", "moe_unfused"), ("moe_unfused", "cpu", "moe_unfused")]
  assert all(r[3] == "-" for r in table)  # --repeats 0: compiled, not timed
  assert table[1][6] == "1.00" and table[3][6] == "1.00"


@pytest.mark.slow
def test_moe_blocks_are_the_same_function():
  params = bench_moe.init_params(jax.random.key(0), 16, 32, 4)
  x = jax.random.normal(jax.random.key(1), (32, 16), jnp.float32)
  reference = bench_moe.unfused_block(params, x, 2)
  for name in ("fused", "moe_fused", "moe_prologue", "moe_epilogue", "moe_unfused"):
    got = bench_moe.BLOCKS[name](bench_moe.layout(name, params), x, 2)
    np.testing.assert_allclose(np.asarray(got), np.asarray(reference), rtol=2e-5, atol=2e-5)


def test_unknown_deviceless_target_is_refused():
  with pytest.raises(ValueError, match="unknown deviceless target"):
    deviceless.chip("a100")


_has = has_module  # tests/lowering.py


@pytest.mark.slow
@pytest.mark.skipif(not (lowering.has_gpu_compiler() and _has("libtpu")),
                    reason="needs the deviceless-compile environment (.ci/aot_env.sh)")
def test_deviceless_rows_for_h200_and_v5e():
  rows = bench_moe.compile_deviceless("h200", 32, 128, 256, 4, 2, [jnp.bfloat16],
                                      ("moe_fused", "moe_unfused"))
  rows += bench_moe.compile_deviceless("v5e", 32, 128, 256, 4, 2, [jnp.bfloat16],
                                       ("moe_fused", "moe_unfused"))
  assert [(r.target, r.block) for r in rows] == [
      ("h200", "moe_fused"), ("h200", "moe_unfused"), ("v5e", "moe_fused"),
      ("v5e", "moe_unfused")]
  assert all(r.seconds is None and r.temp_bytes > 0 for r in rows)
