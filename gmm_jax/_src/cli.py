"""The command-line plumbing of ``gmm-jax-bench`` and ``gmm-jax-aot``: absl flags parsed
into a `FlagValues` of each command's own (nothing registered globally at import, so the
modules import and their `main` runs any number of times, under pytest too), and a
dependency-free progress bar on stderr.

Floor 0: imports nothing from gmm_jax.
"""

from __future__ import annotations

import json
import pathlib
import sys
import time
from typing import Callable, Sequence

from absl import app, flags


def flag_values() -> flags.FlagValues:
  """A new FlagValues with the flags every command has: --help (-h) and --progress."""
  fv = flags.FlagValues()
  flags.DEFINE_bool("progress", None, "a progress bar on stderr (default: when stderr is a "
                    "terminal)", flag_values=fv)
  flags.DEFINE_bool("help", False, "show this help and exit", short_name="h", flag_values=fv)
  return fv


def show_progress(fv: flags.FlagValues) -> bool:
  """Whether --progress asks for the bar (unset: when stderr is a terminal)."""
  return sys.stderr.isatty() if fv["progress"].value is None else fv["progress"].value


def parse_flags(fv: flags.FlagValues, prog: str, argv: Sequence[str], doc: str
                ) -> flags.FlagValues:
  """Parses `argv` (no program name) into `fv`; prints the help and exits on --help, or
  the error and exits 2 on a bad flag. A repeated flag may also list its values after one
  name (``--groups 8 64``, argparse's ``nargs="+"``) or comma-separated (``--groups=8,64``).
  """
  multi = {name for name in fv if isinstance(fv[name], flags.MultiFlag)}
  normalized, current, pending = [], None, None
  for arg in argv:
    if current is not None and not arg.startswith("-"):
      normalized.extend(f"--{current}={value}" for value in arg.split(","))
      pending = None
      continue
    if pending is not None:  # a bare multi flag with no value: absl says so
      normalized.append(pending)
    current = pending = None
    name, has_value, value = arg[2:].partition("=") if arg.startswith("--") else ("", "", "")
    if name in multi and has_value:
      normalized.extend(f"--{name}={v}" for v in value.split(","))
    elif name in multi:
      current, pending = name, arg
    else:
      normalized.append(arg)
  if pending is not None:
    normalized.append(pending)
  try:
    rest = fv([prog, *normalized])
  except flags.Error as err:
    sys.stderr.write(f"{prog}: {err}\nTry --help.\n")
    raise SystemExit(2) from err
  if fv["help"].value:
    text = fv.get_help(include_special_flags=False).strip()  # a section per module
    print(f"usage: {prog} [flags]\n\n{doc.strip()}\n\nflags, by the module defining them:\n"
          f"{text}")
    raise SystemExit(0)
  if len(rest) > 1:
    sys.stderr.write(f"{prog}: unexpected arguments {rest[1:]}\nTry --help.\n")
    raise SystemExit(2)
  return fv


def run(main: Callable[[list[str]], int | None]) -> None:
  """Runs ``main(flags without the program name)`` under absl.app.run (exit status, absl
  logging). absl's global FLAGS get only its logging level (warnings, as without absl.app);
  `main` parses its command's own flags with `parse_flags`."""

  def parse_global(argv: list[str]) -> list[str]:
    flags.FLAGS([argv[0], "--verbosity=-1"])
    return argv

  app.run(lambda argv: main(argv[1:]), flags_parser=parse_global)


class Progress:
  """A dependency-free progress bar on stderr: ``[#####.....] 12/40 case-name 1m23s``.

  Rows printed through `print` clear the bar first, so stdout and stderr may share a
  terminal. On a terminal the bar redraws in place; elsewhere (``--progress`` into a log)
  each update is one line.
  """

  def __init__(self, total: int, enabled: bool, stream=None, width: int = 20):
    self.total, self.enabled, self.width = max(total, 0), enabled, width
    self.stream = sys.stderr if stream is None else stream
    self.tty = self.stream.isatty()
    self.done, self.label, self.start = 0, "", time.monotonic()

  def line(self) -> str:
    filled = self.width * self.done // self.total if self.total else self.width
    seconds = int(time.monotonic() - self.start)
    elapsed = f"{seconds // 60}m{seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s"
    return (f"[{'#' * filled}{'.' * (self.width - filled)}] {self.done}/{self.total} "
            f"{self.label} {elapsed}")

  def _draw(self):
    if self.enabled:
      self.stream.write(("\r\033[K" if self.tty else "") + self.line() +
                        ("" if self.tty else "\n"))
      self.stream.flush()

  def _clear(self):
    if self.enabled and self.tty:
      self.stream.write("\r\033[K")
      self.stream.flush()

  def begin(self, label: str):
    """Shows `label` as the case now running."""
    self.label = label
    self._draw()

  def advance(self, label: str | None = None):
    """Counts one case done (`label`: the case that finished, shown until the next)."""
    self.done += 1
    self.label = self.label if label is None else label
    # Into a log: one line per `begin` or labelled case, and the end.
    if self.tty or label is not None or self.done == self.total:
      self._draw()

  def print(self, text: str):
    """Prints a result row on stdout below (not through) the bar."""
    self._clear()
    print(text, flush=True)
    if self.tty:
      self._draw()

  def close(self):
    self._clear()


def save_tables(rows: list, table: str, json_path: str | None, markdown_path: str | None
                ) -> None:
  """Writes a command's result rows as JSON and its table as markdown, where asked."""
  if json_path:
    pathlib.Path(json_path).write_text(json.dumps(rows, indent=1))
  if markdown_path:
    pathlib.Path(markdown_path).write_text(table)
