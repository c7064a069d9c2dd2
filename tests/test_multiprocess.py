"""Two processes x 4 CPU devices (`jax.distributed` on localhost, gloo collectives) run one
sharded MoE training step under plain jit (tests/multiprocess_step.py): equal to one
process, expert weights still sharded after the update, and no all-gather of weights or
tokens in the compiled program."""

from __future__ import annotations

import json
import os
import pathlib
import socket
import subprocess
import sys

import pytest

pytest.importorskip("flax")

WORKER = pathlib.Path(__file__).resolve().parent / "multiprocess_step.py"


def _free_port() -> int:
  """A port free on every address the coordinator binds ('[::]', dual stack where the host
  has IPv6), not only on IPv4's localhost."""
  family, host = (socket.AF_INET6, "::") if socket.has_ipv6 else (socket.AF_INET, "")
  try:
    with socket.socket(family) as s:
      s.bind((host, 0))
      return s.getsockname()[1]
  except OSError:
    with socket.socket() as s:
      s.bind(("", 0))
      return s.getsockname()[1]


# What a worker prints when its coordinator's port was taken between `_free_port` and the
# bind (another process on the machine): the step is rerun on a new port.
PORT_TAKEN = "Failed to start RPC server"


def _run_step(tmp_path, attempt: int):
  """(return codes, logs, result files) of the two workers on a fresh port."""
  port = _free_port()
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  env.pop("XLA_FLAGS", None)
  outs = [tmp_path / f"process{i}-{attempt}.json" for i in range(2)]
  procs = [subprocess.Popen([sys.executable, str(WORKER), str(i), str(port), str(outs[i])],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True) for i in range(2)]
  logs = []
  for proc in procs:
    try:
      logs.append(proc.communicate(timeout=240)[0])
    except subprocess.TimeoutExpired:
      for p in procs:
        p.kill()
      pytest.fail("the two-process step did not finish in 240 s")
  return [proc.returncode for proc in procs], logs, outs


def test_two_process_moe_training_step(tmp_path):
  for attempt in range(3):
    codes, logs, outs = _run_step(tmp_path, attempt)
    if not any(code and PORT_TAKEN in log for code, log in zip(codes, logs)):
      break
  for code, log in zip(codes, logs):
    assert code == 0, log[-4000:]
  results = [json.loads(out.read_text()) for out in outs]
  for result in results:
    assert result["max_error"] < 1e-4, result
    assert abs(result["loss"] - result["want_loss"]) < 1e-4 * abs(result["want_loss"]), result
    # The updated expert kernels (gate_up and down) stay sharded over the expert axis.
    assert result["kernel_specs"] == [["e"]] * 2, result
    # Nothing weight- or token-sized is gathered (embed 16, mlp 32).
    for shape in result["all_gathers"]:
      assert "16,32" not in shape and "32,16" not in shape and ",16]" not in shape, result
  assert results[0]["loss"] == results[1]["loss"]
