"""How a run stops early: a rank or node that failed, or the launcher's own stop."""
from ..errors import ExchangeError


class WorkerFailed(ExchangeError):
    """A rank raised, died or hung, or a node was lost; ``rank`` is the first rank that
    failed (None for a node lost whole), ``node`` its node."""

    def __init__(self, rank, reason, details="", node=None):
        self.rank, self.reason, self.details, self.node = rank, reason, details, node
        who = "" if rank is None else f"rank {rank} "
        where = "" if node is None or rank is None else f" (node {node})"
        super().__init__(f"{who}{reason}{where}" + (f"\n{details}" if details else ""))


class NodeStopped(WorkerFailed):
    """Node 0 stopped the run: another node's rank failed, or a node was lost."""


class Terminated(KeyboardInterrupt):
    """The launcher received SIGTERM (a scheduler's stop, say): the run stopped as Ctrl-C
    stops it."""
