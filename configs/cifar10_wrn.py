"""The shipped config `cifar10_wrn` (dptune/configs/): the same as `--config=cifar10_wrn`."""

from dptune.configs.cifar10_wrn import get_config  # noqa: F401
