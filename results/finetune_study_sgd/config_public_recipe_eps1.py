from dptune import space
from dptune.configs import finetune


def get_config():
    c = finetune.get_config()
    c.privacy.epsilon = 1.0
    c.space = dict(learning_rate=space.choice(0.1), clip_norm=1.0, noise_multiplier='auto')
    c.selection.update(method="best_of_k", k=1)
    return c
