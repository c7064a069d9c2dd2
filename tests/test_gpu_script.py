"""`benchmarks/gpu.sh`, the prepared run for a machine with one GPU, rehearsed without it.

``bash benchmarks/gpu.sh --dry-run`` runs every step on the GPU machine's software stack
(`.ci/jax_env.sh device`: jax 0.11.2 with the CUDA 13 plugin and that image's packages),
deviceless, and exits non-zero when a step would fail there for a reason other than the
missing GPU. CI runs the quick dry run (`GMM_JAX_GPU_DRY_RUN=1`, in the environment it
builds); the whole one runs with ``-m slow``. The script's own argument handling and the
GPU target it reads from a device kind are checked in the default run.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess

import pytest

from gmm_jax.tools import deviceless

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu.sh"
BASH = shutil.which("bash")
needs_bash = pytest.mark.skipif(BASH is None, reason="no bash on PATH")
needs_stack = pytest.mark.skipif(
    os.environ.get("GMM_JAX_GPU_DRY_RUN") != "1",
    reason="the dry run needs the GPU machine's stack (.ci/jax_env.sh device, ~1.5 GB; "
           "CI builds it and sets GMM_JAX_GPU_DRY_RUN=1)")


@pytest.mark.parametrize("kind, target", [
    ("NVIDIA H100 80GB HBM3", "h100"), ("NVIDIA H200", "h200"), ("NVIDIA B200", "b200")])
def test_the_gpu_target_comes_from_the_device_kind(kind, target):
  assert deviceless.local_target(kind) == target
  assert target in deviceless.TARGETS


def test_an_unknown_gpu_is_refused_by_name():
  with pytest.raises(ValueError, match="NVIDIA A100"):
    deviceless.local_target("NVIDIA A100-SXM4-80GB")


@needs_bash
def test_an_unknown_flag_is_refused():
  result = subprocess.run([BASH, str(SCRIPT), "--bogus"], capture_output=True, text=True,
                          timeout=30, check=False)
  assert result.returncode == 2 and "usage" in result.stderr


def _dry_run(tmp_path, *flags):
  out = tmp_path / "out"
  result = subprocess.run([BASH, str(SCRIPT), "--dry-run", "--target", "h100", *flags],
                          env=dict(os.environ, OUT=str(out)), capture_output=True,
                          text=True, timeout=3000, check=False)
  env = (out / "env.txt").read_text()
  return result.returncode, env, out


def _check_steps(status: int, env: str, out: pathlib.Path) -> None:
  assert status == 0, env
  for step in ("tests", "model", "bench", "autotune", "moe", "tokamax"):
    assert f"{step}: exit 0" in env, env
  assert "FAILED" not in env, env
  assert "compiled" in (out / "tests.txt").read_text() or "collected" in (
      out / "tests.txt").read_text()
  assert "pallas_" in (out / "bench.txt").read_text()  # gmm's kernels served the rows
  assert "imports and runs from .whl" in (out / "tokamax.txt").read_text()


@needs_bash
@needs_stack
def test_quick_dry_run_passes_on_the_gpu_machines_stack(tmp_path):
  _check_steps(*_dry_run(tmp_path, "--quick"))


@pytest.mark.slow
@needs_bash
@needs_stack
def test_dry_run_passes_on_the_gpu_machines_stack(tmp_path):
  _check_steps(*_dry_run(tmp_path))
