"""Sphinx configuration of the gmm_jax reference documentation.

Build: ``sphinx-build -W --keep-going -b html docs docs/_build/html`` (``.ci/docs.sh``).
"""

import os
import sys

sys.path.insert(0, os.path.abspath(".."))

project = "gmm_jax"
author = "gmm_jax authors"
copyright = "2026, gmm_jax authors"  # noqa: A001 (Sphinx's name)

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
]

source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
root_doc = "index"
exclude_patterns = ["_build", "Thumbs.db", ".DS_Store"]

# MyST: `:::` fences for directives; headings up to level 3 get anchors, so Markdown links
# to a section (page.md#section) resolve.
myst_enable_extensions = ["colon_fence"]
myst_heading_anchors = 3

# The docstrings mark names and code with single backquotes (Markdown habit): render them
# as inline code instead of letting RST look for a cross-reference target.
default_role = "code"

# Google-style docstrings (STYLE.md): Args / Returns / Raises.
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False
# The dataclasses document their fields in a "Fields:" section, in the Args style (a field
# of a frozen dataclass is a constructor argument).
napoleon_custom_sections = [("Fields", "params_style")]

# Signatures show names and defaults only: the docstrings give each argument's type and
# shape (STYLE.md), and jax's ArrayLike annotations would expand into long unions.
autodoc_typehints = "none"
autodoc_member_order = "bysource"
autodoc_default_options = {"members": False}
# Optional dependencies are imported for real (flax for gmm_jax.nn): the docs describe the
# installed package, and an import failure must fail the build.

html_theme = "alabaster"
html_title = "gmm_jax"
