"""DiLoCo's outer step (Douillard et al., 2023): every H steps the pseudo-gradient G - x
(G the global parameters every node holds alike, x the node's mean) is averaged across the
nodes, and an outer SGD step with Nesterov momentum moves G by it."""
import numpy as np

from .base import Outer, zeros


class DiLoCo(Outer):
    """v = mu v + d; G -= lr (d + mu v), d the nodes' mean pseudo-gradient; every node
    takes G."""

    name = "diloco"
    flags = {"lr": "outer_lr", "momentum": "outer_momentum"}
    saved = {"outer_momentum": "v"}  # G is the replicas' own after each epoch's end
    kept = ("g", "v")

    def __init__(self, count, total, chunk, nnodes, wire=None, streams=1, lr=0.7,
                 momentum=0.9):
        super().__init__(count, total, chunk, nnodes, wire, streams)
        self.lr, self.mu = np.float32(lr), np.float32(momentum)
        self.g = zeros(chunk)  # this rank's slice of the global parameters
        self.v = zeros(chunk)  # and of the outer momentum

    def _reset(self, mine, at):
        self.g[at] = mine
        self.ready = True

    def step(self, part, at, nlocal):
        self._check_ready()
        part[:] = self.g[at] - part / np.float32(nlocal)

    def _finish(self, total, at, everything):
        d = total / np.float32(self.nnodes)
        v, g = self.v[at], self.g[at]
        v *= self.mu
        v += d
        g -= self.lr * (d + self.mu * v)
        return g
