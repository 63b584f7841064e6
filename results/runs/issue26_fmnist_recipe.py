"""Issue 26's untuned reference: `--config=fashion_mnist` with the search replaced by Tramer &
Boneh 2021's own setting (learning rate 16 at C = 0.1, batch 8192, 40 epochs, momentum 0.9), one
run (best of k = 1) at total (3, 1e-5); the noise multiplier is calibrated by dptune for one run,
not the paper's 4.05 (docs/results.md, "Issue 26")."""

from dptune import space
from dptune.configs import fashion_mnist


def get_config():
    c = fashion_mnist.get_config()
    del c.space.learning_rate  # a distribution in the config: replaced, not updated
    c.space.learning_rate = space.choice(16.0)  # the paper's (a one-value choice: one candidate)
    c.selection.method = "best_of_k"
    c.selection.k = 1
    return c
