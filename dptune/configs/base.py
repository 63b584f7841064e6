"""Every config field with its default; dataset configs override what differs.

Sections: ``data`` (what to load; docs/privacy-model.md for the split and the public sizes),
``train`` (fixed DP-SGD settings, ``trainers`` ``Hyperparams`` fields), ``space`` (what is searched;
``noise_multiplier="auto"`` calibrates the noise so the TOTAL meets the budget), ``selection``
(a method of ``selection.registry`` and its options), ``strategy`` (``dptune.strategies``: how
candidates use the data), ``privacy`` (the total budget of the run,
tuning included), ``ledger`` (the dataset's budget over all runs) and ``executor``.
"""

from ml_collections import config_dict

from dptune import space
from selection import registry


def get_config() -> config_dict.ConfigDict:
    c = config_dict.ConfigDict()
    # data: tensorflow-datasets by default; a local folder with --config.data.dir=...
    c.data = dict(name="mnist", source="auto", validation_size=5000, split_seed=0)
    c.data.dir = config_dict.placeholder(str)
    # the public number of records in the training file (default: the published size of data.name)
    c.data.num_examples = config_dict.placeholder(int)
    c.data.validation_dir = config_dict.placeholder(str)  # a separate validation set (IDX train-*)
    c.data.validation_public = False  # True only for a separate, public validation set
    # your own arrays (docs/your_model.md): source="npz" reads data.path (keys x_train, y_train,
    # optional x_test, y_test); data.loader="pkg.module:function" returns them (a dict with those
    # keys or a tuple in that order). data.num_examples is then required (public), data.name is
    # a label, data.validation_size the expected validation count, data.num_classes public
    c.data.path = config_dict.placeholder(str)
    c.data.loader = config_dict.placeholder(str)
    c.data.num_classes = config_dict.placeholder(int)
    # the candidate family (dptune.learners.LEARNERS: dpsgd, fisher, public_data); its fixed
    # hyperparameters are config.train, its own options config.learner
    c.trainer = "dpsgd"
    # your own model for dpsgd: "pkg.module:factory", called as factory(num_classes=...) and
    # returning a flax.linen Module (input shape from the data); None: config.train.model
    c.model = config_dict.placeholder(str)
    c.learner = dict(num_public=config_dict.placeholder(int))  # public_data: the public pool
    # dpsgd: per-example clipping, "auto" (default), "ghost" or "vmap" (docs/your_model.md)
    c.learner.grad_impl = config_dict.placeholder(str)
    # dpsgd fine-tuning (docs/finetune.md): which parameters train, a regex searched in their
    # '/'-joined paths ("dense2", "lora_"); None: all (a LoRA model's: its adapters)
    c.learner.trainable = config_dict.placeholder(str)
    # dpsgd: public initial parameters (an .npz of '/'-joined paths, a .msgpack file, an orbax
    # folder or a dptune release); None or '': the model's initialisers
    c.init = config_dict.placeholder(str)
    c.train = dict(
        model="cnn26k", batch_size=256, epochs=10, optimizer="momentum", momentum=0.9,
        score_noise_std=10.0,  # Gaussian noise (in counts) on the number of correct val predictions
    )  # fmt: skip
    c.train.augmult = 0  # augmented copies per example (0: none); privacy-irrelevant
    c.train.ema_decay = config_dict.placeholder(float)  # parameter EMA (post-processing)
    c.train.microbatch_size = config_dict.placeholder(int)  # memory only, never the result
    c.space = dict(learning_rate=space.log_uniform(0.5, 4.0), clip_norm=space.log_uniform(0.1, 2.0))
    c.space.noise_multiplier = "auto"
    c.selection = dict(method="logarithmic")  # the vocabulary of `dptune account` (registry)
    for name, (kind, _) in registry.OPTIONS.items():
        c.selection[name] = config_dict.placeholder(kind)
    c.selection.mean_trials = 8.0
    # how candidates use the data (dptune.strategies): "full" (every candidate on all the data) or
    # "subsampled" (candidates on a per-record Poisson subset of rate `fraction` with the tuning
    # budget `tuning_epsilon`, the selection retrained once on all the data; docs/tuning.md)
    c.strategy = dict(name="full")
    c.strategy.fraction = config_dict.placeholder(float)
    c.strategy.tuning_epsilon = config_dict.placeholder(float)
    c.privacy = dict(epsilon=3.0, delta=1e-5, accountant="auto")
    c.privacy.adjacency = "add_remove"  # or "replace_one" (fixed, public dataset size)
    c.ledger = dict(enabled=True)
    c.ledger.path = config_dict.placeholder(str)  # default $DPTUNE_LEDGER, ~/.dptune/ledger.sqlite
    # the dataset's lifetime budget; default (a dataset new to the ledger): 10 runs like this one
    c.ledger.budget_epsilon = config_dict.placeholder(float)
    c.ledger.budget_delta = config_dict.placeholder(float)
    # how candidates are trained (dptune.executors): "sequential" (default on CPU), "vectorized"
    # (group_size candidates at once with jax.vmap, where it pays: accelerators), "devices" (one
    # candidate per local device) or "ray" (one Ray task per candidate; docs/scale-out.md)
    c.executor = dict(kind="sequential", group_size=1)
    # "ray" only: None = a local ray.init(); "auto" = this node's cluster; "HOST:PORT" = its head
    c.executor.address = config_dict.placeholder(str)
    c.executor.cpus_per_candidate = 1.0
    c.executor.gpus_per_candidate = 0.0
    c.executor.max_retries = 3  # reruns of a candidate whose Ray worker died (same seed)
    # "devices" only: how many of jax.local_devices() to use (None: all of them), and whether to
    # train ONE candidate at a time over all of them (data-parallel DP-SGD, trainers.parallel)
    # instead of one candidate per device
    c.executor.devices = config_dict.placeholder(int)
    c.executor.data_parallel = False
    return c
