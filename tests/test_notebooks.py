"""The notebooks: each jupytext pair (.md, .ipynb) holds the same cells, and each notebook
runs top to bottom on CPU (nbclient, a fresh kernel), as it would in Colab."""

from __future__ import annotations

import pathlib

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
jupytext = pytest.importorskip("jupytext")
pytest.importorskip("matplotlib")

NOTEBOOKS = sorted((pathlib.Path(__file__).resolve().parents[1] / "notebooks").glob("*.ipynb"))


def _cells(notebook):
  return [(cell.cell_type, cell.source.strip()) for cell in notebook.cells]


def test_there_are_five_notebooks():
  assert [p.stem for p in NOTEBOOKS] == ["01_quickstart", "02_moe_flax", "03_quantization",
                                         "04_performance", "05_train_moe"]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_pair_in_sync(path):
  paired = jupytext.read(path.with_suffix(".md"))
  assert _cells(paired) == _cells(nbformat.read(path, as_version=4)), (
      f"{path.name} and its .md differ: run `jupytext --sync {path.with_suffix('.md')}`")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs(path, tmp_path):
  if "flax" in path.stem:
    pytest.importorskip("flax")
  notebook = nbformat.read(path, as_version=4)
  client = nbclient.NotebookClient(notebook, timeout=600, kernel_name="python3",
                                   resources={"metadata": {"path": str(tmp_path)}})
  client.execute()  # raises CellExecutionError with the failing cell's traceback
  errors = [out for cell in notebook.cells if cell.cell_type == "code"
            for out in cell.get("outputs", []) if out.get("output_type") == "error"]
  assert not errors
