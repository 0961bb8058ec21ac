"""A convnet for pympgu: LeNet-5 as in the Theano tutorial of the seed's days.

    python -m pympgu.train --gpus 0 1 --model examples/lenet.py:LeNet --data-dir fashion
    python -m pympgu.train --cpu 2 --model examples/lenet.py:LeNet   # no GPU: CPU JAX

Two layers of 5x5 filters, each followed by 2x2 max pooling and tanh, then a tanh layer and
the softmax (deeplearning.net's "Convolutional Neural Networks (LeNet)": 20 and 50 filters,
500 units). ``--hidden F1 F2 H`` sets the filters and the units; a single ``--hidden H`` (the
default, 500) the units alone. Images are square, of 1 channel (784 inputs: 28x28) or 3
(3 x side x side, channels first). pympgu.nnet's conv2d runs on CPU workers and on GPUs.
"""
import numpy as np

from pympgu.models import Model  # first: it sets PyTensor's floatX to float32
from pympgu.nnet import square_images


def layout(hidden):
    """(the two layers' filters, the units) that --hidden gives."""
    if len(hidden) == 1:
        return (20, 50), hidden[0]
    if len(hidden) == 3:
        return tuple(hidden[:2]), hidden[2]
    raise ValueError(f"give --hidden H (units) or F1 F2 H (filters and units), not {hidden}")


class LeNet(Model):
    def __init__(self, n_in, hidden, n_out, seed=1234):
        super().__init__()
        filters, units = layout(hidden)
        self.channels, self.side = square_images(n_in, "LeNet")
        side = self.side
        for _ in filters:  # each layer: a valid 5x5 convolution, then 2x2 pooling
            side = (side - 4) // 2
        if side < 1:
            raise ValueError(f"{self.side}x{self.side} images are too small for two 5x5 "
                             "convolutions and 2x2 poolings")
        # Every worker builds the model: draw every value from the seed, so that the
        # replicas start identical (pympgu refuses them otherwise).
        rng = np.random.default_rng(seed)

        def uniform(fan_in, fan_out, shape):  # Glorot's, as the tutorial draws them
            bound = np.sqrt(6.0 / (fan_in + fan_out))
            return rng.uniform(-bound, bound, shape)

        self.convs = []
        c = self.channels
        for k, f in enumerate(filters):
            w = self.parameter(uniform(c * 25, f * 25 / 4, (f, c, 5, 5)), f"W_conv{k}")
            b = self.parameter(np.zeros(f), f"b_conv{k}", penalized=False)
            self.convs.append((w, b))
            c = f
        flat = c * side * side
        self.w_hidden = self.parameter(uniform(flat, units, (flat, units)), "W_hidden")
        self.b_hidden = self.parameter(np.zeros(units), "b_hidden", penalized=False)
        self.w_out = self.parameter(np.zeros((units, n_out)), "W_out")
        self.b_out = self.parameter(np.zeros(n_out), "b_out", penalized=False)
        self.flat = flat

    def describe(self):
        filters = "-".join(str(w.get_value(borrow=True).shape[0]) for w, _ in self.convs)
        return (f"LeNet {self.channels}x{self.side}x{self.side}, filters {filters}, "
                f"{self.w_hidden.get_value(borrow=True).shape[1]} units ({self.parameter_count:,} "
                "parameters)")

    def logits(self, x):
        import pytensor.tensor as pt

        from pympgu.nnet import conv2d, max_pool_2d
        # Reshapes to static sizes: under JAX (GPUs) every size must be known when the step
        # is traced, the batch too (x's is).
        batch = x.type.shape[0] if x.type.shape[0] is not None else x.shape[0]
        h = x.reshape((batch, self.channels, self.side, self.side))
        for w, b in self.convs:
            h = pt.tanh(max_pool_2d(conv2d(h, w), 2) + b.dimshuffle("x", 0, "x", "x"))
        h = pt.tanh(pt.dot(h.reshape((batch, self.flat)), self.w_hidden) + self.b_hidden)
        return pt.dot(self.dropout(h), self.w_out) + self.b_out  # --dropout's layer

    @staticmethod
    def torch_twin(n_in, hidden, n_out):
        """The same network in PyTorch, taking flat inputs, with PyTorch's own initial
        values: python -m pympgu.bench train times it under DDP beside pympgu's rows."""
        import torch
        channels, side = square_images(n_in)
        filters, units = layout(hidden)
        layers, c = [torch.nn.Unflatten(1, (channels, side, side))], channels
        for f in filters:
            layers += [torch.nn.Conv2d(c, f, 5), torch.nn.MaxPool2d(2), torch.nn.Tanh()]
            c, side = f, (side - 4) // 2
        layers += [torch.nn.Flatten(), torch.nn.Linear(c * side * side, units), torch.nn.Tanh(),
                   torch.nn.Linear(units, n_out)]
        return torch.nn.Sequential(*layers)
