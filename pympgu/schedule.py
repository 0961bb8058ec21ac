"""The learning rate of each training step: ``--lr`` shaped by ``--schedule`` and ``--warmup``.

Data parallelism multiplies the batch by the number of workers, and large batches train
best with the rate ramped up over the first epochs and decayed towards the end (Goyal et
al., 2017; Loshchilov and Hutter, 2017). The rate is a shared variable of the compiled step
(pympgu.models.Model.compile), so each step may have its own without compiling again; every
rank computes the same rate for the same step, from the step's number alone, so nothing
about it crosses between ranks and a resumed run goes on where it stopped.
"""
import math

SCHEDULES = ("constant", "cosine", "linear")


class Schedule:
    """The base learning rate of step ``t`` (counted from 0 over the whole run, resumed
    runs included): ``lr`` ramped linearly from ``lr / warmup`` over the first ``warmup``
    steps, then held (``constant``) or decayed over the remaining steps of ``total`` to
    near zero at the last one, along half a cosine (``cosine``) or a straight line
    (``linear``)."""

    def __init__(self, lr, total, kind="constant", warmup=0):
        if kind not in SCHEDULES:
            raise ValueError(f"schedule must be one of {list(SCHEDULES)}, got {kind!r}")
        # A warm-up longer than the run is allowed: the run may be resumed for more epochs.
        if not lr > 0 or total < 1 or warmup < 0:
            raise ValueError(f"need lr > 0, total >= 1 and warmup >= 0; got lr {lr}, "
                             f"total {total}, warmup {warmup}")
        self.lr, self.total, self.kind, self.warmup = float(lr), int(total), kind, int(warmup)

    def __call__(self, t):
        if t < self.warmup:
            return self.lr * (t + 1) / self.warmup
        if self.kind == "constant":
            return self.lr
        # From 0 at the first step after the warmup to just under 1 at the last step, so
        # that no step trains at a rate of zero.
        progress = (t - self.warmup) / max(1, self.total - self.warmup)
        if self.kind == "cosine":
            return self.lr * 0.5 * (1.0 + math.cos(math.pi * progress))
        return self.lr * (1.0 - progress)

    def __str__(self):
        warm = f", {self.warmup} warm-up steps" if self.warmup else ""
        return f"lr {self.lr:g} {self.kind}{warm}"
