"""MNIST (60k/10k): the Fashion-MNIST settings on MNIST (scatter_linear, Poisson mean 5 over the
learning rate), total (epsilon, delta) = (3, 1e-5). The defaults were measured on the shipped
MNIST-10k digits, which are MNIST records themselves (docs/search_space.md: a caveat for reporting
MNIST results).

dptune --config=mnist --workdir=runs/mnist
dptune --config=mnist --workdir=runs/mnist --config.data.dir=/data/mnist  # IDX files
"""

from dptune.configs import fashion_mnist


def get_config():
    c = fashion_mnist.get_config()
    c.data.name = "mnist"
    return c
