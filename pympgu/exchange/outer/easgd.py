"""Elastic averaging between nodes (EASGD, Zhang, Choromanska and LeCun, 2015; the 2014
demo's family through Theano-MPI): every H steps each node's mean x is pulled toward a
centre c that every node holds alike, and c toward the nodes, by the same elastic force."""
import numpy as np

from .base import Outer, zeros


class EASGD(Outer):
    """d = x - c (c before this step); x -= alpha d; c += alpha (the nodes' sum of d). The
    nodes keep their own parameters between epochs' ends; at an epoch's end every node
    takes the centre (docs/DECISIONS.md, "EASGD between nodes")."""

    name = "easgd"
    flags = {"alpha": "easgd_alpha"}
    saved = {}  # the centre is the replicas' own after each epoch's end
    kept = ("c",)

    def __init__(self, count, total, chunk, nnodes, wire=None, streams=1, alpha=None):
        super().__init__(count, total, chunk, nnodes, wire, streams)
        # The paper's beta = nodes x alpha = 0.9 unless given.
        self.alpha = np.float32(0.9 / nnodes if alpha is None else alpha)
        self.c = zeros(chunk)  # this rank's slice of the centre
        self.x = zeros(chunk)  # and of this node's mean, between step and finish

    def _reset(self, mine, at):
        self.c[at] = mine
        self.ready = True

    def step(self, part, at, nlocal):
        self._check_ready()
        x = self.x[at]
        np.divide(part, np.float32(nlocal), out=x)
        np.subtract(x, self.c[at], out=part)

    def _finish(self, total, at, everything):
        c, x = self.c[at], self.x[at]
        x -= self.alpha * (x - c)  # (c before this step)
        c += self.alpha * total
        return c if everything else x
