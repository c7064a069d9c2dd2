"""The benchmark script runs (tiny shapes; CPU table, and the GPU table in interpret mode) and
prints one well-formed row per case. Timing itself is never asserted."""

from __future__ import annotations

import numpy as np
import pytest
from gmm_jax.tools import bench, bench_host

pytestmark = pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")


def _rows(text: str) -> list[list[str]]:
  lines = [line for line in text.splitlines() if line.startswith("| ") and "---" not in line]
  return [[cell.strip() for cell in line.strip("|").split("|")] for line in lines[1:]]


@pytest.mark.parametrize("distribution", ["balanced", "skewed"])
def test_group_sizes_sum_to_m(distribution):
  sizes = bench_host.group_sizes(1000, 16, distribution)
  assert sizes.sum() == 1000 and sizes.min() >= 0
  if distribution == "skewed":
    assert (sizes == 0).sum() == 4 and sizes.max() > 3 * 1000 // 16


def test_cpu_table(capsys):
  bench.main(["--platform", "cpu", "--dtypes", "float32", "--m", "64", "--kn", "32",
              "--groups", "1", "4", "--repeats", "1"])
  rows = _rows(capsys.readouterr().out)
  assert len(rows) == 6  # G=1 balanced, G=4 balanced and skewed; fwd and fwd+bwd each
  for row in rows:
    # gmm ms, floor ms (max of dense and the weights' traffic); gmm/floor, gmm/dense
    assert float(row[6]) > 0 and float(row[7]) > 0, row
    assert float(row[8]) >= 0 and float(row[9]) >= 0, row


def test_the_weights_floor_reads_them_once_per_gmm_that_needs_them():
  """fwd: one read of every weight; fwd+bwd: two reads and one write (the gradient)."""
  rhs = np.arange(4 * 8 * 16, dtype=np.float32).reshape(4, 8, 16)
  fwd = bench_host._weight_passes(rhs, "fwd")
  both = bench_host._weight_passes(rhs, "fwd+bwd")
  assert [name for name, _, _ in fwd] == ["read"]
  assert [name for name, _, _ in both] == ["read", "read", "read+write"]
  for name, programs, _ in both:
    for program in programs:
      out = np.asarray(program(rhs))
      if name == "read":  # every weight read once, next to nothing written
        assert out.size <= rhs.size // 16 and out.sum() in (rhs.sum(), rhs.max())
      else:  # a gradient's worth written
        np.testing.assert_array_equal(out, 2 * rhs)
  assert bench_host.weights_seconds(rhs, "fwd+bwd", 1) > 0


def test_gpu_table_in_interpret_mode(capsys):
  bench.main(["--platform", "gpu", "--interpret", "--m", "64", "--kn", "32", "--groups", "3",
              "--repeats", "1", "--implementation", "pallas_triton"])
  rows = _rows(capsys.readouterr().out)
  assert [row[5:7] for row in rows] == [["balanced", "fwd"], ["balanced", "fwd+bwd"],
                                        ["skewed", "fwd"], ["skewed", "fwd+bwd"]]
  for row in rows:
    assert row[1:5] == ["64", "32", "32", "3"] and row[7] == "pallas_triton"
    assert float(row[8]) > 0
    assert float(row[-1]) < 1e-2  # the Triton kernel agrees with jax.lax.ragged_dot
  assert np.isfinite(float(rows[0][11]))  # gmm % of dense


@pytest.mark.slow  # ~40 s: every quantization mode, forward and backward, compiled
def test_quant_table(capsys):
  bench.main(["--platform", "cpu", "--quant", "--m", "64", "--kn", "128", "--groups", "2",
              "--sizes", "skewed", "--modes", "fwd", "fwd+bwd", "--repeats", "1"])
  rows = _rows(capsys.readouterr().out)
  assert [row[4] for row in rows] == ["fwd", "fwd+bwd"]
  for row in rows:
    assert len(row) == 5 + 2 * len(bench_host.QUANT_COLUMNS) - 1
    assert all(float(cell) > 0 for cell in row[5:])


def test_communicated_bytes_parses_tuple_collectives():
  hlo = ("  %all-to-all.1 = (f32[1,64,32]{2,1,0}, /*index=1*/f32[1,64,32]{2,1,0}) "
         "all-to-all(%a, %b), channel_id=1\n"
         "  %ar = bf16[128,16]{1,0} all-reduce-start(%c), to_apply=%sum\n"
         "  %g = f32[1,64,16]{2,1,0} get-tuple-element(%all-to-all.1), index=0\n")
  assert bench_host.communicated_bytes(hlo) == {"all-to-all": 2 * 64 * 32 * 4,
                                           "all-reduce": 128 * 16 * 2}


def test_sharding_case_counts_the_all_to_alls():
  results = bench_host.run_sharding_case(2, "routed", experts_per_device=2, tokens_per_device=16,
                                    kn=32, repeats=1)
  (fwd_seconds, fwd_comm), (_, grad_comm) = results
  assert fwd_seconds > 0
  # all_to_alls of [2 devices, 16 tokens] x 32 f32 there and back, plus the int32 ids.
  assert fwd_comm["all-to-all"] == 2 * (2 * 16 * 32 * 4) + 2 * 16 * 4
  assert "all-gather" not in fwd_comm and grad_comm["all-to-all"] > fwd_comm["all-to-all"]
