"""A model of your own for pympgu: a residual MLP with ReLU blocks.

    python -m pympgu.train --model examples/residual_mlp.py:ResidualMLP --hidden 1024 1024 1024

The first --hidden width is the blocks' width; each further entry adds a block
h <- h + relu(h W + b). docs/MODELS.md describes what a model defines.
"""
import numpy as np

from pympgu.models import Model  # first: it sets PyTensor's floatX to float32


class ResidualMLP(Model):
    def __init__(self, n_in, hidden, n_out, seed=1234):
        super().__init__()
        width = hidden[0]
        if any(h != width for h in hidden):
            raise ValueError(f"the blocks share one width: give --hidden {width} "
                             f"{' '.join([str(width)] * (len(hidden) - 1))}, not {hidden}")
        # Every worker builds the model: draw every value from the seed, so that the
        # replicas start identical (pympgu refuses them otherwise).
        rng = np.random.default_rng(seed)

        def he(a, b):
            return rng.normal(0.0, np.sqrt(2.0 / a), (a, b))

        self.w_in = self.parameter(he(n_in, width), "W_in")
        self.b_in = self.parameter(np.zeros(width), "b_in", penalized=False)
        self.blocks = [(self.parameter(he(width, width) * 0.5, f"W_block{k}"),
                        self.parameter(np.zeros(width), f"b_block{k}", penalized=False))
                       for k in range(len(hidden) - 1)]
        self.w_out = self.parameter(np.zeros((width, n_out)), "W_out")
        self.b_out = self.parameter(np.zeros(n_out), "b_out", penalized=False)

    def logits(self, x):
        import pytensor.tensor as pt
        h = pt.maximum(pt.dot(x, self.w_in) + self.b_in, 0)
        for w, b in self.blocks:
            # --dropout drops within each block's branch; the identity path keeps every unit.
            h = h + self.dropout(pt.maximum(pt.dot(h, w) + b, 0))
        return pt.dot(h, self.w_out) + self.b_out
