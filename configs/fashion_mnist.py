"""The shipped config `fashion_mnist` (dptune/configs/): the same as `--config=fashion_mnist`."""

from dptune.configs.fashion_mnist import get_config  # noqa: F401
