"""Going on without a lost worker (--min-workers): what each exchange leaves to go back to,
and the way back.

After an exchange every replica holds the same bits, so the state right after one is a
point every survivor can return to. A loss can come while the exchange is half done (some
slices averaged, some not) or while some survivors have passed it and others have not
noticed yet, so each worker keeps the last two such states (docs/DECISIONS.md, "Going on
without a lost worker"): the launcher picks the newest that every survivor holds.
"""
import pickle

from ..runtime.control import Shrunk

KEEP = 2  # a survivor is at most one exchange ahead of another


class Recovery:
    """The states a worker may go back to, in order: (position, values, what the training
    loop noted then, the outer optimizer's slice then). A position is [epoch, batches of the
    epoch done, the run's step]. ``outer``: the outer optimizer's slice now (Outer.snapshot),
    or None."""

    def __init__(self, ctx, rep, enabled, outer=lambda: None, extra=lambda: None):
        self.ctx, self.rep, self.enabled, self.outer = ctx, rep, enabled, outer
        self.kept = []
        # Where a node starts every worker again: each point kept on the host too, for the
        # worker that takes this one's place (``extra()``: the loop's history beside it).
        self.carried = None
        if enabled and ctx.carry is not None:
            from .carried import Carried
            self.carried = Carried(ctx.carry, ctx.link.rank)
        self.extra = extra
        self.back_to = None  # since a recovery: tell the launcher of the next exchange
        self.outer_back = None  # the outer optimizer's slice where a recovery went back to

    def keep(self, position, note=None):
        """Every replica holds the same state at ``position``: an exchange just completed
        (or the one that made the replicas alike)."""
        if not self.enabled:
            return
        import numpy as np
        # Copies: after a CPU workers' exchange the state is views of a shared buffer that
        # the exchange after next writes again (Exchanger.finish), and PyTensor's C backend
        # updates its arrays in place.
        values = self.rep.values()
        if self.rep.jax is not None and not self.ctx.is_cpu:
            values = self.rep.jax.device_get(list(values))  # (a GPU's: in one call)
        values = [np.array(v, copy=True) for v in values]
        entry = (list(position), values, note, self.outer())
        if self.kept and self.kept[-1][0][:2] == entry[0][:2]:
            self.kept[-1] = entry  # the same point again (the exchange re-formed)
        else:
            self.kept = (self.kept + [entry])[-KEEP:]
        if self.carried is not None:
            try:
                self.carried.write(self.kept, self.extra())
            except OSError as e:  # (a full disk, say: this worker trains on all the same)
                self._stop_carrying(f"its state could not be kept in {self.ctx.carry} ({e})")
        if self.back_to is not None and position[:2] != self.back_to[:2]:
            self.back_to = None
            if self.ctx.local_rank == 0:  # (each node's: its launcher learns it so)
                self.ctx.metric(kind="recovered")

    def take_up(self):
        """A new worker in a lost one's place takes up what that one kept (``carry``): then
        it holds the node's state and is no longer a joiner. Returns the loop's ``extra``
        then, or None where there was nothing to take up."""
        try:
            found = self.carried.read() if self.carried is not None else None
        except (OSError, EOFError, ValueError, KeyError, pickle.UnpicklingError) as e:
            self._stop_carrying(f"what its predecessor kept in {self.ctx.carry} could not be "
                                f"read ({e})")
            found = None
        if found is None or not found[0]:
            return None
        self.kept, extra = found
        self.ctx.joining = False
        return extra

    def _stop_carrying(self, why):
        from ..log import log
        log.warning(f"rank {self.ctx.rank}: {why}; were its node to start its workers "
                    "again, they would take another node's state")
        self.carried.forget()
        self.carried = None

    def recover(self, at):
        """After control.Shrunk (the exchange closed): agree with the survivors on the
        newest position every one of them holds, and go back to it; ``at``: where this
        worker was. A restarted worker (``ctx.joining``) holds nothing yet, and waits here
        to be taken in. Returns (position, note, root): root is the rank whose state every
        worker takes (None: no worker joins). Another loss meanwhile starts over."""
        while True:
            try:
                back_to, root = self.ctx.recover([e[0] for e in self.kept], at)
                break
            except Shrunk:
                continue
        self.back_to = back_to
        entry = next((e for e in self.kept if e[0][:2] == back_to[:2]), None)
        if self.ctx.joining or entry is None:
            # A worker that joined and has not been through an exchange with the others
            # since: its state comes from rank root in the first exchange.
            if root is None and self.ctx.source is None:
                raise RuntimeError(f"rank {self.ctx.rank} holds no state at {back_to[:2]} "
                                   "and no rank was named to take it from")
            self.ctx.joining = True
            return back_to, None, root
        import numpy as np
        position, values, note, self.outer_back = entry
        # Copies: the kept arrays must stay as they are, whatever the step does with its own.
        if self.rep.jax is not None and not self.ctx.is_cpu:
            values = [self.rep.jnp.asarray(v) for v in values]  # (a GPU's: to the device)
        else:
            values = [np.array(v, copy=True) for v in values]
        self.rep.set_values(values)
        self.kept = [entry]
        return position, note, root
