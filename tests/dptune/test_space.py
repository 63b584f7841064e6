"""Search space: distributions, sampler, privacy-relevant fields and their worst-case grid."""

import math

import numpy as np
import pytest

from dptune import space
from dptune.space import Choice, Integer, LogUniform, Space, SpaceError, Uniform


def test_sampler_stays_in_support_and_is_reproducible():
    s = Space(
        dict(
            learning_rate=space.log_uniform(0.01, 10.0),
            clip_norm=space.uniform(0.5, 2.0),
            optimizer=space.choice("sgd", "adam"),
            width=space.integer(2, 4),
            batch_size=256,
        )
    )
    draws = [s.sample(np.random.default_rng(7)) for _ in range(2)]
    assert draws[0] == draws[1]
    rng = np.random.default_rng(0)
    many = [s.sample(rng) for _ in range(2000)]
    lr = np.array([d["learning_rate"] for d in many])
    assert lr.min() >= 0.01 and lr.max() <= 10.0
    # log-uniform: log10(lr) uniform on [-2, 1], so about 1/3 of the draws lie below 0.1
    assert abs(np.mean(lr < 0.1) - 1 / 3) < 0.04
    assert {d["width"] for d in many} == {2, 3, 4}
    assert {d["optimizer"] for d in many} == {"sgd", "adam"}
    assert all(d["batch_size"] == 256 for d in many)
    assert s.searched == ("clip_norm", "learning_rate", "optimizer", "width")


DPSGD = {"noise_multiplier", "batch_size", "epochs", "score_noise_std"}


def test_privacy_fields_and_grid():
    s = Space(
        dict(
            learning_rate=space.log_uniform(0.1, 1.0),
            batch_size=space.choice(128, 256),
            epochs=space.integer(1, 3),
            my_noise=space.choice(1.0, 2.0, privacy=True),
        ),
        privacy_fields=DPSGD,  # the fields a trainer names (here: DP-SGD's)
    )
    assert set(s.privacy_relevant) == {"batch_size", "epochs", "my_noise"}
    grid = s.privacy_grid()
    assert len(grid) == 2 * 3 * 2
    assert {"batch_size": 256, "epochs": 3, "my_noise": 1.0} in grid
    assert Space(dict(lr=0.1)).privacy_grid() == [{}]


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(noise_multiplier=space.uniform(0.5, 1.0)), "worst case"),
        (dict(epochs=space.log_uniform(1, 5)), "worst case"),
        (dict(lr=space.log_uniform(0.0, 1.0)), "low > 0"),
        (dict(lr=space.uniform(2.0, 1.0)), "low <= high"),
        (dict(lr=space.uniform(0.0, math.inf)), "finite"),
        (dict(lr={"distribution": "normal", "low": 0, "high": 1}), "unknown distribution"),
        (dict(lr=space.choice()), "at least one value"),
        (dict(lr=[0.1, 0.2]), "ambiguous"),
        (dict(lr={"distribution": "uniform", "low": 0.1}), "'low' and 'high'"),
        (dict(w=space.integer(1.5, 3)), "integer bounds"),
        (dict(lr={"distribution": "uniform", "low": 0, "high": 1, "step": 2}), "unknown keys"),
    ],
)
def test_malformed_spaces_are_refused(fields, message):
    with pytest.raises(SpaceError, match=message):
        Space(fields, privacy_fields=DPSGD)


def test_grid_size_is_bounded():
    s = Space(
        dict(epochs=space.integer(1, 100), batch_size=space.integer(1, 100)), privacy_fields=DPSGD
    )
    with pytest.raises(SpaceError, match="combinations"):
        s.privacy_grid()


def test_to_dict_roundtrip():
    s = Space(dict(a=space.log_uniform(0.1, 1.0), b=space.choice(1, 2, privacy=True), c="x"))
    again = Space(s.to_dict())
    assert again.to_dict() == s.to_dict()
    assert isinstance(again.fields["a"], LogUniform) and isinstance(again.fields["b"], Choice)
    assert again.fields["b"].privacy
    assert isinstance(Space(dict(u=space.uniform(0, 1))).fields["u"], Uniform)
    assert isinstance(Space(dict(i=space.integer(0, 1))).fields["i"], Integer)
