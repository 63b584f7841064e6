"""The shipped config `mnist` (dptune/configs/): the same as `--config=mnist`."""

from dptune.configs.mnist import get_config  # noqa: F401
