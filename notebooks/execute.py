"""Executes the notebooks and saves their outputs into the .ipynb files.

    python notebooks/execute.py                 # all six
    python notebooks/execute.py 04 05_train_moe  # some (a name, or the start of one)

The .md of each jupytext pair is the source: every run rebuilds the .ipynb from it (putting
the Colab badge first, from `COLAB_BASE`), executes it top to bottom in a fresh kernel
(nbclient, working directory a temporary folder, so nothing is written into the repository),
strips volatile noise from the outputs (ANSI codes, carriage-return redraws, this machine's
absolute paths, widget state, timings) and writes the .ipynb with, in its metadata,
``gmm_jax = {"source_sha256": <hash of the cells' sources>, "executed_with": {jax, jaxlib,
platform, device_kind, python}}``. tests/test_notebooks.py checks that hash against the
cells, so a notebook whose cells changed since its outputs were saved fails there.

It runs on whatever backend jax finds (CPU here; on a GPU or TPU machine the notebooks take
their accelerator branch and the metadata records it). A code cell tagged ``no-output``
(```` ```python tags=["no-output"] ```` in the .md) may have no output; every other must
print or plot.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import pathlib
import re
import sys
import tempfile
import time

# The project's GitHub home: the Colab badge of notebook NAME opens COLAB_BASE + NAME.ipynb.
COLAB_BASE = "https://colab.research.google.com/github/gmm-jax/gmm_jax/blob/main/notebooks/"
BADGE_IMAGE = "https://colab.research.google.com/assets/colab-badge.svg"
NO_OUTPUT_TAG = "no-output"

NOTEBOOKS_DIR = pathlib.Path(__file__).resolve().parent
REPO = NOTEBOOKS_DIR.parent

_ANSI = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]")
_BADGE_LINE = re.compile(r"^\[!\[Open In Colab\]\(.*\)\]\(.*\)\s*$")

# Printed by an extra last cell (removed again): what the kernel ran on.
_PROBE = """\
import json as _json, platform as _platform, jax as _jax, jaxlib as _jaxlib
print("GMM_JAX_EXECUTED_WITH" + _json.dumps({
    "jax": _jax.__version__, "jaxlib": _jaxlib.__version__,
    "platform": _jax.default_backend(), "device_kind": _jax.devices()[0].device_kind,
    "python": _platform.python_version()}))"""


def colab_url(name: str) -> str:
  return f"{COLAB_BASE}{name}.ipynb"


def badge(name: str) -> str:
  """The first cell of notebook `name`: a Markdown Colab badge."""
  return f"[![Open In Colab]({BADGE_IMAGE})]({colab_url(name)})"


def source_hash(notebook) -> str:
  """sha256 of the cells' types and sources (what the saved outputs were computed from)."""
  cells = [[cell["cell_type"], cell["source"].strip()] for cell in notebook["cells"]]
  return hashlib.sha256(json.dumps(cells, ensure_ascii=False).encode()).hexdigest()


def notebook_names() -> list[str]:
  return sorted(p.stem for p in NOTEBOOKS_DIR.glob("[0-9][0-9]_*.md"))


def fix_badge(md_path: pathlib.Path) -> bool:
  """Makes the first cell of the .md (after its YAML header) the badge; True if it changed."""
  text = md_path.read_text()
  match = re.match(r"(---\n.*?\n---\n)\n*", text, re.S)
  header_end = match.end() if match else 0
  header = text[:match.end(1)] if match else ""
  rest = text[header_end:]
  first, _, after = rest.partition("\n")
  wanted = badge(md_path.stem)
  if _BADGE_LINE.match(first):
    body = after.lstrip("\n")
  else:
    body = rest
  # Two blank lines after the badge: jupytext starts a new Markdown cell there.
  new = f"{header}\n{wanted}\n\n\n{body}" if header else f"{wanted}\n\n\n{body}"
  if new != text:
    md_path.write_text(new)
    return True
  return False


def read_source(name: str):
  """The notebook as its .md says (badge fixed first), cells with stable ids, no outputs."""
  import jupytext
  md_path = NOTEBOOKS_DIR / f"{name}.md"
  if fix_badge(md_path):
    print(f"{md_path.name}: Colab badge written", flush=True)
  notebook = jupytext.read(md_path)
  for index, cell in enumerate(notebook.cells):
    cell["id"] = f"cell-{index:02d}"
    if cell.cell_type == "code":
      cell["outputs"], cell["execution_count"] = [], None
  return notebook


def _scrub_text(text: str) -> str:
  """Without ANSI codes, carriage-return redraws and this machine's absolute paths."""
  text = _ANSI.sub("", text)
  if "\r" in text:  # a progress bar redrawn in place: keep what a terminal ends up showing
    lines = []
    for line in text.split("\n"):
      shown = ""
      for part in line.split("\r"):
        shown = part + shown[len(part):]
      lines.append(shown.rstrip() if "\r" in line else shown)
    text = "\n".join(lines)
  replacements = [(str(REPO) + os.sep, ""), (str(REPO), "."),
                  (tempfile.gettempdir() + os.sep, "<tmp>/")]
  replacements += [(p + os.sep, "<python>/") for p in sorted({sys.prefix, sys.base_prefix},
                                                            key=len, reverse=True)]
  replacements.append((os.path.expanduser("~") + os.sep, "~/"))
  for old, new in replacements:
    if len(old) > 1:
      text = text.replace(old, new)
  return text


def clean(notebook) -> None:
  """Strips volatile noise from the outputs and metadata, in place."""
  notebook.metadata.pop("widgets", None)
  for cell in notebook.cells:
    cell.metadata.pop("execution", None)
    cell.metadata.pop("widgets", None)
    if cell.cell_type != "code":
      continue
    outputs = []
    for out in cell.get("outputs", []):  # consecutive stream outputs merged, then scrubbed
      if out.get("output_type") == "stream":
        if outputs and outputs[-1].get("output_type") == "stream" and (
            outputs[-1]["name"] == out["name"]):
          outputs[-1]["text"] += out["text"]
          continue
      elif out.get("output_type") == "error":
        out["traceback"] = [_scrub_text(line) for line in out.get("traceback", [])]
      data = out.get("data", {})
      data.pop("application/vnd.jupyter.widget-view+json", None)
      if "text/plain" in data:
        data["text/plain"] = _scrub_text(data["text/plain"])
      outputs.append(out)
    for out in outputs:
      if out.get("output_type") == "stream":
        out["text"] = _scrub_text(out["text"])
    cell["outputs"] = outputs


def execute(notebook, *, cwd: str | None = None, timeout: int = 900):
  """Runs `notebook` in place in a fresh kernel (cwd: a temporary folder unless given);
  returns what the kernel ran on (the `executed_with` dict)."""
  import nbclient
  import nbformat
  probe = nbformat.v4.new_code_cell(_PROBE)
  probe["id"] = "probe"
  notebook.cells.append(probe)
  try:
    with tempfile.TemporaryDirectory() as tmp:
      client = nbclient.NotebookClient(
          notebook, timeout=timeout, kernel_name="python3", record_timing=False,
          resources={"metadata": {"path": cwd or tmp}})
      client.execute()  # raises CellExecutionError with the failing cell's traceback
  finally:
    notebook.cells.pop()
  text = "".join(out.get("text", "") for out in probe.get("outputs", []))
  return json.loads(text.split("GMM_JAX_EXECUTED_WITH", 1)[1])


def run(name: str, timeout: int = 900) -> tuple[float, int]:
  """Rebuilds, executes and saves notebook `name`; returns (seconds, bytes written)."""
  import nbformat
  notebook = read_source(name)
  start = time.perf_counter()
  executed_with = execute(notebook, timeout=timeout)
  seconds = time.perf_counter() - start
  clean(notebook)
  notebook.metadata.pop("language_info", None)  # the probe records the Python version
  notebook.metadata["gmm_jax"] = {"source_sha256": source_hash(notebook),
                                  "executed_with": executed_with}
  path = NOTEBOOKS_DIR / f"{name}.ipynb"
  text = nbformat.writes(notebook) + "\n"
  path.write_text(text)
  return seconds, len(text.encode())


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("names", nargs="*",
                      help="notebooks to run (a name or its start, e.g. 04); default all")
  parser.add_argument("--timeout", type=int, default=900, help="seconds per cell")
  args = parser.parse_args(argv)
  names = notebook_names()
  chosen = names
  if args.names:
    chosen = []
    for given in args.names:
      stem = pathlib.Path(given).stem
      matches = [n for n in names if n == stem or n.startswith(stem)]
      if len(matches) != 1:
        parser.error(f"{given!r} names {len(matches)} notebooks of {names}")
      chosen += matches
  total = time.perf_counter()
  for name in chosen:
    seconds, size = run(name, args.timeout)
    print(f"{name}: executed in {seconds:.1f} s, {name}.ipynb {size / 1024:.0f} KB", flush=True)
  print(f"{len(chosen)} notebooks in {time.perf_counter() - total:.1f} s", flush=True)


if __name__ == "__main__":
  main()
