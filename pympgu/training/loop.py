"""The training loop of one worker: epochs of steps and exchanges, the epoch's end (rank 0's
evaluation and checkpoint, every rank's decision to go on), and, with --min-workers, the way
on after a lost worker (pympgu.training.recovery)."""
import math
import time

from . import checkpoint
from ..exchange import outer
from .outdir import OutDir
from .recovery import Recovery
from .sync import Sync
from ..runtime.control import Shrunk


class Training:
    """One worker's run from ``start_epoch`` (``history``: the epochs before it); ``run()``
    returns its summary: the history, a digest of the replica, and the epoch and loss where
    the loss stopped being finite, if it did (``diverged``)."""

    def __init__(self, ctx, cfg, rep, history, connect):
        from .. import data
        from .worker import make_schedule
        self.ctx, self.cfg, self.rep, self.history = ctx, cfg, rep, history
        self.connect = connect  # ctx, rep, cfg -> (Exchanger, StepExchange): see make_exchanger
        self.ex = self.inside = self.out = None
        self.ntrain = len(rep.dataset.train[1])
        # The schedule counts the steps of the workers the run began with, whatever their
        # number later: a step is a share of the epoch's data.
        self.n0 = ctx.nranks
        self.per_epoch = data.batches_per_epoch(self.ntrain, cfg.batch_size, self.n0) // self.n0
        self.schedule = make_schedule(cfg, self.ntrain, self.n0)
        elastic = cfg.min_workers is not None and cfg.min_workers < cfg.nworkers
        self.recovery = Recovery(ctx, rep, elastic, self._outer, lambda: {
            "history": self.history, "start": self.start_epoch})
        self.at = None  # where this worker is: [epoch, batches of the epoch done, step]
        self.epoch_state = None  # the epoch under way: its batches, costs, clocks

    def step_of(self, epoch, done):
        """The run's step (the schedule's) once ``done`` batches of ``epoch`` are done."""
        return epoch * self.per_epoch + min(done // self.n0, self.per_epoch)

    def run(self, start_epoch):
        self.start_epoch = start_epoch
        position, diverged, root = [start_epoch, 0, self.step_of(start_epoch, 0)], None, None
        try:
            if self.ctx.joining:  # a restarted worker: taken in when the others are ready
                took = self.recovery.take_up()  # (its predecessor's state, where kept)
                if took is not None:
                    self.history, self.start_epoch = took["history"], took["start"]
                position, self.epoch_state, root = self.recovery.recover(None)
                if took is not None:
                    self.at = list(position)  # (not a run's start to tell)
            while True:
                try:
                    if self.ex is None and self.ctx.nranks > 1:
                        self._connect(root)
                    if self.ctx.rank == 0 and self.at is None:
                        self.ctx.metric(kind="stage", text=f"training from epoch "
                                        f"{start_epoch + 1} (its first steps compile)")
                    self.recovery.keep(position, self.epoch_state)
                    diverged = self._epochs(position)
                    break
                except Shrunk:
                    # GPU workers close their exchange once every survivor has stopped
                    # stepping (recover): until then a peer's kernel may read its buffer.
                    if self.ctx.is_cpu:
                        self._disconnect()
                    position, self.epoch_state, root = self.recovery.recover(self.at)
                    self._disconnect()
            # Replicas must end identical: a digest per rank lets the launcher's caller check.
            digest = self.rep.digest()
        finally:
            self._disconnect()
            if self.out is not None:
                self.out.close()
        # Every rank's history: where the run ends after a loss at its very end, rank 0's
        # result may be missing (docs/DECISIONS.md, "A loss at the run's very end").
        return {"rank": self.ctx.rank, "history": self.history,
                "digest": digest, "diverged": diverged}

    def _connect(self, root):
        """The exchange (re-)formed; after a recovery under an outer optimizer across
        nodes, its state as it was at the point gone back to, each node's replicas as they
        stand (docs/DECISIONS.md, "A worker restarted across nodes")."""
        ctx, back = self.ctx, self.recovery.outer_back
        outer_kind = self.cfg.across_nodes in outer.REGISTRY and ctx.nnodes > 1
        # Put back rather than re-formed from the replicas (which a 'world' first exchange
        # does, averaging the nodes' inner states): from the kept snapshot, and a replaced
        # worker's slice from a node that kept its own (keeper). Every node decides alike:
        # without a keeper, a node with a replaced worker (root) has one only if all have.
        put_back = outer_kind and ctx.source is None and (
            ctx.keeper is not None or (root is None and back is not None))
        self.ex, self.inside = self.connect(ctx, self.rep, self.cfg, root=root,
                                            reach="node" if put_back else "world")
        if root is not None:
            self._welcome(root)
        if back is not None and (put_back or (outer_kind and ctx.source is not None)):
            self._nodes.backend.outer.restore(back)  # (the source's is what a new node takes)
        if ctx.source is not None:  # a node joined: from node source
            self._welcome(ctx.source * ctx.local_nranks, local=False)
            self._nodes.backend.take_outer(ctx.source)
        elif put_back and ctx.keeper is not None:
            # The same local index's slice on every node that kept its own.
            self._nodes.backend.take_outer(ctx.keeper)

    def _welcome(self, root, local=True):
        """A worker joined (its state now rank root's): it learns from rank root the run's
        history, its first epoch, and the epoch under way (its batches in all, its costs
        and clock so far), so that it could take rank 0's place at the epoch's end."""
        mine = None
        if (self.ctx.local_rank if local else self.ctx.rank) == root:
            state = self.epoch_state
            if state is not None:
                state = {**state, "costs": [float(c) for c in state["costs"]],
                         "t0": time.perf_counter() - state["t0"]}  # (elapsed)
            mine = {"history": self.history, "start": self.start_epoch, "epoch": state}
        # (a node's own gather for a worker that joins it: the other nodes go on)
        told = self.ctx.gather(mine, local=local)[root]
        if self.ctx.joining:
            self.history, self.start_epoch = told["history"], told["start"]
            self.epoch_state = told["epoch"]
            if self.epoch_state is not None:
                self.epoch_state["t0"] = time.perf_counter() - self.epoch_state["t0"]
            self.ctx.joining = False
            self.at = self.recovery.back_to  # (not a run's start to tell)

    def _outer(self):
        """The outer optimizer's slice of this worker now (Outer.snapshot), or None."""
        outer = getattr(self._nodes.backend, "outer", None) if self.ex is not None else None
        return outer.snapshot() if outer is not None else None

    def _disconnect(self):
        if self.ex is not None:
            ex, self.ex, self.inside = self.ex, None, None
            self.rep.forget()
            ex.close()

    def _epochs(self, position):
        epoch, done = position[:2]
        for epoch in range(epoch, self.cfg.epochs):
            if done == 0 or self.epoch_state is None:
                self.epoch_state = self._begin(epoch)
            record = self._epoch(epoch, done)
            done = 0
            diverged, stop = self._end(epoch, record)
            if stop:
                return diverged
        return None

    def _begin(self, epoch):
        """An epoch's bookkeeping: its batches in all, its costs so far, its clock."""
        from .. import data
        return {"total": data.batches_per_epoch(self.ntrain, self.cfg.batch_size,
                                                self.ctx.nranks),
                "costs": [], "t0": time.perf_counter(), "exchange_s": 0.0, "done": 0,
                "sent0": self._sent() or 0}

    @property
    def _nodes(self):
        """The Exchanger that meets the other nodes (Exchanger.across); None alone."""
        return None if self.ex is None else self.ex.across

    def _sent(self):
        """The bytes this worker has sent between nodes through the host (None: it sends
        none, or NCCL does)."""
        nodes = self._nodes
        if nodes is None or not nodes.on_host or self.ctx.nnodes == 1:
            return None
        return nodes.backend.across_bytes

    def _epoch(self, epoch, start):
        """Train ``epoch`` from its batch ``start`` on; returns its record (loss, rate,
        speed, the exchange's road)."""
        import numpy as np

        from .. import data
        ctx, cfg, rep, state = self.ctx, self.cfg, self.rep, self.epoch_state
        state["costs"] = state["costs"][:state.get("kept_costs", len(state["costs"]))]
        batches = data.shard_batches(self.ntrain, cfg.batch_size, ctx.nranks, ctx.rank,
                                     cfg.seed, epoch, start, state["total"])
        rep.seed_noise(epoch)
        sync = Sync(rep, self.ex, cfg.sync_every, cfg.overlap, self.inside,
                    identical=self.recovery.enabled)
        # (_met) An epoch begins where no fragment's sum runs: its last step settles it.
        self.settles = None
        report_every = max(1, len(batches) // 20)
        n, steps = ctx.nranks, start // ctx.nranks + len(batches)
        rate = held = None
        for step, idx in enumerate(rep.device_batches(batches)):
            last = step == len(batches) - 1
            done = start + step * n
            self.at = [epoch, done, self.step_of(epoch, done)]
            try:
                ctx.check()  # Ctrl-C or a lost peer, heard where no exchange meets the launcher
            except Shrunk as lost:
                if ctx.is_cpu:
                    raise
                held = held or lost
            # The run's step, from which a resumed run goes on.
            rate = rep.apply_rate(self.schedule, self.at[2])
            t0 = sync.seconds
            reach = self._reach(last)
            if held is not None and reach != "node":
                # GPU workers of a node stop together where the nodes meet, this step's
                # exchange in the node made: each one's kernels wait for every peer's
                # (docs/DECISIONS.md, "A lost GPU worker takes its node with it").
                sync.step(idx, step, last, "node")
                rep.wait()
                raise held
            state["costs"].append(sync.step(idx, step, last, reach))
            state["exchange_s"] += sync.seconds - t0
            if self.recovery.enabled and (last or not (step + 1) % cfg.sync_every) \
                    and self._met(step, reach):
                state["kept_costs"] = len(state["costs"])
                self.recovery.keep([epoch, done + n, self.step_of(epoch, done + n)],
                                   dict(state))
            if ctx.rank == 0 and (step % report_every == 0 or last):
                ctx.metric(kind="progress", epoch=epoch + 1,
                           step=start // n + step + 1, steps=steps)
        sync.drain()
        rep.wait()
        between = None
        if self._sent() is not None:
            # What this node's ranks put on the wire between nodes in the epoch.
            between = sum(ctx.gather(self._sent() - state["sent0"], local=True))
        state["done"] = start + len(batches) * n
        self.at = [epoch, state["done"], self.step_of(epoch, state["done"])]  # the epoch's end
        epoch_s = time.perf_counter() - state["t0"]
        if rate is None:
            rate = float(self.schedule(self.step_of(epoch, start)))
        costs = [float(c) for c in state["costs"]]
        return {"epoch": epoch + 1, "loss": float(np.mean(costs)) if costs else float("nan"),
                "lr": rate, "time_s": epoch_s,
                "samples_per_s": state["done"] * cfg.batch_size / epoch_s,
                "exchange_share": None if sync.fused else state["exchange_s"] / epoch_s,
                # Which road the step's exchange took inside XLA, in words (None when no
                # step traced average_gradients), so that a run says whether the gradients
                # or the parameters crossed, and why; or why it runs outside XLA (a build
                # without jaxlib's headers, say).
                "road": road(ctx, sync, self.inside),
                **({} if between is None else {"between_nodes_bytes": between})}

    def _met(self, step, reach):
        """Whether the exchange just made (``step`` of the epoch's loop) is a point to go
        back to: one where every replica of every node met (between the nodes' meetings each
        node goes its own way, as far as the next meeting) with nothing left on the way.
        With --outer-overlap that is where a fragment's sum across the nodes is settled,
        --outer-overlap exchanges after the meeting that started it."""
        d = self.cfg.outer_overlap
        if d and reach == "outer":
            self.settles = step + d
            return False
        return reach != "node" or step == self.settles

    def _reach(self, last):
        """How far this step's exchange goes (Sync.step): None, every rank as K says; with
        --across-nodes, inside the node, and every --outer-every steps (and at the epoch's
        end, when the nodes compare their replicas) across the nodes too."""
        cfg = self.cfg
        if cfg.across_nodes == "every-step" or self.ctx.nnodes == 1:
            return None
        # With F streams a fragment meets every H // F steps, each in turn.
        if not (last or (self.at[2] + 1) % (cfg.outer_every // cfg.outer_streams) == 0):
            return "node"
        if cfg.across_nodes == "average":
            return "world"
        # The inner optimizer's state stays the node's but at the epoch's end.
        return "outer-all" if last else "outer"

    def _end(self, epoch, record):
        """Rank 0 evaluates and checkpoints; every rank learns whether to stop, and the
        epoch's record. Returns (diverged, stop)."""
        ctx, cfg = self.ctx, self.cfg
        diverged, stop = None, False
        extra = None
        if cfg.across_nodes in outer.REGISTRY and self._sent() is not None:
            # The outer optimizer's state goes into the checkpoint (DiLoCo's momentum; the
            # state the nodes share is the replicas' own after the epoch's last exchange).
            extra = {key: self._nodes.backend.outer_state(attr) for key, attr in
                     outer.REGISTRY[cfg.across_nodes].saved.items()} or None
        if ctx.rank == 0:
            if not math.isfinite(record["loss"]):
                # Nothing of this epoch is kept: the last checkpoint stays the last good one.
                diverged = {"epoch": record["epoch"], "loss": record["loss"]}
                record, stop = None, True
            else:
                record["valid_error"], record["test_error"] = self.rep.errors()
                if cfg.out:
                    if self.out is None:  # rank 0 from the start, or since a recovery
                        self.out = OutDir(cfg.out, create=False)
                        # What a rank 0 lost while writing left (no one else writes there
                        # while the workers run).
                        self.out.remove_temporaries()
                    self._save(self.history + [record], first=epoch == self.start_epoch,
                               extra=extra)
                stop = bool(cfg.patience and checkpoint.epochs_since_best(
                    self.history + [record]) >= cfg.patience)
        # Rank 0 alone evaluates, so it decides, and every rank stops after the same
        # epoch, the replicas identical. Across nodes the replicas are compared every
        # epoch (one digest a rank): a difference is named at once. Every rank keeps the
        # history, so that any survivor can go on as rank 0.
        if ctx.nranks > 1:
            decided = ctx.barrier("replica (every node's must stay identical)",
                                  self.rep.digest() if ctx.nnodes > 1 else None,
                                  shared={"stop": stop, "record": record,
                                          "diverged": diverged})
            stop, record, diverged = decided["stop"], decided["record"], decided["diverged"]
        if record is not None:
            self.history.append(record)
            if ctx.rank == 0:
                ctx.metric(kind="epoch", **record)
        self.epoch_state = None
        step = self.step_of(epoch + 1, 0)
        self.recovery.keep([epoch + 1, 0, step])
        return diverged, stop

    def _save(self, history, first, extra=None):
        """Rank 0's checkpoint of the epoch just ended, best.npz if it is the best so far,
        and, after a run's first epoch, its config.json in place of an earlier run's."""
        out, rep = self.out, self.rep
        rep.save(out, history[-1]["epoch"], history, extra)
        if first and out.exists(checkpoint.CONFIG_NEXT):  # the launcher wrote it
            out.rename(checkpoint.CONFIG_NEXT, checkpoint.CONFIG)
        if all(history[-1]["valid_error"] < h["valid_error"] for h in history[:-1]):
            checkpoint.keep_best(out)


def road(ctx, sync, inside):
    """Which road the step's exchange took, in words: inside XLA (None when no step traced
    average_gradients), queued from Python after the step and why, or on CPU workers
    through shared memory (and between nodes over pympgu's TCP links)."""
    if sync.ex is None:
        return None
    cfg = sync.rep.cfg
    outer = f"between the nodes every {cfg.outer_every} steps ({cfg.across_nodes})"
    if ctx.is_cpu:
        every = "the step" if sync.every == 1 else f"every {sync.every} steps"
        across = ", and between the nodes over TCP" if ctx.nnodes > 1 else ""
        if ctx.nnodes > 1 and cfg.across_nodes != "every-step":
            across = f", and {outer} over TCP"
        return f"averaged after {every}, through shared memory{across} (CPU workers)"
    outside = sync.outside
    if sync.between is not None:  # (a road in words even where XLA's says none)
        between = f"inside the node; {outer} through the host, over TCP"
        if outside:
            return f"queued from Python after the step ({outside}), {between}"
        return f"{getattr(inside, 'road', None) or 'inside the step'}, {between}"
    if outside:
        return f"queued from Python after the step: {outside}"
    return None if inside is None else inside.road
