"""The wheel ships pallas/ as gmm_jax.pallas (every folder) and never as a top-level pallas."""

import os
import pathlib
import subprocess
import sys
import zipfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _kernel_files():
  """Every .py file under pallas/, relative to it."""
  out = []
  for path in (ROOT / "pallas").rglob("*.py"):
    if "__pycache__" not in path.parts:
      out.append(path.relative_to(ROOT / "pallas").as_posix())
  return sorted(out)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
  out = tmp_path_factory.mktemp("wheel")
  subprocess.run(
      [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(out), str(ROOT)],
      check=True, capture_output=True, text=True)
  (path,) = out.glob("gmm_jax-*.whl")
  return path


def test_every_pallas_folder_ships_under_gmm_jax(wheel):
  names = set(zipfile.ZipFile(wheel).namelist())
  files = _kernel_files()
  assert "__init__.py" in files
  missing = [f for f in files if f"gmm_jax/pallas/{f}" not in names]
  assert not missing, f"not in the wheel: {missing}"
  for folder in {os.path.dirname(f) for f in files}:
    assert f"gmm_jax/pallas/{folder + '/' if folder else ''}__init__.py" in names, folder


def test_no_top_level_pallas_in_wheel(wheel):
  names = zipfile.ZipFile(wheel).namelist()
  assert not [n for n in names if n.startswith("pallas/") or n == "pallas.py"]


def test_installed_copy_imports_gmm_jax_pallas_but_not_pallas(wheel, tmp_path):
  site = tmp_path / "site"
  subprocess.run(
      [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site),
       str(wheel)], check=True, capture_output=True, text=True)
  code = (
      "import importlib.util, gmm_jax, gmm_jax.pallas\n"
      f"assert gmm_jax.__file__.startswith({str(site)!r}), gmm_jax.__file__\n"
      f"assert gmm_jax.pallas.__file__.startswith({str(site)!r}), gmm_jax.pallas.__file__\n"
      "assert importlib.util.find_spec('pallas') is None, importlib.util.find_spec('pallas')\n"
      "print('ok')\n")
  # -s: no user site; run from an empty folder so neither the checkout nor an editable
  # install's source tree can shadow the installed copy.
  env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
  env["PYTHONPATH"] = str(site)
  result = subprocess.run([sys.executable, "-s", "-c", code], cwd=tmp_path, env=env,
                          capture_output=True, text=True)
  assert result.returncode == 0 and "ok" in result.stdout, result.stderr
