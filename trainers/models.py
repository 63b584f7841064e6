"""Flax (linen) models: the tanh CNNs of Papernot et al. 2021 / Tramer & Boneh 2021.

Max-pools are written as the maximum of shifted slices rather than ``nn.max_pool``: on XLA CPU the
gradient of a
``reduce_window`` max lowers to select-and-scatter, which dominated the step time
(``../shared/notes/cpu-dpsgd-performance.md``); the slice form has an elementwise gradient. The
forward values are
identical; on exact ties the gradient is split instead of going to the first maximum (ties have
measure zero after
tanh).
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp

MODEL_NAMES = ("cnn26k", "cnn52k", "cifar_cnn")


def max_pool_2x2_stride1(x: jax.Array) -> jax.Array:
    """2x2 max-pool, stride 1, VALID, on NHWC: (b, h, w, c) -> (b, h-1, w-1, c)."""
    return jnp.maximum(
        jnp.maximum(x[:, :-1, :-1], x[:, 1:, :-1]), jnp.maximum(x[:, :-1, 1:], x[:, 1:, 1:])
    )


def max_pool_2x2_stride2(x: jax.Array) -> jax.Array:
    """2x2 max-pool, stride 2, VALID, on NHWC with even h, w: (b, h, w, c) -> (b, h/2, w/2, c)."""
    return jnp.maximum(
        jnp.maximum(x[:, 0::2, 0::2], x[:, 1::2, 0::2]),
        jnp.maximum(x[:, 0::2, 1::2], x[:, 1::2, 1::2]),
    )


class MnistCNN(nn.Module):
    """tanh CNN for 28x28x1 images: conv c1@8x8/2 SAME, pool 2x2/1, conv c2@4x4/2 VALID, pool 2x2/1,
    dense d, dense 10.

    With (c1, c2, d) = (16, 32, 32) this is the 26,010-parameter network of Papernot et al. 2021
    ("Tempered
    sigmoid activations for deep learning with differential privacy", Table 2) and Tramer & Boneh
    2021.
    Input: float32 (b, 28, 28, 1); output: logits (b, num_classes).
    """

    conv1_features: int = 16
    conv2_features: int = 32
    dense_features: int = 32
    num_classes: int = 10

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        x = nn.Conv(self.conv1_features, (8, 8), strides=(2, 2), padding="SAME", name="conv1")(x)
        x = max_pool_2x2_stride1(jnp.tanh(x))
        x = nn.Conv(self.conv2_features, (4, 4), strides=(2, 2), padding="VALID", name="conv2")(x)
        x = max_pool_2x2_stride1(jnp.tanh(x))
        x = x.reshape((x.shape[0], -1))
        x = jnp.tanh(nn.Dense(self.dense_features, name="dense1")(x))
        return nn.Dense(self.num_classes, name="dense2")(x)


class CifarCNN(nn.Module):
    """End-to-end tanh CNN for CIFAR-10 of Papernot et al. 2021 (Table 3), 550,570 parameters.

    conv 32,32 / pool / conv 64,64 / pool / conv 128,128 / pool (all 3x3 SAME, pools 2x2/2), dense
    128, dense 10.
    Input: float32 (b, 32, 32, 3); output: logits (b, num_classes).
    """

    num_classes: int = 10

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        for i, feats in enumerate((32, 64, 128)):
            x = jnp.tanh(nn.Conv(feats, (3, 3), padding="SAME", name=f"conv{2 * i + 1}")(x))
            x = jnp.tanh(nn.Conv(feats, (3, 3), padding="SAME", name=f"conv{2 * i + 2}")(x))
            x = max_pool_2x2_stride2(x)
        x = x.reshape((x.shape[0], -1))
        x = jnp.tanh(nn.Dense(128, name="dense1")(x))
        return nn.Dense(self.num_classes, name="dense2")(x)


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """A model and the input shape it expects, (height, width, channels)."""

    name: str
    module: nn.Module
    input_shape: tuple[int, int, int]


def get_model(name: str, num_classes: int = 10) -> ModelSpec:
    """Returns the model called ``name`` ("cnn26k", "cnn52k" or "cifar_cnn").

    "cnn52k" widens the 26k CNN to conv 32 / conv 48 / dense 32 (51,642 parameters): the
    ~52k-parameter comparison of
    the DP feature-selection paper's appendix A.1, whose exact widths are not published.
    """
    if name == "cnn26k":
        return ModelSpec(name, MnistCNN(16, 32, 32, num_classes), (28, 28, 1))
    if name == "cnn52k":
        return ModelSpec(name, MnistCNN(32, 48, 32, num_classes), (28, 28, 1))
    if name == "cifar_cnn":
        return ModelSpec(name, CifarCNN(num_classes), (32, 32, 3))
    raise ValueError(f"unknown model {name!r}; expected one of {MODEL_NAMES}")


def init_params(spec: ModelSpec, key: jax.Array) -> dict:
    """Initial parameters of ``spec`` (flax default initialisers) from a PRNG key."""
    return spec.module.init(key, jnp.zeros((1, *spec.input_shape), jnp.float32))["params"]


def param_count(params) -> int:
    """Total number of scalar parameters in a pytree."""
    return sum(int(p.size) for p in jax.tree_util.tree_leaves(params))
