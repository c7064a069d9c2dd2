#!/usr/bin/env bash
# Builds the reference docs (docs/, Sphinx + MyST + autodoc) and fails on any warning.
# Usage: bash .ci/docs.sh   (from anywhere; output in docs/_build/html)
set -euo pipefail
cd "$(dirname "$0")/.."

if ! python -c "import sphinx, myst_parser" 2>/dev/null; then
  python -m pip install --quiet "sphinx>=7" "myst-parser>=2"
fi

start=$(date +%s)
# -W: warnings are errors; --keep-going: report all of them; -E: reread every page, so a
# docstring warning is not hidden by a cached environment.
python -m sphinx -W --keep-going -E -b html docs docs/_build/html
echo "docs: built docs/_build/html without warnings in $(( $(date +%s) - start )) s"
