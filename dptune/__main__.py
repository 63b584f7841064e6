"""``python -m dptune``: the same command as ``dptune``."""

from dptune.cli import run

if __name__ == "__main__":
    run()
