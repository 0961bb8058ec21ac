"""A residual convnet with batch normalisation for pympgu, in the shape of He et al.'s
CIFAR ResNets (2016).

    python -m pympgu.train --gpus 0 1 --model examples/resnet.py:ResNet --data-dir fashion
    python -m pympgu.train --model examples/resnet.py:ResNet --hidden 16 16 16 32 32 32 64 64 64 \
        --data-dir cifar-10-python.tar.gz --flip --shift 4       # ResNet-20 on CIFAR-10

A 3x3 convolution, batch norm and ReLU open it; each ``--hidden`` entry is then a block of
that many channels: two 3x3 convolutions, each followed by a batch norm, the first by ReLU
too, added to the block's input and put through ReLU. A block whose width differs from the
one before halves the image (its first convolution and its shortcut, a 1x1 convolution
with a batch norm, have stride 2). Global average pooling and a dense layer give the class
scores; ``--dropout`` drops before it. The default, 16 16 32 32 64 64, is a ResNet-14 (2
blocks a stage; 3 give ResNet-20). Each block's last norm starts its scale at 0 (Goyal et
al. 2017), so that every block starts as the identity. Images are square, of 1 channel or
3 (channels first).
"""
import numpy as np

from pympgu.models import Model  # first: it sets PyTensor's floatX to float32
from pympgu.nnet import he_normal, square_images


class ResNet(Model):
    # Read by pympgu.train (and bench train) when --hidden is not given: each block's
    # channels, not the MLP's 500 units.
    default_hidden = (16, 16, 32, 32, 64, 64)

    def __init__(self, n_in, hidden, n_out, seed=1234):
        super().__init__()
        self.channels, self.side = square_images(n_in, type(self).__name__)
        # Every worker builds the model: draw every value from the seed, so that the
        # replicas start identical (pympgu refuses them otherwise).
        rng = np.random.default_rng(seed)

        # Convolutions carry no bias: the batch norm after each one shifts by its own.
        c = hidden[0]
        self.stem = (self.parameter(he_normal(rng, (c, self.channels, 3, 3)), "W_stem"),
                     self.batch_norm(c, "stem"))
        self.blocks, self.out_side = [], self.side
        for k, f in enumerate(hidden):
            stride = 1 if f == c else 2
            if stride == 2:
                self.out_side = (self.out_side - 1) // 2 + 1
            block = {"stride": stride,
                     "w1": self.parameter(he_normal(rng, (f, c, 3, 3)), f"W_block{k}_1"),
                     "norm1": self.batch_norm(f, f"block{k}_1"),
                     "w2": self.parameter(he_normal(rng, (f, f, 3, 3)), f"W_block{k}_2"),
                     "norm2": self.batch_norm(f, f"block{k}_2", gamma=0.0)}
            if f != c:
                block["shortcut"] = (
                    self.parameter(he_normal(rng, (f, c, 1, 1)), f"W_block{k}_shortcut"),
                    self.batch_norm(f, f"block{k}_shortcut"))
            self.blocks.append(block)
            c = f
        self.w_out = self.parameter(np.zeros((c, n_out)), "W_out")
        self.b_out = self.parameter(np.zeros(n_out), "b_out", penalized=False)

    def describe(self):
        widths = "-".join(str(b["w1"].get_value(borrow=True).shape[0]) for b in self.blocks)
        return (f"ResNet {self.channels}x{self.side}x{self.side}, blocks {widths}, "
                f"{self.out_side}x{self.out_side} maps ({self.parameter_count:,} parameters)")

    @staticmethod
    def torch_twin(n_in, hidden, n_out):
        """The same network in PyTorch, taking flat inputs, with PyTorch's own initial
        values and batch norms (running statistics, which DDP broadcasts from rank 0 at
        every step): python -m pympgu.bench train times it under DDP beside pympgu's rows."""
        import torch
        from torch import nn
        channels, side = square_images(n_in)

        class Block(nn.Module):
            def __init__(self, c, f):
                super().__init__()
                s = 1 if f == c else 2
                self.branch = nn.Sequential(
                    nn.Conv2d(c, f, 3, s, 1, bias=False), nn.BatchNorm2d(f), nn.ReLU(),
                    nn.Conv2d(f, f, 3, 1, 1, bias=False), nn.BatchNorm2d(f))
                self.shortcut = nn.Identity() if f == c else nn.Sequential(
                    nn.Conv2d(c, f, 1, s, bias=False), nn.BatchNorm2d(f))

            def forward(self, h):
                return torch.relu(self.shortcut(h) + self.branch(h))

        layers, c = [nn.Unflatten(1, (channels, side, side)),
                     nn.Conv2d(channels, hidden[0], 3, 1, 1, bias=False),
                     nn.BatchNorm2d(hidden[0]), nn.ReLU()], hidden[0]
        for f in hidden:
            layers.append(Block(c, f))
            c = f
        layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(c, n_out)]
        return nn.Sequential(*layers)

    def logits(self, x):
        import pytensor.tensor as pt

        from pympgu.nnet import conv2d

        def relu(h):
            return pt.maximum(h, 0)
        # A reshape to static sizes: under JAX (GPUs) every size must be known when the
        # step is traced, the batch too (x's is).
        batch = x.type.shape[0] if x.type.shape[0] is not None else x.shape[0]
        h = x.reshape((batch, self.channels, self.side, self.side))
        w, norm = self.stem
        h = relu(norm(conv2d(h, w, padding=1)))
        for b in self.blocks:
            branch = relu(b["norm1"](conv2d(h, b["w1"], padding=1, stride=b["stride"])))
            branch = b["norm2"](conv2d(branch, b["w2"], padding=1))
            if "shortcut" in b:
                w, norm = b["shortcut"]
                h = norm(conv2d(h, w, stride=b["stride"]))
            h = relu(h + branch)
        pooled = h.mean(axis=(2, 3))  # (batch, channels)
        return pt.dot(self.dropout(pooled), self.w_out) + self.b_out
