from dptune import space
from dptune.configs import finetune


def get_config():
    c = finetune.get_config()
    c.privacy.epsilon = 1.0
    c.learner.trainable = "dense2"
    return c
