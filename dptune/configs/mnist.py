"""MNIST (60k/10k): the Fashion-MNIST settings on MNIST (scatter_linear, batch 8192, 40 epochs,
C 0.1, logarithmic random stopping of mean 3 over the learning rate 2-32), total (epsilon, delta) =
(3, 1e-5). The recipe is Tramer & Boneh 2021's for Fashion-MNIST, applied unchanged; the proxy
study that placed the learning-rate range ran on the shipped MNIST-10k digits, which are MNIST
records themselves (docs/search_space.md: a caveat for reporting MNIST results).

dptune --config=mnist --workdir=runs/mnist
dptune --config=mnist --workdir=runs/mnist --config.data.dir=/data/mnist  # IDX files
"""

from dptune.configs import fashion_mnist


def get_config():
    c = fashion_mnist.get_config()
    c.data.name = "mnist"
    return c
