from dptune import space
from dptune.configs import finetune


def get_config():
    c = finetune.get_config()
    c.privacy.epsilon = 3.0
    return c
