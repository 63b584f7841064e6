"""The shipped config `user` (dptune/configs/): the same as `--config=user`."""

from dptune.configs.user import get_config  # noqa: F401
