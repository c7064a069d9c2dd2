""".ci/run stops at the first failing step (and exits non-zero), without running CI.

The script is copied into a scratch checkout and run with stand-ins on PATH for `python`,
`pip` and `pytest`, and with stand-in `.ci/*.sh` scripts: each stand-in logs its command
line and fails when that line starts with the text in `$CI_FAIL`. Under `set -e` a command that
is not the last of an `&&` list does not stop a script (a failed `pip install -e ".[test]"`
used to skip pytest and let CI exit 0), so every step is made to fail in turn.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import stat
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
BASH = shutil.which("bash")
pytestmark = pytest.mark.skipif(BASH is None, reason="no bash on PATH")

# Logs its own name and arguments; fails if that line starts with $CI_FAIL (is $CI_FAIL, with
# $CI_FAIL_EXACT set). As `python -m venv
# DIR` it makes a virtual environment whose activate script only defines `deactivate`.
STUB = """#!/usr/bin/env bash
line="$(basename "$0") $*"
echo "$line" >> "$CI_LOG"
if [ -n "${CI_FAIL:-}" ]; then
  if [ -n "${CI_FAIL_EXACT:-}" ]; then [ "${line% }" = "$CI_FAIL" ] && exit 3
  elif [[ "$line" == "$CI_FAIL"* ]]; then exit 3; fi
fi
if [ "${1:-}" = "-m" ] && [ "${2:-}" = "venv" ]; then
  mkdir -p "$3/bin"
  echo 'deactivate() { :; }' > "$3/bin/activate"
fi
case "$(basename "$0") $*" in
  "aot_env.sh "|"jax_env.sh device"|"jax_env.sh newest") echo "$CI_AOT_VENV" ;;
esac
exit 0
"""

# The steps .ci/run takes, in order: (the start of the logged command line, which identifies
# the step, and the whole logged line).
STEPS = [
    ("python --version", "python --version"),
    ("python -m venv", None),  # the venv's path is a fresh temporary folder
    ("pip install -e .", "pip install -e ."),
    ("python -m gmm_jax.demo", "python -m gmm_jax.demo"),
    ("pip install -e .[test]", "pip install -e .[test]"),
    ("pytest", "pytest"),
    ("wheel_check.sh", "wheel_check.sh"),
    ("docs.sh", "docs.sh"),
    ("aot_env.sh", "aot_env.sh"),
    ("python -m pytest", "python -m pytest -q -ra -p no:cacheprovider -o addopts= "
                  "tests/test_deviceless.py tests/test_deviceless_partition.py "
                  "tests/test_aot_pod_deviceless.py tests/test_pallas_mosaic_gpu.py "
                  "tests/test_chips.py tests/test_deviceless_mosaic_fp8.py "
                  "tests/test_deviceless_tpu_fp8.py tests/test_deviceless_decode.py "
                  "tests/test_smoke.py tests/test_jax_private.py"),
    ("python -m gmm_jax.tools.aot", "python -m gmm_jax.tools.aot --require"),
    ("jax_env.sh device", "jax_env.sh device"),
    ("python -m pytest", "python -m pytest -q -ra -p no:cacheprovider -o addopts= "
                         "tests/test_smoke.py tests/test_jax_private.py "
                         "tests/test_gpu_script.py"),
    ("jax_env.sh newest", "jax_env.sh newest"),
    ("python -m pytest", "python -m pytest -q -ra -p no:cacheprovider -o addopts= "
                         "tests/test_smoke.py tests/test_jax_private.py "
                         "tests/test_simulators.py"),
]
# Started in the background after `python --version` and waited for before the steps that
# install gmm_jax into their environments (`aot_env.sh`, `jax_env.sh device`); their lines
# may land anywhere before those.
BACKGROUND = ("aot_env.sh --deps-only", "jax_env.sh device --deps-only",
              "jax_env.sh newest --deps-only")


def _executable(path: pathlib.Path, text: str) -> None:
  path.write_text(text)
  path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)


def _run_ci(tmp_path: pathlib.Path, fail: str | None,
            exact: bool = False) -> tuple[int, list[str]]:
  """Runs a copy of .ci/run with the stand-ins; returns its exit status and the log."""
  checkout = tmp_path / "checkout"
  (checkout / ".ci").mkdir(parents=True)
  shutil.copy(ROOT / ".ci" / "run", checkout / ".ci" / "run")
  for name in ("wheel_check.sh", "docs.sh", "aot_env.sh", "jax_env.sh"):
    _executable(checkout / ".ci" / name, STUB)
  bin_dir = tmp_path / "bin"
  bin_dir.mkdir()
  for name in ("python", "pip", "pytest"):
    _executable(bin_dir / name, STUB)
  aot_venv = tmp_path / "aot"
  (aot_venv / "bin").mkdir(parents=True)
  _executable(aot_venv / "bin" / "python", STUB)
  log = tmp_path / "log"
  log.touch()
  env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
             CI_LOG=str(log), CI_AOT_VENV=str(aot_venv), TMPDIR=str(tmp_path))
  env.pop("CI_FAIL", None)
  env.pop("CI_FAIL_EXACT", None)
  if fail is not None:
    env["CI_FAIL"] = fail
  if exact:
    env["CI_FAIL_EXACT"] = "1"
  result = subprocess.run([BASH, str(checkout / ".ci" / "run")], env=env,
                          capture_output=True, text=True, timeout=60, check=False)
  return result.returncode, [line.strip() for line in log.read_text().splitlines()]


def _foreground(log: list[str], started: bool = True, waited: tuple[str, ...] = ()) -> list[str]:
  """The log without the background steps' lines. Each must come once (when the run got
  past `python --version`), before the step that waits for it; the second stack's line
  after the first's (they build one after the other). A run that stopped before a step's
  wait (not in `waited`) may have exited before that line was logged: at most once then
  (and a failing first stack logs no second line)."""
  waits = {"aot_env.sh --deps-only": "aot_env.sh",
           "jax_env.sh device --deps-only": "jax_env.sh device",
           "jax_env.sh newest --deps-only": "jax_env.sh device"}
  for line in BACKGROUND:
    counts = (int(started),) if waits[line] in waited or not started else (0, 1)
    assert log.count(line) in counts, (line, log)
    if waits[line] in log and line in log:
      assert log.index(line) < log.index(waits[line]), log
  return [line for line in log if line not in BACKGROUND]


def test_all_steps_run_in_order_and_pass(tmp_path):
  status, log = _run_ci(tmp_path, fail=None)
  assert status == 0, log
  log = _foreground(log, waited=("aot_env.sh", "jax_env.sh device"))
  assert len(log) == len(STEPS), log
  for line, (marker, whole) in zip(log, STEPS):
    assert line.startswith(marker), (marker, line)
    if whole is not None:
      assert line == whole, (line, whole)  # e.g. the deviceless pytest prints skip reasons


@pytest.mark.parametrize("index", range(len(STEPS)), ids=[marker for marker, _ in STEPS])
def test_a_failing_step_stops_ci(tmp_path, index):
  marker, whole = STEPS[index]
  status, log = _run_ci(tmp_path, fail=whole or marker, exact=whole is not None)
  assert status != 0, f"{marker!r} failed but .ci/run exited 0; it ran: {log}"
  markers = [marker for marker, _ in STEPS]
  waited = tuple(step for step in ("aot_env.sh", "jax_env.sh device")
                 if index >= markers.index(step))
  log = _foreground(log, started=index > 0, waited=waited)
  assert len(log) == index + 1 and log[-1].startswith(marker), (
      f"{marker!r} failed but .ci/run went on: {log}")


@pytest.mark.parametrize("background, last", [
    ("aot_env.sh --deps-only", "docs.sh"),
    ("jax_env.sh device --deps-only", "python -m gmm_jax.tools.aot --require"),
    ("jax_env.sh newest --deps-only", "python -m gmm_jax.tools.aot --require")])
def test_a_failing_background_environment_stops_ci_before_its_steps(tmp_path, background,
                                                                     last):
  status, log = _run_ci(tmp_path, fail=background, exact=True)
  assert status != 0, f"{background} failed but .ci/run exited 0: {log}"
  ran = [line for line in log if line not in BACKGROUND]
  assert ran[-1] == last, f"the run went on past the wait for the environment: {log}"
