"""The reference docs cover the public API and their table of contents is whole.

Needs no Sphinx: it reads docs/*.md as text. The warning-free build itself is
`.ci/docs.sh`.
"""

import pathlib
import re

import gmm_jax

DOCS = pathlib.Path(__file__).resolve().parent.parent / "docs"


def _public_names():
  names = getattr(gmm_jax, "__all__", None)
  if names is None:
    names = [name for name in dir(gmm_jax) if not name.startswith("_")]
  # Submodules (gmm_jax.nn, gmm_jax.compat, ...) are documented as modules, not as names.
  return sorted(name for name in names
                if not isinstance(getattr(gmm_jax, name, None), type(gmm_jax)))


def _toctree_entries(page):
  text = (DOCS / page).read_text()
  entries = []
  for block in re.findall(r"```\{toctree\}\n(.*?)```", text, flags=re.S):
    for line in block.splitlines():
      line = line.strip()
      if line and not line.startswith(":"):
        entries.append(line)
  return entries


def test_every_public_name_is_in_the_api_reference():
  api = (DOCS / "api.md").read_text()
  missing = [name for name in _public_names()
             if not re.search(rf"gmm_jax\.{re.escape(name)}\b", api)]
  assert not missing, f"public names of gmm_jax missing from docs/api.md: {missing}"


def test_every_toctree_page_exists():
  entries = _toctree_entries("index.md")
  assert entries, "docs/index.md has no toctree"
  missing = [entry for entry in entries
             if not any((DOCS / f"{entry}{suffix}").is_file() for suffix in (".md", ".rst"))]
  assert not missing, f"toctree pages missing from docs/: {missing}"
  assert "moe" in entries and "api" in entries


def test_every_page_is_in_the_toctree():
  entries = set(_toctree_entries("index.md"))
  pages = {path.stem for path in DOCS.glob("*.md")} - {"index"}
  assert not pages - entries, f"docs pages outside the toctree: {sorted(pages - entries)}"
