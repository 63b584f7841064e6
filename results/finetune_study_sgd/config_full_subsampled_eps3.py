from dptune import space
from dptune.configs import finetune


def get_config():
    c = finetune.get_config()
    c.privacy.epsilon = 3.0
    c.strategy.update(name="subsampled", fraction=0.25, tuning_epsilon=0.4 * c.privacy.epsilon)
    return c
