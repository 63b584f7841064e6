"""The shipped config `finetune` (dptune/configs/): the same as `--config=finetune`."""

from dptune.configs.finetune import get_config  # noqa: F401
