"""What every ``dptune`` command line shares: logging (absl's ``--verbosity``), shipped config
names, one-line refusals of bad flags. Defines no flag (each command's module defines its own)."""

from __future__ import annotations

import difflib
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

from absl import flags
from absl import logging as absl_logging

from dptune import configs
from dptune.cli import exits

log = logging.getLogger("dptune")


class ArgumentError(ValueError):
    """A command line that cannot name a config (a folder, a missing file, an ambiguous name)."""


class _Stderr(logging.StreamHandler):
    """A handler writing to whatever ``sys.stderr`` is at the time (tests capture it)."""

    def emit(self, record: logging.LogRecord) -> None:
        self.stream = sys.stderr
        super().emit(record)


_HANDLER = _Stderr()
_HANDLER.setFormatter(logging.Formatter("dptune: %(message)s"))


#: Arguments that print a subcommand's help (``dptune inspect --help``) instead of running it.
SUBCOMMAND_HELP = ("-h", "--help", "-help", "--helpfull")


def parse_subcommand(
    flag_values: flags.FlagValues, argv: Sequence[str], doc: str
) -> tuple[list[str], int | None]:
    """A subcommand's ``argv`` parsed into its own ``flag_values``: ``(the arguments that are not
    flags, None)``, or ``([], exit code)`` when the command has ended: its help printed (``doc``,
    exit 0) or a flag refused in one ``dptune:`` line (exit 2; the flags are left unparsed, so
    the next in-process call starts clean)."""
    if any(a in SUBCOMMAND_HELP for a in argv[1:]):
        print(doc)
        return [], exits.OK
    try:
        return flag_values(list(argv))[1:], None
    except flags.Error as e:
        flag_values.unparse_flags()
        return [], exits.refuse(e)


def setup_logging() -> None:
    """dptune's messages (and its ``trainers`` package's) on stderr, one ``dptune:`` line each, at
    the level of absl's ``--verbosity`` (-v): INFO by default, -1 warnings only, >= 1 debug; other
    libraries' chatter (orbax, jax) only at ERROR unless ``--verbosity`` >= 1."""
    fv = flags.FLAGS
    chosen = fv["verbosity"].present if "verbosity" in fv else False
    verbosity = absl_logging.get_verbosity() if chosen else 0
    level = (
        logging.DEBUG
        if verbosity >= 1
        else logging.INFO
        if verbosity == 0
        else logging.WARNING
        if verbosity == -1
        else logging.ERROR
    )
    absl_logging.set_verbosity(absl_logging.DEBUG if verbosity >= 1 else absl_logging.ERROR)
    # dptune's own messages and those of its trainers package (a size far from the declared one,
    # a model that falls back to the generic clipping path, scattering progress) print alike.
    for logger in (log, logging.getLogger("trainers")):
        if _HANDLER not in logger.handlers:
            logger.addHandler(_HANDLER)
        logger.setLevel(level)
        logger.propagate = False


def normalise_argv(argv: Sequence[str]) -> list[str]:
    """``--config NAME`` -> ``--config=NAME``, and a shipped config's name -> its file (so the
    command works outside a checkout). Refuses (ArgumentError) a config that is no file, a folder,
    or a name that a local file shadows."""
    out: list[str] = [argv[0]] if argv else ["dptune"]
    args = list(argv[1:])
    i = 0
    while i < len(args):
        arg = args[i]
        if arg in ("--config", "-config"):
            if i + 1 >= len(args):
                raise ArgumentError("--config needs a value: --config=NAME or --config=FILE")
            arg = f"--config={args[i + 1]}"
            i += 1
        if arg.startswith("-config="):
            arg = "-" + arg
        if arg.startswith("--config="):
            arg = "--config=" + _resolve_config(arg[len("--config=") :])
        out.append(arg)
        i += 1
    return out


def _resolve_config(value: str) -> str:
    """A shipped config's name -> its file; a path is checked (a file) and kept."""
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


def resolve_config_names(argv: list[str]) -> list[str]:
    """:func:`normalise_argv`, a refusal printed as one line with exit code 2 (for commands that
    parse with ``absl.app.run``)."""
    try:
        return normalise_argv(argv)
    except ArgumentError as e:
        print(f"dptune: refused: {e}", file=sys.stderr)
        sys.exit(2)


def parse_flags(argv: list[str]) -> list[str]:
    """absl's parsing, with every bad flag or config override reported in one line (exit 2)."""
    try:
        return flags.FLAGS(argv)
    except flags.Error as e:
        print(f"dptune: refused: {e}", file=sys.stderr)
        sys.exit(2)
    except (AttributeError, KeyError, TypeError, ValueError) as e:
        # ml_collections raises these for an override of a field the config does not have
        overrides = [a.split("=")[0] for a in argv if a.startswith("--config.")]
        print(
            f"dptune: refused: a config override names a field the config does not have or "
            f"gives it a value of the wrong type ({type(e).__name__}: {e}); overrides given: "
            f"{overrides}",
            file=sys.stderr,
        )
        sys.exit(2)
