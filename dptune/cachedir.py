"""dptune's cache folder on the user's machine, for what makes a second run start warm: JAX's
compiled steps (``jax/``, ``dptune.learners.dpsgd.use_compilation_cache``), remembered noise
calibrations (``calibration.json``, ``dptune.accounting.calibration.FileMemo``) and the step PLDs
the command's sidecar rebuilds ahead (``sidecar/``, requests only: ``dptune.sidecar``).

``$DPTUNE_CACHE`` moves the folder (the scattering features of ``trainers.scatter`` live there
too); ``$DPTUNE_COMPILATION_CACHE=off`` (``dptune --compilation_cache=off``) turns warm starts off.
Nothing in it is private: compiled programs and public functions of public inputs.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

#: Environment variable: the folder of JAX's compilation cache, or "off" (no warm starts).
COMPILATION_CACHE_ENV = "DPTUNE_COMPILATION_CACHE"
OFF_WORDS = ("off", "false", "no", "none", "0")


def cache_root() -> Path:
    """``$DPTUNE_CACHE``, else the platform's user cache folder + ``dptune``
    (``$XDG_CACHE_HOME`` or ``~/.cache``; ``~/Library/Caches`` on macOS; ``%LOCALAPPDATA%`` on
    Windows)."""
    if os.environ.get("DPTUNE_CACHE"):
        return Path(os.environ["DPTUNE_CACHE"])
    if sys.platform == "darwin":
        base = Path.home() / "Library" / "Caches"
    elif os.name == "nt" and os.environ.get("LOCALAPPDATA"):
        base = Path(os.environ["LOCALAPPDATA"])
    else:
        base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "dptune"


def warm_starts_off() -> bool:
    """Whether the user turned warm starts off (``$DPTUNE_COMPILATION_CACHE=off``)."""
    return os.environ.get(COMPILATION_CACHE_ENV, "").strip().lower() in OFF_WORDS


def calibration_memo():
    """The remembered calibrations (``cache_root()/calibration.json``), or None when warm starts
    are off."""
    from dptune.accounting.calibration import FileMemo  # heavy (dp_accounting): only when used

    return None if warm_starts_off() else FileMemo(cache_root() / "calibration.json")
