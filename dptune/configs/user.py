"""Your own model on your own arrays (docs/your_model.md): DP-SGD with random stopping over the
learning rate and the clipping norm, noise calibrated to the total budget. Name the data and the
model on the command line:

    dptune --config=user --workdir=runs/mine --config.model=mypkg.models:make_mlp \\
        --config.data.source=npz --config.data.path=data.npz --config.data.num_examples=50000

``config.model``: ``pkg.module:factory``, called as ``factory(num_classes=...)`` and returning a
flax.linen Module. ``config.data.path``: an ``.npz`` file with ``x_train``, ``y_train`` and
optionally ``x_test``, ``y_test`` (or ``config.data.loader=pkg.module:function`` returning them).
``config.data.num_examples`` is the PUBLIC number of records (required).
"""

from dptune.configs import base


def get_config():
    c = base.get_config()
    c.data.update(name="user", source="npz", validation_size=1000, split_seed=0)
    c.train.update(batch_size=256, epochs=10, optimizer="momentum", score_noise_std=10.0)
    c.space.learning_rate.update(low=0.05, high=2.0)
    c.space.clip_norm.update(low=0.1, high=2.0)
    c.selection.update(method="logarithmic", mean_trials=4.0)
    c.privacy.epsilon = 3.0
    return c
