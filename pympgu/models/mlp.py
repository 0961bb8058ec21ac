"""The 2014 demo's model: a multilayer perceptron."""
import numpy as np

from .model import Model


class MLP(Model):
    """A multilayer perceptron: tanh hidden layers, softmax output.

    Hidden weights start uniform in +-sqrt(6 / (n_in + n_out)), the output layer at zero,
    from numpy's RandomState(seed): every replica starts identical, as in the seed.
    """

    def __init__(self, n_in, hidden, n_out, seed=1234):
        super().__init__()
        rng = np.random.RandomState(seed)
        sizes = [n_in, *hidden, n_out]
        for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
            if i == len(sizes) - 2:
                w = np.zeros((a, b), np.float32)
            else:
                bound = np.sqrt(6.0 / (a + b))
                w = rng.uniform(-bound, bound, (a, b)).astype(np.float32)
            self.parameter(w, f"W{i}")
            self.parameter(np.zeros(b, np.float32), f"b{i}", penalized=False)
        self.sizes = sizes

    def describe(self):
        return f"MLP {'-'.join(map(str, self.sizes))}"

    def logits(self, x):
        import pytensor.tensor as pt
        h = x
        for i in range(0, len(self.params) - 2, 2):
            h = self.dropout(pt.tanh(pt.dot(h, self.params[i]) + self.params[i + 1]))
        return pt.dot(h, self.params[-2]) + self.params[-1]
