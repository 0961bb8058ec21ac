"""Training one network on several workers by data parallelism (``python -m pympgu.train``).

Modules, one concern each, calls running down the list: cli (the flags into a RunConfig),
resume (a resumed run's settings), launcher (the run: checks, workers launched and
supervised, the summary), report (what the user sees), worker (a worker's training loop),
steps (its steps, for a loop of one's own), sync (when and how replicas meet), replica (a
worker's model and state), checkpoint and outdir (the run's files), config (RunConfig).
"""
from .config import RunConfig, UsageError
from .launcher import Diverged, run
from .steps import Steps

__all__ = ["Diverged", "RunConfig", "Steps", "UsageError", "run"]
