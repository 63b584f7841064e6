"""The shipped config `smoke` (dptune/configs/): the same as `--config=smoke`."""

from dptune.configs.smoke import get_config  # noqa: F401
