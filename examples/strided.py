"""A convnet for pympgu that halves its images by strided convolutions, where LeNet pools.

    python -m pympgu.train --gpus 0 1 --model examples/strided.py:StridedConvNet --data-dir fashion
    python -m pympgu.train --cpu 2 --model examples/strided.py:StridedConvNet   # no GPU: CPU JAX

Each stage is a 3x3 convolution, then a 3x3 convolution of stride 2 that halves the image,
each followed by ReLU, as in ResNet's and the all-convolutional net's downsampling
(Springenberg et al. 2015); a dense layer and the softmax follow. ``--hidden C1 C2 ...``
gives each stage's channels (default 32 64: 28x28 images become 14x14, then 7x7; 96,362
parameters). Images are square, of 1 channel or 3 (channels first). An all-convolutional
head (a 1x1 convolution to one map a class, averaged) in place of the dense layer learned
far more slowly without batch normalisation: after two epochs of the embedded MNIST on 2
CPU workers, 79.5% test error by SGD and 58.8% by Adam, against this network's 4.6% by SGD.
"""
import numpy as np

from pympgu.models import Model  # first: it sets PyTensor's floatX to float32
from pympgu.nnet import he_normal, square_images


def halved(side, times=1):
    """The side of the image after ``times`` 3x3 convolutions of stride 2 padded by 1."""
    for _ in range(times):
        side = (side - 1) // 2 + 1
    return side


class StridedConvNet(Model):
    # Read by pympgu.train (and bench train) when --hidden is not given: the channels of
    # the two stages, not the MLP's 500 units.
    default_hidden = (32, 64)

    def __init__(self, n_in, hidden, n_out, seed=1234):
        super().__init__()
        self.channels, self.side = square_images(n_in, type(self).__name__)
        # Every worker builds the model: draw every value from the seed, so that the
        # replicas start identical (pympgu refuses them otherwise).
        rng = np.random.default_rng(seed)

        self.stages, c = [], self.channels
        for k, f in enumerate(hidden):
            layers = []
            for j, (c_in, stride) in enumerate(((c, 1), (f, 2))):
                w = self.parameter(he_normal(rng, (f, c_in, 3, 3)), f"W_stage{k}_{j}")
                b = self.parameter(np.zeros(f), f"b_stage{k}_{j}", penalized=False)
                layers.append((w, b, stride))
            self.stages.append(layers)
            c = f
        self.out_side = halved(self.side, len(hidden))
        self.flat = c * self.out_side ** 2
        self.w_out = self.parameter(np.zeros((self.flat, n_out)), "W_out")
        self.b_out = self.parameter(np.zeros(n_out), "b_out", penalized=False)

    def describe(self):
        side = self.out_side
        channels = "-".join(str(layers[0][0].get_value(borrow=True).shape[0])
                            for layers in self.stages)
        return (f"StridedConvNet {self.channels}x{self.side}x{self.side}, channels {channels}, "
                f"{side}x{side} maps ({self.parameter_count:,} parameters)")

    def logits(self, x):
        import pytensor.tensor as pt

        from pympgu.nnet import conv2d

        def bias(b):
            return b.dimshuffle("x", 0, "x", "x")
        # A reshape to static sizes: under JAX (GPUs) every size must be known when the
        # step is traced, the batch too (x's is).
        batch = x.type.shape[0] if x.type.shape[0] is not None else x.shape[0]
        h = x.reshape((batch, self.channels, self.side, self.side))
        for layers in self.stages:
            for w, b, stride in layers:
                h = pt.maximum(conv2d(h, w, padding=1, stride=stride) + bias(b), 0)
        return pt.dot(self.dropout(h.reshape((batch, self.flat))), self.w_out) + self.b_out

    @staticmethod
    def torch_twin(n_in, hidden, n_out):
        """The same network in PyTorch, taking flat inputs, with PyTorch's own initial
        values: python -m pympgu.bench train times it under DDP beside pympgu's rows."""
        import torch
        channels, side = square_images(n_in)
        layers, c = [torch.nn.Unflatten(1, (channels, side, side))], channels
        for f in hidden:
            layers += [torch.nn.Conv2d(c, f, 3, padding=1), torch.nn.ReLU(),
                       torch.nn.Conv2d(f, f, 3, stride=2, padding=1), torch.nn.ReLU()]
            c = f
        side = halved(side, len(hidden))
        layers += [torch.nn.Flatten(), torch.nn.Linear(c * side * side, n_out)]
        return torch.nn.Sequential(*layers)
