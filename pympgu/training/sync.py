"""When and how a replica meets the others: the exchange's policy over a training epoch."""
import time


def same_start(every, overlap):
    """Whether every rank starts each step from the same state (an exact exchange after
    every step): the gradients' road, the one on which a half-precision wire also enters
    the step's XLA call."""
    return every == 1 and not overlap


# The reaches (Sync.step) that meet the other nodes.
ACROSS = ("world", "outer", "outer-all")


class Sync:
    """When and how a replica meets the others: every ``every`` steps, plainly or overlapped.

    Plain: average, carry on. Overlapped: start averaging the current values, so that the
    next step computes while it runs, and after that step apply the average with the
    one-step-delayed correction. On GPUs nothing waits on the host: the work is queued in
    order on the streams. ``seconds`` adds up the host time the training loop spends here
    (on GPUs, queueing, plus any wait when the host is an exchange ahead). The epoch's last
    exchange is plain, so that replicas end identical.

    Overlapped with every = K > 1, the whole state crosses once a cycle, during the due
    step (the K-th), and is corrected after it (docs/DECISIONS.md, "Overlap with
    --sync-every"). No correction comes later than the step after its start: a late
    correction makes training unstable.

    Exchanges of JAX workers are ``fused``: the average runs inside the step's own jitted
    call (``inside``, a pympgu.xla.StepExchange), so no separate exchange is queued at all
    and its host time is part of the step's; an overlapped one spans the step whose call it
    is in. The fp32 wire and the kernel methods allow fusing, and a half-precision wire
    does with every=1, not overlapped, where the gradients cross in it (below). Without
    ``inside`` (a build without jaxlib's headers, or the benchmark's '-py' rows) the
    exchanges are queued from Python after the step.

    Fused with every=1, an exchange averages the parameters alone (half the bytes) and each
    rank keeps its own momentum, except at the epoch's last step, which averages everything
    so that replicas end identical. That changes nothing but rounding: when the parameters
    are averaged after every step, p' = mean(p + v_r') = p + mean(v_r'), and mean(v_r')
    obeys the same recurrence (mu * mean(v_r) - lr * mean(g_r)) as an averaged momentum
    would, from the same start. This is why data-parallel SGD needs only the gradients.
    Overlapped, the same holds of the replicas' mean: p_r' = mean(p) + v_r', so mean(p') =
    mean(p) + mean(v'). With every > 1 the argument fails and the momentum is averaged too
    (docs/DECISIONS.md, "Momentum with --sync-every"). It needs an update affine in the
    gradients: with Adam, or gradients clipped by their norm (Model.affine_update False),
    every exchange averages the whole state.

    Fused with every=1 and not overlapped, every rank starts each step from the same state,
    so the step takes the ``gradients`` road where it can (pympgu.xla.average_gradients):
    the update of every rank reads the ranks' mean gradient, as DDP's does, and the whole
    state, momentum too, stays identical on every rank. For an update affine in its
    gradients (SGD with momentum) that is the same trajectory again, up to rounding; the
    parameters' own average after the update remains where it does not apply. Adam's
    update is not affine (nor a clipped one), and there the road changes what is computed:
    Adam's step on the mean gradient, DDP's Adam (the norm of the mean gradient, DDP's
    clip_grad_norm_), at every size of model (elsewhere: on CPU workers, outside the step's
    XLA call, overlapped or with every > 1, each replica takes its own Adam step and the
    whole state is averaged).
    """

    def __init__(self, rep, ex, every=1, overlap=False, inside=None, identical=False):
        self.rep, self.ex, self.inside = rep, ex, inside
        self.every, self.overlap = every, overlap
        self.seconds = 0.0
        self.stepped = False  # a step was taken since the pending exchange started
        self.fused = (inside is not None and rep.jax is not None
                      and inside.unavailable(gradients=same_start(every, overlap)) is None)
        # SGD's momentum may stay local (below), Adam's moments may not; nor any state
        # where ``identical`` asks every exchange to leave the whole state alike (a point
        # to go back to after a lost worker). CPU workers' exchanges queued from Python
        # take the same road (half the bytes through shared memory); GPU workers' queued
        # ones (no XLA call to join) average everything.
        self.params_only = ((self.fused or rep.ctx.is_cpu) and every == 1
                            and rep.model.affine_update and not identical)
        self.gradients = self.fused and same_start(every, overlap)
        # GPU workers under an outer optimizer: their exchange stays inside the node, and
        # the host's (Exchanger.between) meets the other nodes as ``reach`` says.
        self.between = getattr(ex, "between", None)

    @property
    def outside(self):
        """Why a GPU worker's exchanges are queued from Python after its steps rather than
        run inside their XLA call (about half the wide MLP's speed on 2 H200s), in words;
        None where they run inside, or where there is no XLA call to join (CPU workers)."""
        if self.fused or self.ex is None or self.rep.ctx.is_cpu:
            return None
        if self.rep.jax is None:
            return "PyTensor's C backend has no XLA call"
        if self.inside is None:
            return "its caller asked for it (no StepExchange: make_exchanger(inside=False))"
        return self.inside.unavailable()

    @property
    def regular(self):
        """The part of the state (Replica.part) that an exchange other than the epoch's
        last sends (the momentum and the parameters take the same bytes)."""
        if self.overlap:
            return self.spanning(self.every - 1)
        return "params" if self.params_only else "state"

    def spanning(self, t):
        """The part of the state (Replica.part) whose overlapped exchange spans step t:
        starts before it computes and is corrected after it; or None."""
        if self.every == 1:
            return "params" if self.params_only else "state"
        if not (t + 1) % self.every:
            return "state"
        return None

    def step(self, idx, step, last=False, reach=None):
        """Training step `step` (counted from 0) of an epoch on minibatch idx, then the
        exchange if one is due (`last` forces one); returns the step's cost. ``reach``
        (CPU workers across nodes, --across-nodes): this step's exchange is inside the
        node ('node'), or across the nodes too ('world', 'outer', 'outer-all': due whatever
        K says; GPU workers: after the node's own exchange, through Exchanger.between)."""
        if not self.fused:
            cost = self.rep.step(idx)
            self.after_step(step, last, reach)
            return cost
        cost = self._fused(idx, step, last)
        self._between(reach)
        return cost

    def _fused(self, idx, step, last):
        if last:  # the whole state, plain: replicas end identical
            return self.rep.step(idx, self.inside, gradients=self.gradients)
        if self.overlap:
            part = self.spanning(step)
            if part is None:
                return self.rep.step(idx)
            return self.rep.step(idx, self.inside, part, overlap=True)
        if not (step + 1) % self.every:
            return self.rep.step(idx, self.inside, "params" if self.params_only else "state",
                                 gradients=self.gradients)
        return self.rep.step(idx)

    def _between(self, reach):
        """The host's exchange between the nodes, where ``reach`` asks for one."""
        if self.between is None or reach not in ACROSS:
            return
        t0 = time.perf_counter()
        self.rep.exchange(self.between, reach, "state")
        self.seconds += time.perf_counter() - t0

    def after_step(self, step, last=False, reach=None):
        """Call after step `step` (counted from 0) of an epoch; `last` forces a sync."""
        self.stepped = True
        if self.ex is None:
            return
        if self.between is not None:  # the node's exchange as K says, then the nodes'
            self._after(step, last, None)
            self._between(reach)
        else:
            self._after(step, last, reach)

    def _after(self, step, last, reach):
        due = (not (step + 1) % self.every and not self.overlap) or last or reach in ACROSS
        pending = self.overlap and self.ex.pending
        begin = self.overlap and not last and self.spanning(step + 1)
        if not (due or pending or begin):
            return
        if self.rep.ctx.is_cpu:
            # CPU JAX computes the step after the call returns, and the exchange reads its
            # results: wait for them first, or the epoch line would count the step's time
            # as the exchange's (99% on the MLP). Nothing is lost: the exchange needs them.
            self.rep.wait()
        t0 = time.perf_counter()
        if pending:  # started one step ago: correct for it now
            self.rep.exchange_correct(self.ex)
        if begin:
            self.rep.exchange_start(self.ex, begin)
            self.stepped = False
        elif due:
            # Across nodes (``reach``) the outer step and the nodes' meetings take the state.
            part = "params" if self.params_only and not last and reach is None else "state"
            self.rep.exchange(self.ex, reach or "world", part)
        self.seconds += time.perf_counter() - t0

    def drain(self):
        """Finish an overlapped exchange: afterwards every replica holds the same values."""
        if self.ex is not None and self.ex.pending:
            t0 = time.perf_counter()
            self.rep.exchange_correct(self.ex, self.stepped)
            self.seconds += time.perf_counter() - t0
