from dptune import space
from dptune.configs import finetune


def get_config():
    c = finetune.get_config()
    c.privacy.epsilon = 3.0
    c.init = ""
    c.train.update(optimizer="momentum", momentum=0.9, batch_size=512, epochs=4)
    c.space = dict(learning_rate=space.log_uniform(0.5, 4.0), clip_norm=space.log_uniform(0.1, 2.0), noise_multiplier='auto')
    c.selection.update(method="logarithmic", mean_trials=3.0)
    return c
