"""Between nodes every H steps, over exact averaging inside them (--across-nodes diloco):
DiLoCo's outer step (Douillard et al., 2023), kept in slices by the ranks of a node.

Inside a node the replicas are averaged as ever; every H steps the node's mean parameters
x are compared with the global parameters G that every node holds alike: the pseudo-
gradient G - x is averaged across the nodes, and an outer SGD step with Nesterov momentum
moves G by it (v = mu v + d; G -= lr (d + mu v)). Rank k of every node keeps its 1/L slice
of G and v (L ranks a node), the slice it averages anyway; the rest of the state (the inner
optimizer's) is averaged across the nodes at the same exchange, so that after it every
replica of every node holds the same bits (docs/DECISIONS.md, "DiLoCo between nodes").
"""
import numpy as np


class DiLoCo:
    """The outer step on the first ``count`` elements of a state of ``total``, each rank's
    slice of ``chunk`` at most; ``lr`` and ``momentum``: the outer SGD's."""

    def __init__(self, count, total, chunk, lr, momentum, nnodes):
        self.count, self.total, self.nnodes = count, total, nnodes
        self.lr, self.mu = np.float32(lr), np.float32(momentum)
        self.g = np.zeros(chunk, np.float32)  # this rank's slice of the global parameters
        self.v = np.zeros(chunk, np.float32)  # and of the outer momentum
        self.ready = False

    def _params(self, lo, hi):
        """How many of the slice [lo, hi) are parameters."""
        return max(0, min(hi, self.count) - lo)

    def reset(self, mine, lo, hi):
        """After an exact average across the nodes: the global parameters are its result."""
        n = self._params(lo, hi)
        self.g[:n] = mine[:n]
        self.ready = True

    def step(self, part, lo, hi, nlocal):
        """``part``: the node's sum of the slice; its parameters become the node's
        pseudo-gradient G - x (x the node's mean), to be summed across the nodes."""
        if not self.ready:
            raise RuntimeError("DiLoCo's outer step before any exact exchange set the global "
                               "parameters")
        n = self._params(lo, hi)
        part[:n] = self.g[:n] - part[:n] / np.float32(nlocal)

    def finish(self, total, mine, lo, hi, nranks):
        """``total``: the sum across the nodes; this rank's slice of the new state into
        ``mine``: G after the outer step, and the average of the rest."""
        n = self._params(lo, hi)
        d = total[:n] / np.float32(self.nnodes)
        v, g = self.v[:n], self.g[:n]
        v *= self.mu
        v += d
        g -= self.lr * (d + self.mu * v)
        mine[:n] = g
        mine[n:] = total[n:] / np.float32(nranks)
