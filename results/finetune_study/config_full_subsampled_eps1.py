from dptune import space
from dptune.configs import finetune


def get_config():
    c = finetune.get_config()
    c.privacy.epsilon = 1.0
    c.strategy.update(name="subsampled", fraction=0.25, tuning_epsilon=0.4 * c.privacy.epsilon)
    if c.privacy.epsilon <= 1:
        c.train.score_noise_std = 10.0
    return c
