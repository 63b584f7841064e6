"""What every ``dptune`` command line shares: logging, shipped config names, one-line refusals of
bad flags. Defines no flag (each command's module defines its own)."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

from absl import flags
from absl import logging as absl_logging

from dptune import configs

log = logging.getLogger("dptune")


def setup_logging() -> None:
    """dptune's own messages at INFO on stderr; library chatter (orbax, dp_accounting's
    convergence warnings during calibration) only at ERROR."""
    absl_logging.set_verbosity(absl_logging.ERROR)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("dptune: %(message)s"))
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False


def resolve_config_names(argv: list[str]) -> list[str]:
    """``--config=NAME`` (a shipped config, ``dptune.configs.NAMES``) -> its file, so
    the command works outside a checkout; paths are left alone."""
    out = []
    for arg in argv:
        if arg.startswith("--config="):
            value = arg[len("--config=") :]
            name, sep, rest = value.partition(":")
            if name in configs.NAMES and not Path(name).exists():
                arg = f"--config={configs.path_of(name)}{sep}{rest}"
        out.append(arg)
    return out


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
