"""A worker's training steps as the training loop takes them, for a loop of one's own (the
benchmarks time them): its replica, its exchanger, and when and how the replicas meet."""
from .replica import Replica
from .sync import Sync
from .worker import make_exchanger, setup_backend


class Steps:
    """Rank ``ctx``'s steps of the run ``cfg`` (a RunConfig): ``rep`` (Replica), ``ex``
    (its Exchanger, None alone), ``step_exchange`` (the exchange inside the step's XLA
    call; None with ``inside=False``, which queues it from Python after each step) and
    ``sync`` (Sync). The noise is seeded as the loop seeds its first epoch's."""

    def __init__(self, ctx, cfg, inside=True):
        setup_backend(ctx, "jax")
        self.ctx, self.cfg = ctx, cfg
        self.rep = Replica(ctx, cfg)
        self.rep.seed_noise(0)
        self.ex, self.step_exchange = make_exchanger(ctx, self.rep, cfg, inside)
        self.sync = Sync(self.rep, self.ex, cfg.sync_every, cfg.overlap, self.step_exchange)

    def step(self, idx, schedule, at, t, last=False):
        """Step ``t`` of a round on the device batch ``idx``, at the schedule's step ``at``,
        with the exchange it is due (``last`` forces one); returns its cost."""
        self.rep.apply_rate(schedule, at)
        return self.sync.step(idx, t, last)

    def finish(self):
        """Wait for the exchanges still pending, and for the device."""
        self.sync.drain()
        self.rep.wait()

    def close(self):
        if self.ex is not None:
            self.ex.close()
            self.ex = None
