"""The shipped config `cifar10` (dptune/configs/): the same as `--config=cifar10`."""

from dptune.configs.cifar10 import get_config  # noqa: F401
