"""The training example `python -m gmm_jax.examples.train_moe`: a tiny configuration trains
(the held-out loss falls), reports what it promises, writes its plot, and runs as a module."""

from __future__ import annotations

import hashlib
import importlib.util
import os
import pathlib
import subprocess
import sys
from importlib import resources

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("flax")
pytest.importorskip("optax")
pytest.importorskip("matplotlib")

from flax import nnx  # noqa: E402
from gmm_jax.examples import train_moe  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]
TINY = ["--layers", "1", "--experts", "4", "--top-k", "2", "--batch", "8", "--seq", "32",
        "--embed", "32", "--heads", "2", "--mlp", "64", "--lr", "1e-2", "--sample", "8"]


def test_the_bundled_text_is_the_projects_docs():
  text = train_moe.load_text()
  assert len(text) == 117_417
  assert text.startswith(b"# gmm_jax\n\nGrouped matrix multiplication (GroupedGEMM) for JAX")
  assert train_moe.PROMPT in text
  readme = (resources.files("gmm_jax.examples") / "data" / "README.md").read_text()
  assert f"{hashlib.sha256(text).hexdigest()}  gmm_jax_docs.txt" in readme
  assert b"```" not in text  # prose: the code blocks are left out
  assert b"GNU GENERAL PUBLIC LICENSE" not in text and b"verbatim copies" not in text


def test_the_corpus_builder_keeps_prose_and_drops_code():
  spec = importlib.util.spec_from_file_location("make_corpus", ROOT / "tools" / "make_corpus.py")
  make_corpus = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(make_corpus)
  page = ("# Title\n\nProse.\n\n```python\nx = 1\n```\n\n```{important}\nKept.\n```\n\n"
          "| a | b |\n|---|---|\n| 1 | 2 |\n\n\n\nEnd.\n")
  assert make_corpus.page_text(page) == "# Title\n\nProse.\n\nKept.\n\n| a | b |\n| 1 | 2 |\n\nEnd.\n"
  assert all((ROOT / p).is_file() for p in make_corpus.PAGES)


def test_tiny_run_learns_and_reports(tmp_path, capsys):
  plot = tmp_path / "loss.png"
  steps = 24
  results = train_moe.main(TINY + ["--steps", str(steps), "--plot", str(plot), "--seed", "1",
                                   "--log-every", "8"])
  for key in ("initial_loss", "final_loss", "tokens_per_s", "expert_load", "train_losses",
              "eval_losses", "load_balancing_losses", "sample", "plot", "model"):
    assert key in results, key
  assert results["final_loss"] < results["initial_loss"] - 1.0, (
      results["initial_loss"], results["final_loss"])
  assert abs(results["initial_loss"] - np.log(256)) < 0.5  # starts near uniform over bytes
  assert len(results["train_losses"]) == steps
  assert results["tokens_per_s"] > 0
  load = results["expert_load"]
  assert load.shape == (steps, 1, 4)
  np.testing.assert_allclose(load.sum(-1), 1.0, rtol=1e-5)
  assert (load >= 0).all()
  assert results["sample"].startswith(train_moe.PROMPT.decode())
  assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and results["plot"] == str(plot)
  out = capsys.readouterr().out
  assert "tok/s" in out and "\r[" in out and "held-out loss" in out


@pytest.mark.slow
def test_fp8_training_follows_the_bf16_run():
  """--quantization fp8: the experts' gmms train in fp8 (a model width of 128 and an
  expert width of 256: one and two 128-blocks along the contractions) and the losses stay
  within 0.1 of the bf16 run's, step by step (benchmarks/log.md has the 300-step runs)."""
  args = ["--layers", "1", "--experts", "4", "--batch", "4", "--seq", "32", "--embed", "128",
          "--heads", "2", "--mlp", "256", "--lr", "1e-2", "--sample", "0", "--no-plot",
          "--steps", "12", "--dtype", "bfloat16"]
  base = train_moe.main(args, stream=open(os.devnull, "w"))
  fp8 = train_moe.main(args + ["--quantization", "fp8"], stream=open(os.devnull, "w"))
  assert fp8["final_loss"] < fp8["initial_loss"] - 0.5
  np.testing.assert_allclose(fp8["train_losses"], base["train_losses"], atol=0.1)
  assert not np.array_equal(fp8["train_losses"], base["train_losses"])  # fp8 did run


def test_expert_load_is_the_routing_of_router_probs():
  """The recorded expert load (the MoE's "expert_load" if it reports one, else recomputed
  from the router) is the top-k of `MoELM.router_probs`, layer by layer."""
  model = train_moe.MoELM(seq=16, embed=16, heads=2, mlp=32, layers=2, experts=4, top_k=2,
                          rngs=nnx.Rngs(0))
  ids = jax.random.randint(jax.random.key(0), (3, 16), 0, 256)

  @nnx.jit
  def both(model, ids):
    return model(ids)[1]["expert_load"], model.router_probs(ids)

  load, probs = both(model, ids)
  assert load.shape == (2, 4) and probs.shape == (2, 3, 16, 4)
  _, top = jax.lax.top_k(probs, 2)
  want = jnp.mean(jax.nn.one_hot(top, 4).sum(-2), axis=(1, 2)) / 2
  np.testing.assert_allclose(np.asarray(load), np.asarray(want), atol=1e-6)
  np.testing.assert_allclose(np.asarray(load).sum(-1), 1.0, rtol=1e-6)


def test_bad_flags_are_rejected():
  with pytest.raises(SystemExit):
    train_moe.parse_args(["--experts", "2", "--top-k", "3"])
  with pytest.raises(SystemExit):
    train_moe.parse_args(["--steps", "0"])


@pytest.mark.slow  # ~30-55 s: a fresh process compiles the whole run again
def test_runs_as_a_module(tmp_path):
  env = dict(os.environ)
  env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in [env.get("PYTHONPATH")] if p])
  result = subprocess.run(
      [sys.executable, "-m", "gmm_jax.examples.train_moe"] + TINY +
      ["--steps", "3", "--no-plot", "--dtype", "bfloat16", "--sample", "0"],
      cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
  assert result.returncode == 0, result.stderr[-3000:]
  assert "held-out loss" in result.stdout and "tokens/s" in result.stdout
  assert not list(tmp_path.iterdir())  # --no-plot: nothing written
