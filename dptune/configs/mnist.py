"""MNIST (60k/10k): the Fashion-MNIST settings on MNIST, total (epsilon, delta) = (3, 1e-5).

dptune --config=mnist --workdir=runs/mnist
dptune --config=mnist --workdir=runs/mnist --config.data.dir=/data/mnist  # IDX files
"""

from dptune.configs import fashion_mnist


def get_config():
    c = fashion_mnist.get_config()
    c.data.name = "mnist"
    return c
