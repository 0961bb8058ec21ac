"""The run's processes: one launcher a node starts and supervises its workers (launch), the
control plane between them (protocol, control), the levels above a node's coordinator when
there are several nodes (hub, uplink), where the nodes are (nodes), and what a run keeps
outside its processes (shm, rundir) or reads of them (output)."""
from .context import WorkerContext
from .failures import Terminated, WorkerFailed
from .launch import launch

__all__ = ["Terminated", "WorkerContext", "WorkerFailed", "launch"]
