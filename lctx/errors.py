"""Configuration and input errors, and the one line main.py prints for them.

A `ConfigError` is a mistake in what was asked for: a gin file or binding, a flag,
a strategy that does not fit the mesh, hardware the file is not for. main.py prints
it as one line, `error: <what is wrong> <how to fix it>`, and exits with status 2.
Validation code raises it (it is a ValueError, so callers that catch ValueError
still do); `config_phase` turns what gin and the config dataclasses raise while a
run's configuration is read into one.

An `InputError` is bad input met while the run works: a data row
(lctx/data/files.py BadRowError), a task file line (lctx/evals/task_files.py), a
conversation row. It names the file and line, prints the same one line, exits
with the same status, and a training run that meets one first writes a
checkpoint at the step reached (lctx/train.py). Every other exception is a bug
and keeps its traceback, as do these with `--verbose_errors` or
LCTX_VERBOSE_ERRORS=1.
"""

from __future__ import annotations

import contextlib
import difflib
import inspect
import os
import re
import sys

EXIT_STATUS = 2
VERBOSE_ENV = "LCTX_VERBOSE_ERRORS"
# Where gin says a binding came from (its messages add these lines to the cause).
_GIN_FILE_LINE = re.compile(r"^\s*In file \"?([^\",]+)\"?, line (\d+)", re.M)
_GIN_BINDING_LINE = re.compile(r"^\s*In bindings string line \d+\n\s+(.+)$", re.M)
_UNKNOWN_PARAMETER = re.compile(r"Configurable '([^']+)' doesn't have a parameter named '([^']+)'")
_DEFAULT_FIX = (
  "Change the setting or flag it names (in the gin file, with --gin_param, or the flag)."
)
_UNKNOWN_CONFIGURABLE = re.compile(r"No configurable matching '([^']+)'")
# Gin bindings that moved: old `Configurable.parameter` -> (the options object
# the value now belongs to, its field). A file binding an old name fails with
# one line naming the new binding.
MOVED_BINDINGS = {
  "TrainConfig.attention_backend": ("attention_options", "AttentionOptions.backend"),
  "TrainConfig.attention_block_q": ("attention_options", "AttentionOptions.block_q"),
  "TrainConfig.attention_block_kv": ("attention_options", "AttentionOptions.block_kv"),
  "TrainConfig.attention_block_q_bwd": ("attention_options", "AttentionOptions.block_q_bwd"),
  "TrainConfig.attention_block_kv_bwd": ("attention_options", "AttentionOptions.block_kv_bwd"),
  "TrainConfig.attention_fused_bwd": ("attention_options", "AttentionOptions.fused_bwd"),
  "TrainConfig.load_balance": ("context_options", "ContextOptions.load_balance"),
  "TrainConfig.ulysses_head_chunks": ("context_options", "ContextOptions.head_chunks"),
  "TrainConfig.ulysses_stage_projections": ("context_options", "ContextOptions.stage_projections"),
}


class ConfigError(ValueError):
  """Bad configuration or input. `fix` says how to put it right (optional)."""

  def __init__(self, message: str, fix: str | None = None):
    super().__init__(message)
    self.fix = fix


class InputError(ConfigError):
  """Bad input data met at run time (a row or line of a file, named with its line)."""


@contextlib.contextmanager
def config_phase():
  """Errors raised while a run's configuration is read are ConfigErrors.

  Wraps gin parsing and the building of the config dataclasses: there a
  ValueError (an unknown binding, a validation in `__post_init__`), a missing
  file (OSError) or a gin syntax error is the user's input, never a bug.
  """
  try:
    yield
  except ConfigError:
    raise
  except (ValueError, OSError, SyntaxError) as err:
    raise ConfigError(_gin_cause(err), fix=_gin_fix(err)) from err


def one_line(err: BaseException) -> str:
  """`error: <cause> <fix>` on one line."""
  text = " ".join(str(err).split())
  fix = getattr(err, "fix", None)
  fix = _DEFAULT_FIX if fix is None else fix  # "" : the message says it already
  return f"error: {text} {fix}".rstrip()


def verbose(flag: bool = False) -> bool:
  return flag or os.environ.get(VERBOSE_ENV, "") not in ("", "0")


def report(err: ConfigError) -> None:
  """Prints `err` as one line on stderr and exits with EXIT_STATUS."""
  print(one_line(err) + " (--verbose_errors shows the traceback)", file=sys.stderr, flush=True)
  sys.exit(EXIT_STATUS)


def _gin_cause(err: BaseException) -> str:
  """The first line of gin's message and where the binding came from."""
  message = str(err)
  if isinstance(err, SyntaxError):
    where = f"{err.filename}, line {err.lineno}" if err.filename else "--gin_param"
    return f"gin syntax: {(err.msg or '').rstrip('.')} ({where}: {(err.text or '').strip()!r})."
  cause = message.strip().splitlines()[0].rstrip(" :.") if message.strip() else type(err).__name__
  if m := _GIN_FILE_LINE.search(message):
    cause = f"{cause} ({m.group(1)}, line {m.group(2)})"
  elif m := _GIN_BINDING_LINE.search(message):
    cause = f"{cause} (--gin_param {m.group(1).strip()!r})"
  return cause + "."


def _gin_fix(err: BaseException) -> str:
  message = str(err)
  if m := _UNKNOWN_PARAMETER.search(message):
    if moved := MOVED_BINDINGS.get(f"{m.group(1)}.{m.group(2)}"):
      field, new = moved
      kind = new.split(".")[0]
      return (
        f"{m.group(1)}.{m.group(2)} moved to {new}: bind {m.group(1)}.{field} = "
        f"@{kind}() and {new} = <the value>."
      )
    known = _parameters_of(m.group(1))
    close = difflib.get_close_matches(m.group(2), known, n=1)
    if close:
      return f"Did you mean {m.group(1)}.{close[0]}?"
    return f"{m.group(1)} takes: {', '.join(known)}." if known else ""
  if m := _UNKNOWN_CONFIGURABLE.search(message):
    close = difflib.get_close_matches(m.group(1), _configurables(), n=1)
    return f"Did you mean {close[0]}?" if close else ""
  if isinstance(err, OSError):
    return "Give a path from the working directory or the repository root (e.g. gin/local_cpu.gin)."
  return "Fix that binding in the gin file or in --gin_param."


def _parameters_of(selector: str) -> list[str]:
  """The parameters a gin configurable takes (empty if gin cannot say)."""
  try:
    import gin  # pylint: disable=g-import-not-at-top

    configurable = gin.config._REGISTRY.get_match(selector)  # pylint: disable=protected-access
    return list(inspect.signature(configurable.wrapped).parameters)
  except Exception:  # pylint: disable=broad-except
    return []


def _configurables() -> list[str]:
  try:
    import gin  # pylint: disable=g-import-not-at-top

    return [c.name for _, c in gin.config._REGISTRY.items()]  # pylint: disable=protected-access
  except Exception:  # pylint: disable=broad-except
    return []


class BadRowError(InputError):
  """One bad row or file; `where` is 'file:line' or 'file'. An InputError (a
  ValueError): main.py prints it as one line and exits with status 2."""

  def __init__(self, where: str, what: str):
    super().__init__(f"{where}: {what}", fix="")
    self.where, self.what = where, what
