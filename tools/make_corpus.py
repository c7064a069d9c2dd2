"""Builds the training text of `python -m gmm_jax.examples.train_moe` from the project's own
documentation: the README and the docs pages, in reading order, as plain text without their
code blocks (the model learns English prose about grouped matmuls, not Python).

  python tools/make_corpus.py        # writes gmm_jax/examples/data/gmm_jax_docs.txt

The text in the package is a snapshot: rebuild it when the docs have changed enough to
matter, and update the size and sha256 in gmm_jax/examples/data/README.md (printed here).
docs/api.md (autodoc directives) and docs/transformers.md (mostly a table of model names)
are left out.
"""

from __future__ import annotations

import hashlib
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
OUT = ROOT / "gmm_jax" / "examples" / "data" / "gmm_jax_docs.txt"
PAGES = ("README.md", "docs/index.md", "docs/gmm.md", "docs/quantization.md",
         "docs/sharding.md", "docs/moe.md", "docs/flax.md", "docs/kernels.md",
         "docs/support.md", "docs/migration.md", "docs/facades.md", "docs/architecture.md",
         "docs/testing.md")
# Fenced blocks whose text is prose (MyST admonitions); every other fence is dropped.
PROSE_FENCES = ("{important}", "{note}", "{warning}")
TABLE_RULE = re.compile(r"\|[-| :]+\|")


def page_text(markdown: str) -> str:
  """One page without code blocks, directives and table rules; runs of blank lines as one."""
  kept, fence = [], None
  for line in markdown.split("\n"):
    stripped = line.strip()
    if stripped.startswith("```"):
      fence = None if fence is not None else stripped[3:].strip()
      continue
    if fence is not None and fence not in PROSE_FENCES:
      continue
    if TABLE_RULE.fullmatch(stripped):
      continue
    kept.append(line.rstrip())
  return re.sub(r"\n{3,}", "\n\n", "\n".join(kept)).strip() + "\n"


def build() -> bytes:
  return "\n".join(page_text((ROOT / page).read_text()) for page in PAGES).encode()


def main() -> None:
  text = build()
  OUT.write_bytes(text)
  print(f"{OUT.relative_to(ROOT)}: {len(text):,} bytes, sha256 "
        f"{hashlib.sha256(text).hexdigest()}")


if __name__ == "__main__":
  main()
