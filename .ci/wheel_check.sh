#!/usr/bin/env bash
# Builds the wheel and checks it works where the checkout cannot help: installs it (and its
# dependencies, from the package index) into a fresh virtual environment, then, from a folder
# outside the checkout, imports gmm_jax and gmm_jax.pallas (and asserts they come from that
# environment), runs a small `python -m gmm_jax.demo` and both console scripts' --help.
#
#   bash .ci/wheel_check.sh            # uses `python`; PYTHON=python3.12 to pick another
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
PYTHON=${PYTHON:-python}
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
start=$SECONDS

echo "== building the wheel"
"$PYTHON" -m pip wheel --no-deps -q -w "$TMP/dist" .
WHEEL=$(ls "$TMP"/dist/gmm_jax-*.whl)
echo "$(basename "$WHEEL")"

echo "== installing it into a fresh virtual environment"
"$PYTHON" -m venv "$TMP/venv"
VENV_PY="$TMP/venv/bin/python"
"$VENV_PY" -m pip install -q "$WHEEL"

# Outside the checkout, with no PYTHONPATH, so only the installed copy can be imported.
mkdir "$TMP/run"
cd "$TMP/run"
unset PYTHONPATH
export JAX_PLATFORMS=${JAX_PLATFORMS:-cpu}

echo "== import"
"$VENV_PY" -s - "$ROOT" "$TMP/venv" <<'EOF'
import pathlib, sys
import gmm_jax, gmm_jax.pallas
root, venv = (pathlib.Path(p).resolve() for p in sys.argv[1:])
for module in (gmm_jax, gmm_jax.pallas):
    path = pathlib.Path(module.__file__).resolve()
    assert root not in path.parents, f"{module.__name__} imported from the checkout: {path}"
    assert venv in path.parents, f"{module.__name__} not from the new environment: {path}"
print(gmm_jax.__file__)
EOF

echo "== python -m gmm_jax.demo (small)"
"$VENV_PY" -s -m gmm_jax.demo --m 256 --kn 64 --groups 4

echo "== console scripts"
"$TMP/venv/bin/gmm-jax-bench" --help > "$TMP/bench-help.txt"
head -n 1 "$TMP/bench-help.txt"
"$TMP/venv/bin/gmm-jax-aot" --help > "$TMP/aot-help.txt"
head -n 1 "$TMP/aot-help.txt"

echo "== wheel check passed in $((SECONDS - start)) s"
