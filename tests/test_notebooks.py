"""The notebooks: each jupytext pair (.md, .ipynb) holds the same cells; each .ipynb holds the
outputs of its current cells (saved by `python notebooks/execute.py`), clean of this machine's
noise; each opens in Colab from its badge, installs gmm_jax there only when it is missing and
detects the accelerator; and each runs top to bottom on CPU (nbclient, a fresh kernel, on a
copy: nothing is written into the repository), as it would in Colab."""

from __future__ import annotations

import importlib.util
import pathlib
import re

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
jupytext = pytest.importorskip("jupytext")
pytest.importorskip("matplotlib")

ROOT = pathlib.Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
MAX_BYTES = 300 * 1024

_spec = importlib.util.spec_from_file_location("notebooks_execute",
                                               ROOT / "notebooks" / "execute.py")
execute = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(execute)

# Absolute paths of a machine that executed the notebooks, and terminal noise.
_NOISE = re.compile(r"\x1b\[|\r|/home/|/Users/|/root/|/tmp/|/work/|site-packages|"
                    r"dist-packages|[A-Z]:\\\\")

by_name = pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)


def _cells(notebook):
  return [(cell.cell_type, cell.source.strip()) for cell in notebook.cells]


def _read(path):
  return nbformat.read(path, as_version=4)


def _code_cells(notebook):
  return [cell for cell in notebook.cells if cell.cell_type == "code"]


def test_there_are_six_notebooks():
  assert [p.stem for p in NOTEBOOKS] == ["01_quickstart", "02_moe_flax", "03_quantization",
                                         "04_performance", "05_train_moe", "06_transformers"]
  assert execute.notebook_names() == [p.stem for p in NOTEBOOKS]


@by_name
def test_pair_in_sync(path):
  paired = jupytext.read(path.with_suffix(".md"))
  assert _cells(paired) == _cells(_read(path)), (
      f"{path.name} and its .md differ: the .md is the source, run "
      f"`python notebooks/execute.py {path.stem}`")


@by_name
def test_outputs_are_current(path):
  recorded = _read(path).metadata.get("gmm_jax", {})
  assert recorded.get("source_sha256") == execute.source_hash(_read(path)), (
      f"{path.name}: its saved outputs are not those of its current cells; run "
      f"`python notebooks/execute.py {path.stem}`")
  assert {"jax", "platform", "python"} <= set(recorded.get("executed_with", {}))


@by_name
def test_outputs_saved(path):
  """Every code cell has outputs (but those tagged no-output: pure definitions), none an
  error, and every cell that shows a figure has its PNG."""
  for cell in _code_cells(_read(path)):
    outputs = cell.get("outputs", [])
    if execute.NO_OUTPUT_TAG in cell.metadata.get("tags", []):
      continue
    assert outputs, f"{path.name}: no outputs for\n{cell.source[:300]}"
    assert not [out for out in outputs if out.output_type == "error"], cell.source[:300]
    if "plt.show()" in cell.source:
      assert any("image/png" in out.get("data", {}) for out in outputs), (
          f"{path.name}: no figure saved for\n{cell.source[:300]}")


@by_name
def test_outputs_clean_and_small(path):
  notebook = _read(path)
  assert "widgets" not in notebook.metadata
  for cell in _code_cells(notebook):
    assert "execution" not in cell.metadata
    for out in cell.get("outputs", []):
      texts = [out.get("text", ""), out.get("data", {}).get("text/plain", "")]
      texts += out.get("traceback", [])
      for text in texts:
        text = "".join(text) if isinstance(text, list) else text
        match = _NOISE.search(text)
        assert not match, f"{path.name}: {match.group()!r} in an output: {text[:300]!r}"
      assert "application/vnd.jupyter.widget-view+json" not in out.get("data", {})
  assert path.stat().st_size < MAX_BYTES, (
      f"{path.name} is {path.stat().st_size / 1024:.0f} KB: lower the figures' size or dpi")


@by_name
def test_colab_badge_install_and_platform(path):
  notebook = _read(path)
  first = notebook.cells[0]
  assert (first.cell_type, first.source.strip()) == ("markdown", execute.badge(path.stem))
  links = re.findall(r"https://colab\.research\.google\.com/github/[^)\s]*",
                     path.with_suffix(".md").read_text())
  assert links == [execute.colab_url(path.stem)], links
  assert execute.colab_url(path.stem).startswith(execute.COLAB_BASE)
  code = [cell.source for cell in _code_cells(notebook)]
  install = code[0]
  # Installs only when gmm_jax is missing, from the project's GitHub, never pinning jax (so
  # that Colab's newer jax is kept).
  assert "except ImportError:" in install
  assert '"gmm_jax[flax] @ git+https://github.com/gmm-jax/gmm_jax"' in install
  assert not re.search(r"jax\s*(==|<|~=)", install)
  assert any("jax.default_backend()" in source and "gmm_jax.explain(" in source
             for source in code[1:3])


# Notebooks whose run is in -m slow only (each 1-3 CPU-minutes; every notebook's pairing,
# saved outputs, badge and install cell are still checked above by default). Each shows an
# API whose own tests run by default: 03 quantize/QArray (test_quant.py), 04 explain, the
# bench tables and autotune (test_api.py, test_bench.py, test_tuning.py), 05
# train_moe.main's 200 steps (test_train_moe.py runs it as a function and as a module), 06
# from_transformers on the twelve architectures of notebook 06 (test_transformers_weights.py
# checks them all).
# 01_quickstart and 02_moe_flax (the gmm call and the Flax MoE layer) run by default.
SLOW_TO_RUN = {"03_quantization", "04_performance", "05_train_moe", "06_transformers"}


@pytest.mark.parametrize("path", [
    pytest.param(p, id=p.stem, marks=[pytest.mark.slow] if p.stem in SLOW_TO_RUN else [])
    for p in NOTEBOOKS])
def test_notebook_runs(path, tmp_path, monkeypatch):
  if "flax" in path.stem or "train" in path.stem:
    pytest.importorskip("flax")
  monkeypatch.setenv("JAX_PLATFORMS", "cpu")  # the kernel inherits it
  notebook = _read(path)  # a copy in memory, run in tmp_path: the repository is not written
  for cell in _code_cells(notebook):
    cell.outputs = []
  client = nbclient.NotebookClient(notebook, timeout=600, kernel_name="python3",
                                   resources={"metadata": {"path": str(tmp_path)}})
  client.execute()  # raises CellExecutionError with the failing cell's traceback
  errors = [out for cell in _code_cells(notebook)
            for out in cell.get("outputs", []) if out.get("output_type") == "error"]
  assert not errors
  assert "cpu" in "".join(out.get("text", "") for out in _code_cells(notebook)[1].outputs)
