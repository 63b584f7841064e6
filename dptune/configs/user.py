"""Your own model on your own arrays (docs/your_model.md): DP-SGD with random stopping over the
learning rate and the clipping norm, noise calibrated to the total budget. Name the data and the
model on the command line (``config.model`` and ``config.data`` as ``base`` describes them):

    dptune --config=user --workdir=runs/mine --config.model=mypkg.models:make_mlp \\
        --config.data.source=npz --config.data.path=data.npz --config.data.num_examples=50000

``config.data.num_examples`` is the PUBLIC number of records (required); the validation size,
batch size, epochs, learning-rate range and mean number of candidates follow from it and the
optimiser unless given (docs/your_model.md, "Defaults that fit the model").
"""

from ml_collections import config_dict

from dptune.configs import base


def get_config():
    c = base.get_config()
    c.data.update(name="user", source="npz", split_seed=0)
    c.train.update(optimizer="momentum", score_noise_std=10.0)
    # Narrow on purpose: at a fixed lr * C the clip norm hardly mattered on the public tasks of
    # scripts/tuning_landscape.py, so a wide C range only spreads the step (docs/your_model.md).
    c.space.clip_norm.update(low=0.5, high=2.0)
    c.privacy.epsilon = 3.0
    # Left unset on purpose: derived from the declared public size config.data.num_examples and
    # the optimiser when the run starts (dptune.learners.dpsgd.suggested_settings; the table in
    # docs/your_model.md). Setting any of them on the command line keeps your value.
    c.data.validation_size = config_dict.placeholder(int)
    c.train.batch_size = config_dict.placeholder(int)
    c.train.epochs = config_dict.placeholder(int)
    c.space.learning_rate.low = config_dict.placeholder(float)
    c.space.learning_rate.high = config_dict.placeholder(float)
    # Geometric rather than logarithmic: at the same mean it trains a single candidate a quarter of
    # the time instead of 39 %, for about 3 % more noise (docs/privacy_utility.md).
    c.selection.method = "geometric"
    c.selection.mean_trials = config_dict.placeholder(float)
    return c
