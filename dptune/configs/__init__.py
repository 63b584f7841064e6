"""Configs shipped with dptune (``dptune --config=NAME``, or a path to your own file).

``base.get_config()`` holds every field with its default; each dataset config overrides what
differs, as Flax's example configs do. Your own config file can start from any of them::

    from dptune.configs import fashion_mnist

    def get_config():
        c = fashion_mnist.get_config()
        c.privacy.epsilon = 1.0
        return c
"""

from pathlib import Path

#: Folder of the shipped config files.
CONFIG_DIR = Path(__file__).resolve().parent

#: Names accepted by ``dptune --config=NAME``: every config file of this folder (``base`` holds the
#: defaults and is not a run of its own). Adding a file adds a name.
NAMES = tuple(sorted(p.stem for p in CONFIG_DIR.glob("*.py") if p.stem not in ("__init__", "base")))


def path_of(name: str) -> Path:
    """The file of the shipped config ``name``, one of :data:`NAMES` (``dptune --config`` refuses
    any other)."""
    return CONFIG_DIR / f"{name}.py"
