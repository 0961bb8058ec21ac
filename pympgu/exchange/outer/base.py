"""What every outer optimizer between nodes is: slices of a state every node holds alike,
a contribution summed across the nodes, and the node's parameters after it."""
import numpy as np


class Outer:
    """One rank's slice of an outer optimizer's state, on the first ``count`` elements (the
    parameters) of a replica's state of ``total``, slices of ``chunk`` at most; ``wire``:
    what crosses between the nodes (None: float32; 'bfloat16', 'int8'); ``streams``: the
    fragments of the parameters that meet in turn, one each outer call but the epoch's end.

    A subclass names itself (``name``), the RunConfig fields its settings come from
    (``flags``: setting -> field) and the arrays a checkpoint keeps (``saved``: checkpoint
    key -> attribute), and defines _reset, step and _finish on ``at``, a range of its slice."""

    name = None
    flags = {}
    saved = {}
    kept = ()  # the arrays that a run going back to an earlier exchange takes back

    def __init__(self, count, total, chunk, nnodes, wire=None, streams=1):
        self.count, self.total, self.nnodes = count, total, nnodes
        self.wire = wire
        self.streams, self.turn = streams, 0
        self.ready = False
        self.version, self._snapshot = 0, None  # (version: counted by each change)

    def snapshot(self):
        """This slice's state now, for a run that may go back to this point: a copy taken
        once a change (between two changes, the same object)."""
        if self._snapshot is None or self._snapshot[:2] != (self.version, self.turn):
            self._snapshot = (self.version, self.turn, self.ready,
                              {k: getattr(self, k).copy() for k in self.kept})
        return self._snapshot

    def restore(self, snapshot):
        """Back to ``snapshot`` (the slice must be the same: as many ranks a node)."""
        _, self.turn, self.ready, arrays = snapshot
        for k, a in arrays.items():
            getattr(self, k)[:] = a
        self.version += 1

    def params_in(self, lo, hi):
        """How many of the slice [lo, hi) are parameters."""
        return max(0, min(hi, self.count) - lo)

    def due(self, lo, hi, everything):
        """The range of the slice [lo, hi) (a slice of it) whose outer step is due now: the
        parameters of the next fragment in turn, or (``everything``) all of them. Every rank
        calls it at every outer exchange, so that the turns stay alike."""
        if everything or self.streams == 1:
            self.turn = 0
            first, last = 0, self.count
        else:
            first = self.turn * self.count // self.streams
            last = (self.turn + 1) * self.count // self.streams
            self.turn = (self.turn + 1) % self.streams
        a = min(max(first, lo), hi) - lo
        return slice(a, max(a, min(last, hi) - lo))

    def reset(self, mine, at):
        """After an exact average across the nodes (``mine``: this range of it)."""
        self._reset(mine, at)
        self.version += 1

    def step(self, part, at, nlocal):
        """``part``: the node's sum of this range over its ``nlocal`` ranks; it becomes what
        this node contributes to the sum across the nodes."""
        raise NotImplementedError

    def finish(self, total, at, everything):
        """``total``: the contributions' sum across the nodes (this range); returns the
        node's parameters after the outer step: the shared state itself where
        ``everything`` (the epoch's end: every node then holds the same bits)."""
        self.version += 1
        return self._finish(total, at, everything)

    def _check_ready(self):
        if not self.ready:
            raise RuntimeError(f"{self.name}'s outer step before any exact exchange set the "
                               "state the nodes share")


def zeros(chunk):
    return np.zeros(chunk, np.float32)
