"""The wheel ships pallas/ as gmm_jax.pallas (every folder) and never as a top-level pallas,
with its license, py.typed, extras and console scripts; `gmm_jax.__all__` is the public API."""

import ast
import importlib
import io
import os
import pathlib
import shutil
import subprocess
import sys
import tomllib
import types
import zipfile

import gmm_jax
import pytest
from absl import flags
from gmm_jax.tools import bench
from gmm_jax._src import cli

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _kernel_files():
  """Every .py file under pallas/, relative to it."""
  out = []
  for path in (ROOT / "pallas").rglob("*.py"):
    if "__pycache__" not in path.parts:
      out.append(path.relative_to(ROOT / "pallas").as_posix())
  return sorted(out)


def _source_copy(dest: pathlib.Path) -> pathlib.Path:
  """The checkout's files (tracked, and untracked ones git does not ignore) copied to
  `dest`: setuptools builds in the source's ``build/``, whose leftovers (files deleted
  since) would otherwise ship in the wheel."""
  listed = subprocess.run(["git", "-C", str(ROOT), "ls-files", "-co", "--exclude-standard"],
                          check=True, capture_output=True, text=True).stdout.split("\n")
  for name in filter(None, listed):
    source = ROOT / name
    if source.is_file():
      (dest / name).parent.mkdir(parents=True, exist_ok=True)
      shutil.copy2(source, dest / name)
  return dest


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
  out = tmp_path_factory.mktemp("wheel")
  source = _source_copy(tmp_path_factory.mktemp("source"))
  subprocess.run(
      [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(out), str(source)],
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


def test_training_text_ships_in_the_wheel(wheel):
  # The example's corpus (the project's own docs) and its README, nothing else in data/.
  names = zipfile.ZipFile(wheel).namelist()
  data = sorted(n for n in names if n.startswith("gmm_jax/examples/data/"))
  assert data == ["gmm_jax/examples/data/README.md", "gmm_jax/examples/data/gmm_jax_docs.txt"]


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


def test_uninstalled_checkout_imports_its_own_kernels(tmp_path):
  """A checkout on PYTHONPATH, not installed, imports gmm_jax.pallas from its own pallas/
  (not from an editable install of another checkout, and not failing over to XLA)."""
  checkout = _source_copy(tmp_path / "checkout")
  code = (
      "import gmm_jax, gmm_jax.pallas, gmm_jax.pallas.tpu\n"
      f"assert gmm_jax.__file__.startswith({str(checkout)!r}), gmm_jax.__file__\n"
      f"assert gmm_jax.pallas.__file__ == {str(checkout / 'pallas' / '__init__.py')!r}, "
      "gmm_jax.pallas.__file__\n"
      f"assert gmm_jax.pallas.tpu.__file__.startswith({str(checkout / 'pallas')!r})\n"
      "assert not gmm_jax._src.backends.registry.unavailable(), "
      "gmm_jax._src.backends.registry.unavailable()\n"
      "print('ok')\n")
  env = dict(os.environ, PYTHONPATH=str(checkout), JAX_PLATFORMS="cpu")
  result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env,
                          capture_output=True, text=True)
  assert result.returncode == 0 and "ok" in result.stdout, result.stderr


# ------------------------------------------------------------------ metadata and license


def _pyproject() -> dict:
  return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_license_is_apache_2_and_ships_in_the_wheel(wheel):
  text = (ROOT / "LICENSE").read_text()
  assert "Apache License" in text and "Version 2.0, January 2004" in text
  assert "END OF TERMS AND CONDITIONS" in text
  project = _pyproject()["project"]
  assert project["license"] == "Apache-2.0" and project["license-files"] == ["LICENSE"]
  names = zipfile.ZipFile(wheel).namelist()
  assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names), names
  metadata = _wheel_text(wheel, "METADATA")
  assert "License-Expression: Apache-2.0" in metadata


def test_py_typed_ships_in_the_wheel(wheel):
  assert (ROOT / "gmm_jax" / "py.typed").exists()
  assert "gmm_jax/py.typed" in zipfile.ZipFile(wheel).namelist()


def test_extras():
  extras = _pyproject()["project"]["optional-dependencies"]
  assert extras["docs"] == ["sphinx>=7", "myst-parser>=2"]
  assert "flax>=0.12.3" in extras["flax"] and "flax>=0.12.3" in extras["test"]
  assert any(r.startswith("jax[cuda") for r in extras["gpu"])
  assert any(r.startswith("jax[tpu]") for r in extras["tpu"])
  assert "absl-py" in _pyproject()["project"]["dependencies"]


# ------------------------------------------------------------------------ console scripts

SCRIPTS = {"gmm-jax-bench": "gmm_jax.tools.bench:run", "gmm-jax-aot": "gmm_jax.tools.aot:run"}


def test_console_scripts_declared_and_importable(wheel):
  assert _pyproject()["project"]["scripts"] == SCRIPTS
  entry_points = _wheel_text(wheel, "entry_points.txt")
  for name, target in SCRIPTS.items():
    assert f"{name} = {target}" in entry_points
    module = importlib.import_module(target.split(":")[0])
    assert callable(getattr(module, target.split(":")[1])) and callable(module.main)


@pytest.mark.parametrize("module", ["gmm_jax.tools.bench", "gmm_jax.tools.aot"])
def test_help_and_bad_flags(module, capsys):
  main = importlib.import_module(module).main
  for _ in range(2):  # the flags live in a FlagValues per call: a second parse works
    with pytest.raises(SystemExit) as exit_info:
      main(["--help"])
    assert exit_info.value.code == 0 and "usage: gmm-jax-" in capsys.readouterr().out
  with pytest.raises(SystemExit) as exit_info:
    main(["--no-such-flag"])
  assert exit_info.value.code == 2 and "no-such-flag" in capsys.readouterr().err
  assert "platform" not in flags.FLAGS and "targets" not in flags.FLAGS  # nothing global


@pytest.mark.parametrize("argv", [["--groups", "8", "64"], ["--groups=8,64"],
                                  ["--groups=8", "--groups=64"], ["--groups", "8,64"]])
def test_list_flags_take_argparse_and_absl_forms(argv):
  args = cli.parse_flags(bench._define_flags(), "gmm-jax-bench",
                         [*argv, "--sizes", "skewed", "--interpret"], "doc")
  assert args.groups == [8, 64] and args.sizes == ["skewed"] and args.interpret


def test_progress_bar():
  out = io.StringIO()
  bar = cli.Progress(4, True, stream=out)
  bar.begin("case-a")
  bar.print("| row |")
  bar.advance("case-a")  # not a terminal: one line per update, no carriage returns
  assert out.getvalue().splitlines() == ["[....................] 0/4 case-a 0s",
                                         "[#####...............] 1/4 case-a 0s"]
  quiet = io.StringIO()
  cli.Progress(4, False, stream=quiet).begin("case-a")
  assert quiet.getvalue() == ""


# ----------------------------------------------------------------------------- public API


def test_all_lists_exactly_the_public_names():
  public = {name for name, value in vars(gmm_jax).items()
            if not name.startswith("_") and not isinstance(value, types.ModuleType)}
  assert sorted(gmm_jax.__all__) == sorted(public)
  assert len(set(gmm_jax.__all__)) == len(gmm_jax.__all__)
  # ... and exactly the explicit re-exports of __init__.py (`from x import y as y`).
  tree = ast.parse((ROOT / "gmm_jax" / "__init__.py").read_text())
  reexports = {alias.asname for node in tree.body if isinstance(node, ast.ImportFrom)
               for alias in node.names}
  assert set(gmm_jax.__all__) == reexports


def _wheel_text(wheel, name: str) -> str:
  archive = zipfile.ZipFile(wheel)
  (path,) = [n for n in archive.namelist() if n.endswith(f".dist-info/{name}")]
  return archive.read(path).decode()


def test_ci_runs_the_readme_quick_start_verbatim():
  readme = (ROOT / "README.md").read_text()
  start = readme.index("## Quick start")
  block = readme[start:].split("```bash\n", 1)[1].split("```", 1)[0]
  commands = [line for line in block.splitlines() if line.strip()]
  assert len(commands) == 2, commands  # install + demo, install + tests
  ci = (ROOT / ".ci" / "run").read_text().splitlines()
  for command in commands:
    assert command in ci, f"{command!r} is not run verbatim by .ci/run"
  assert "bash .ci/wheel_check.sh" in ci and "bash .ci/docs.sh" in ci
