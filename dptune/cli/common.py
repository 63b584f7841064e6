"""What every ``dptune`` command shares: exit codes, the one-line refusal (``dptune:``, the field
or file and the fix, exit code 2, nothing charged; docs/errors.md), flag and config parsing,
logging, closed pipes, and the one line of an unexpected error. Each command defines its flags."""

from __future__ import annotations

import difflib
import errno
import logging
import os
import re
import shlex
import sqlite3
import sys
import tempfile
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from absl import flags
from absl import logging as absl_logging

from dptune import configs
from dptune._state.journal import JOURNAL_FILE
from dptune.configs import base
from dptune.errors import Refused

log = logging.getLogger("dptune")

#: The run finished: a candidate was released, or none was selected (a legitimate private outcome).
OK = 0
#: An unexpected error (a bug in dptune or in a trainer): one line, the traceback in a file.
INTERNAL = 1
#: Refused before any private computation (the input, a file on disk, the budget): nothing charged.
REFUSED = 2
#: The run finished but no candidate succeeded: nothing released, the run's spend stays charged.
NO_CANDIDATE_SUCCEEDED = 3
#: Stopped by Ctrl-C (SIGINT) or SIGTERM: what was saved and how to resume is printed.
INTERRUPTED = 130
TERMINATED = 143

#: Arguments that print a command's help instead of running it.
HELP = ("-h", "--help", "-help", "-?", "--helpshort", "--helpfull")

#: ``dptune.tune``'s keywords as the command's config fields, for the library's messages.
_KEYWORD_FIELDS = {
    "accountant": "--config.privacy.accountant",
    "adjacency": "--config.privacy.adjacency",
    "budget epsilon": "--config.privacy.epsilon",
    "budget delta": "--config.privacy.delta",
}
_KEYWORD = re.compile(r"(?<![\w.-])(" + "|".join(_KEYWORD_FIELDS) + r")=")

#: What a full disk or a read-only folder looks like to dptune (OSError) and to SQLite.
_NO_SPACE = (errno.ENOSPC, errno.EROFS, errno.EDQUOT, errno.EACCES, errno.EPERM)
_SQLITE_NO_SPACE = ("disk is full", "readonly database", "disk i/o error")


class ArgumentError(Refused):
    """A command line that cannot run (a flag, an argument or a config name): it names which."""


def one_line(text: object) -> str:
    return " ".join(str(text).split())


def refuse(message: object) -> int:
    """Prints the refusal line (a :class:`Refused` in the command's words); returns REFUSED."""
    if isinstance(message, Refused):
        message = _KEYWORD.sub(lambda m: _KEYWORD_FIELDS[m.group(1)] + "=", message.for_command())
    # the line starts "dptune: refused:" already (a message may start with it: not twice)
    message = re.sub(r"^refused( before any private computation)?:\s*", "", one_line(message))
    print("dptune: refused: " + message, file=sys.stderr)
    return REFUSED


def unexpected(e: BaseException, private: Path, argv: Sequence[str]) -> int:
    """An exception no check foresaw: a full disk or a read-only folder is refused naming the
    folder; anything else is a bug, one line on stderr and the traceback in ``private/error.log``
    (the curator's, mode 0600) or a temporary file (returns INTERNAL)."""
    reason = None
    if isinstance(e, OSError) and e.errno in _NO_SPACE:
        target, reason = Path(e.filename) if e.filename else private, e.strerror or str(e)
    elif isinstance(e, sqlite3.OperationalError) and any(s in str(e) for s in _SQLITE_NO_SPACE):
        target, reason = private, f"SQLite: {e}"
    if reason is not None:
        return refuse(
            f"cannot write to {target if target.is_dir() else target.parent} ({reason}): free "
            "space there or make it writable, or choose another --workdir (a file dptune writes "
            "was left as it was; the same command resumes a run it interrupted, without a second "
            "charge)"
        )
    text = "".join(traceback.format_exception(type(e), e, e.__traceback__))
    try:
        if private.is_dir():
            path = private / "error.log"
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        else:
            fd, name = tempfile.mkstemp(prefix="dptune-error-", suffix=".log")
            path = Path(name)
        with open(fd, "a") as f:
            f.write(text + "\n")
        where = f"the traceback is in {path}"
    except OSError:
        where = "the traceback could not be saved"
    if absl_logging.get_verbosity() >= 1:
        print(text, file=sys.stderr)
    print(f"dptune: error: unexpected {type(e).__name__}: {one_line(e)[:300]} ({where}; a bug in "
          f"dptune or in the trainer). The journal is intact: `{resume_command(argv)}` resumes "
          "once it is fixed", file=sys.stderr)  # fmt: skip
    return INTERNAL


def interrupted(terminated: bool, private: Path, argv: Sequence[str]) -> int:
    """The one line after SIGINT or SIGTERM: what ``private`` holds and the command that resumes."""
    saved = "nothing was trained, saved or charged yet"
    if (private / JOURNAL_FILE).exists():
        saved = (f"saved in {private}: the run's plan, seeds and every finished candidate (a "
                 "candidate in training starts again with its own seed; a resume is not charged "
                 "again)")  # fmt: skip
    print(f"dptune: interrupted ({'SIGTERM' if terminated else 'SIGINT'}); {saved}. Resume with: "
          f"{resume_command(argv)}", file=sys.stderr)  # fmt: skip
    return TERMINATED if terminated else INTERRUPTED


def resume_command(argv: Sequence[str]) -> str:
    return shlex.join(["dptune", *argv[1:]])


def entry(command: Callable[[list[str]], int]) -> None:
    """Runs ``command(sys.argv)`` and exits with its code. A reader that closed the pipe
    (``dptune inspect --help | head``) ends the command quietly: nothing more can be said."""
    try:
        code = command(sys.argv)
        sys.stdout.flush()
    except BrokenPipeError:
        try:  # the interpreter's own flush of stdout at exit must not fail again
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except (OSError, ValueError, AttributeError):
            sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - lives until the process ends
        code = OK
    sys.exit(code)


class _Stderr(logging.StreamHandler):
    """A handler writing to whatever ``sys.stderr`` is at the time (tests capture it)."""

    def emit(self, record: logging.LogRecord) -> None:
        self.stream = sys.stderr
        super().emit(record)


_HANDLER = _Stderr()
_HANDLER.setFormatter(logging.Formatter("dptune: %(message)s"))


def setup_logging() -> None:
    """dptune's messages (and its ``trainers`` package's) on stderr, one ``dptune:`` line each, at
    the level of absl's ``--verbosity`` (-v): INFO by default, -1 warnings only, >= 1 debug; other
    libraries' chatter (orbax, jax) only at ERROR unless ``--verbosity`` >= 1."""
    chosen = "verbosity" in flags.FLAGS and flags.FLAGS["verbosity"].present
    verbosity = absl_logging.get_verbosity() if chosen else 0
    levels = {0: logging.INFO, -1: logging.WARNING}
    level = logging.DEBUG if verbosity >= 1 else levels.get(verbosity, logging.ERROR)
    absl_logging.set_verbosity(absl_logging.DEBUG if verbosity >= 1 else absl_logging.ERROR)
    for logger in (log, logging.getLogger("trainers")):
        if _HANDLER not in logger.handlers:
            logger.addHandler(_HANDLER)
        logger.setLevel(level)
        logger.propagate = False


def help_text(doc: str | None, flag_values: flags.FlagValues, names: Sequence[str] = ()) -> str:
    """A command's ``--help``: its docstring and its flags (``names``, default all of them)."""
    f = flag_values
    lines = [f"  --{n}: {f[n].help} (default: {f[n].default!r})" for n in names or sorted(f)]
    return (doc or "") + "\nFlags:\n" + "\n".join(lines)


def parse_subcommand(flag_values: flags.FlagValues, argv: Sequence[str], doc: str | None) -> Any:
    """A subcommand's ``argv`` parsed into its own ``flag_values``: the arguments that are not
    flags, or None when it asked for (and got) its help. ArgumentError: a flag it does not take
    (the caller unparses its flags, so that the next in-process call starts clean)."""
    if any(a in HELP for a in argv[1:]):
        print(help_text(doc, flag_values))
        return None
    try:
        return flag_values(list(argv))[1:]
    except flags.Error as e:
        raise ArgumentError(str(e)) from None


def parse_run_command(
    flag_values: flags.FlagValues, argv: Sequence[str], workdir_why: str
) -> tuple[Any, Path]:
    """absl's parsing of a command with ``--config`` and ``--workdir`` (both required; in-process
    safe: the config's override flags of an earlier parse are removed first): ``(the config,
    the workdir)``. Raises ArgumentError (a bad flag or argument, a config that does not load, a
    bad override, a missing ``--config`` or ``--workdir``)."""
    argv = normalise_argv(argv)
    for name in [n for n in flag_values if n.startswith("config.")]:
        delattr(flag_values, name)
    flag_values.unparse_flags()
    # ml_collections loads the file as module "config_config" into the entry sys.modules keeps:
    # a second parse in this process must not run a new file in the old file's namespace.
    sys.modules.pop("config_config", None)
    saved, sys.argv = sys.argv, argv  # ml_collections reads the overrides from sys.argv
    try:
        rest = flag_values(argv)[1:]
        config = flag_values["config"].value  # config_flags defers a file's errors to here
    except flags.Error as e:
        raise ArgumentError(_wrong_type(flag_values, argv) or str(e)) from None
    except Exception as e:  # noqa: BLE001 - a bad override, or a config file that fails to load
        # ml_collections raises these for an override of a field the config does not have
        overrides = [a.split("=")[0] for a in argv if a.startswith("--config.")]
        if overrides and isinstance(e, (AttributeError, KeyError)):
            raise ArgumentError(_unknown_field(overrides, e, flag_values)) from None
        if overrides and isinstance(e, (TypeError, ValueError)):
            raise ArgumentError(
                f"a config override names a field the config does not have or gives it a value "
                f"of the wrong type ({type(e).__name__}: {e}); overrides given: {overrides}"
            ) from None
        given = next((a.split("=", 1)[1] for a in argv if a.startswith("--config=")), "?")
        detail = "no such file" if "No such file" in str(e) else one_line(e)
        raise ArgumentError(
            f"--config={given} could not be loaded ({type(e).__name__}: {detail[:300]}): fix the "
            f"file, or use a shipped config ({', '.join(configs.NAMES)})"
        ) from None
    finally:
        sys.argv = saved
    if rest:
        raise ArgumentError(f"unexpected arguments {rest}: every setting is a flag")
    if config is None:
        raise ArgumentError("--config=NAME is required: a shipped config or a file")
    if not flag_values["workdir"].value:
        raise ArgumentError(f"--workdir=DIR is required ({workdir_why})")
    return config, Path(flag_values["workdir"].value)


#: What a config field takes, by its flag's parser (a section's: ml_collections' ConfigDict one).
_TAKES = {"IntegerParser": "must be an integer", "FloatParser": "must be a number", "BooleanParser":
          "must be True or False", "_ConfigDictParser": "is not a value of {name}, a section: set "
          "its fields (--{name}.FIELD=..., a distribution's .low and .high), or write a constant "
          "in a config file"}  # fmt: skip


def _wrong_type(flag_values: flags.FlagValues, argv: Sequence[str]) -> str | None:
    """The refusal of the first ``--config.`` override its field's type refuses, or None."""
    for name, _, value in (a[2:].partition("=") for a in argv if a.startswith("--config.")):
        parser = flag_values[name].parser if name in flag_values else None
        takes = _TAKES.get(type(parser).__name__)
        try:
            if takes is not None:
                parser.parse(value)
        except (TypeError, ValueError):
            return f"--{name}={value} " + takes.format(name=name)
    return None


def _unknown_field(overrides: Sequence[str], e: Exception, flag_values: flags.FlagValues) -> str:
    """The refusal of an override naming a field the config lacks: that override (ml_collections'
    error quotes the missing key first) and what it meant ("Did you mean", a flag, a section)."""
    text = str(e.args[0]) if e.args else str(e)
    missing = re.match(r"\W*'?([\w-]+)", text)
    key = missing.group(1) if missing else None
    named = [o for o in overrides if key in o[len("--config.") :].split(".")] or overrides
    meant = re.search(r'Did you mean "([\w-]+)"', text)
    hint, schema = "", base.get_config().to_dict()
    sections = [s for s, v in schema.items() if isinstance(v, dict) and key in v
                and f"--config.{s}.{key}" not in named]  # fmt: skip
    if meant and key and len(named) == 1:
        parts = named[0].split(".")
        hint = f" (did you mean {'.'.join(parts[: parts.index(key)] + [meant.group(1)])}?)"
    elif named == [f"--config.{key}"] and key in flag_values:
        hint = f" (did you mean the command's flag --{key}?)"
    elif len(named) == 1 and sections:
        hint = f" (did you mean --config.{sections[0]}.{key}?)"
    return (
        f"{', '.join(named)}: the override names a field the config does not have{hint}; the "
        "fields every config has are in dptune/configs/base.py"
    )


def normalise_argv(argv: Sequence[str]) -> list[str]:
    """``--config NAME`` -> ``--config=NAME``, and a shipped config's name -> its file (so the
    command works outside a checkout). Refuses (ArgumentError) a config that is no file, a folder,
    or a name that a local file shadows."""
    args = list(argv) or ["dptune"]
    out, rest = args[:1], iter(args[1:])
    for arg in rest:
        if arg in ("--config", "-config"):
            value = next(rest, None)
            if value is None:
                raise ArgumentError("--config needs a value: --config=NAME or --config=FILE")
            arg = f"--config={value}"
        if arg.startswith(("-config=", "--config=")):
            arg = "--config=" + _resolve_config(arg.split("=", 1)[1])
        out.append(arg)
    # ml_collections reads overrides only after --config: it goes first, wherever it was written
    return out[:1] + sorted(out[1:], key=lambda a: not a.startswith("--config="))


def _resolve_config(value: str) -> str:
    name, sep, rest = value.partition(":")
    path = Path(name).expanduser()
    shipped = ", ".join(configs.NAMES)
    if name in configs.NAMES:
        if path.is_file():
            raise ArgumentError(
                f"--config={name} is ambiguous: {name!r} is a shipped config and a file here; "
                f"write --config=./{name} for the file, or rename it"
            )
        return f"{configs.path_of(name)}{sep}{rest}"
    if path.is_dir():
        raise ArgumentError(
            f"--config={name} is a folder, not a config file: give a .py file or a shipped "
            f"config ({shipped})"
        )
    if not path.is_file():
        close = difflib.get_close_matches(name, configs.NAMES, n=1)
        hint = f" (did you mean --config={close[0]}?)" if close else ""
        raise ArgumentError(
            f"--config={name}: no such config file{hint}; shipped configs: {shipped}"
        )
    return value
