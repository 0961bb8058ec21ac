"""Between nodes every H steps, over exact averaging inside them (--across-nodes diloco):
DiLoCo's outer step (Douillard et al., 2023), kept in slices by the ranks of a node.

Inside a node the replicas are averaged as ever; every H steps the node's mean parameters
x are compared with the global parameters G that every node holds alike: the pseudo-
gradient G - x is averaged across the nodes, and an outer SGD step with Nesterov momentum
moves G by it (v = mu v + d; G -= lr (d + mu v)). Rank k of every node keeps its 1/L slice
of G and v (L ranks a node), the slice it averages anyway. The rest of the state (the inner
optimizer's) stays the node's, as in the paper, but at the epoch's end, where it is averaged
across the nodes too, so that every replica of every node then holds the same bits
(docs/DECISIONS.md, "DiLoCo between nodes"). The pseudo-gradient may cross in bfloat16 or
int8 (pympgu.exchange.across), summed in float32.
"""
import numpy as np


class DiLoCo:
    """The outer step on the first ``count`` elements of a state of ``total``, each rank's
    slice of ``chunk`` at most; ``lr`` and ``momentum``: the outer SGD's; ``wire``: the
    pseudo-gradient's dtype between the nodes (None: float32; 'bfloat16', 'int8')."""

    def __init__(self, count, total, chunk, lr, momentum, nnodes, wire=None):
        self.count, self.total, self.nnodes = count, total, nnodes
        self.wire = wire  # the pseudo-gradient's on the wire: None (float32), or across's
        self.lr, self.mu = np.float32(lr), np.float32(momentum)
        self.g = np.zeros(chunk, np.float32)  # this rank's slice of the global parameters
        self.v = np.zeros(chunk, np.float32)  # and of the outer momentum
        self.ready = False

    def params_in(self, lo, hi):
        """How many of the slice [lo, hi) are parameters."""
        return max(0, min(hi, self.count) - lo)

    def reset(self, mine, lo, hi):
        """After an exact average across the nodes: the global parameters are its result."""
        n = self.params_in(lo, hi)
        self.g[:n] = mine[:n]
        self.ready = True

    def step(self, part, lo, hi, nlocal):
        """``part``: the node's sum of the slice; its parameters become the node's
        pseudo-gradient G - x (x the node's mean), to be summed across the nodes."""
        if not self.ready:
            raise RuntimeError("DiLoCo's outer step before any exact exchange set the global "
                               "parameters")
        n = self.params_in(lo, hi)
        part[:n] = self.g[:n] - part[:n] / np.float32(nlocal)

    def finish(self, total, lo, hi):
        """``total``: the pseudo-gradients' sum across the nodes (this rank's slice of the
        parameters); returns G after the outer step."""
        n = self.params_in(lo, hi)
        d = total[:n] / np.float32(self.nnodes)
        v, g = self.v[:n], self.g[:n]
        v *= self.mu
        v += d
        g -= self.lr * (d + self.mu * v)
        return g
