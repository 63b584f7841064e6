"""An NNX model starts from the module's own values (``NnxModel.init`` ignores the candidate's
key), which may be pretrained weights the user loaded into it: the statement must then name the
start and the assumption that it is public (``public-init``), as it does for ``init=``."""

import numpy as np
import pytest
from flax import nnx

import dptune
from selection import BestOfK


class _Classifier(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.body = nnx.LoRALinear(8, 16, lora_rank=2, rngs=rngs)
        self.head = nnx.Linear(16, 3, rngs=rngs)

    def __call__(self, x):
        return self.head(nnx.tanh(self.body(x)))


@pytest.mark.parametrize("wrapped", [False, True])
def test_an_nnx_models_own_start_is_named_and_assumed_public(wrapped):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(400, 8)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int32)
    data = dptune.Dataset.from_arrays(
        x, y, num_examples=400, num_classes=3, validation_fraction=0.5
    )
    module = _Classifier(nnx.Rngs(1))  # stands in for a module whose base was loaded pretrained
    kw = (
        dict(model=dptune.NnxModel(module, trainable=nnx.LoRAParam))
        if wrapped
        else dict(model=module, trainable=nnx.LoRAParam)
    )
    trainer = dptune.DpSgdTrainer(data, dict(batch_size=64, epochs=1), **kw)
    space = {"learning_rate": dptune.space.log_uniform(0.1, 1.0), "noise_multiplier": "auto"}
    _, st = dptune.plan_privacy(trainer, space, BestOfK(2), (4.0, 1e-5))
    assert "public-init" in st.assumptions
    assert any("fingerprint sha256:" in n for n in st.notes)
