"""One worker's replica: its model, its compiled functions, its learning rate, and its state
handed to and taken from the exchange."""
import hashlib

from . import checkpoint


def jax_device(jax, ctx):
    """JAX's device for this rank's GPU (ctx.device, a CUDA ordinal of this process)."""
    gpus = [d for d in jax.devices() if d.platform == "gpu"]
    if not gpus:  # JAX installed without CUDA, most likely jax[cpu]
        raise RuntimeError(
            f"rank {ctx.rank}: JAX sees no GPU (its devices: {jax.devices()}); install JAX for "
            'CUDA (pip install "jax[cuda13]"), or train on CPU workers with --cpu N')
    mine = [d for d in gpus if d.local_hardware_id == ctx.device]
    if not mine and len(gpus) == 1:
        mine = gpus  # JAX saw this GPU alone and numbered it on its own
    if len(mine) != 1:
        raise RuntimeError(f"rank {ctx.rank}: JAX has no device for GPU {ctx.device} "
                           f"(it sees {gpus})")
    return mine[0]


def _assign(shared, value):
    """Give a shared variable a new value without a host round-trip.

    set_value() would copy a jax.Array to the host; storing it in the container is what
    PyTensor's own updates do after every call.
    """
    import numpy as np
    if isinstance(value, np.ndarray):
        shared.set_value(value, borrow=True)
    else:
        shared.container.storage[0] = value


def build_model(cfg, ds):
    """The run's model (a RunConfig's) for the dataset ``ds`` (pympgu.models.build), with
    its optimizer."""
    from .. import models
    return models.build(cfg.model, ds.n_in, cfg.hidden, ds.n_classes, seed=cfg.init_seed,
                        recipe=models.Recipe.of(cfg))


# How many steps' learning rates Replica.apply_rate puts on the device at once.
RATES_AHEAD = 256


class Replica:
    """One worker's model, its compiled functions, and its share of each epoch."""

    def __init__(self, ctx, cfg):
        import numpy as np

        from .. import data, precision
        self.np, self.ctx, self.cfg = np, ctx, cfg
        self.dataset = data.load(cfg.data)
        ds = self.dataset
        self.model = build_model(cfg, ds)
        mode = precision.mode(cfg.compute_dtype, cfg.backend)
        self.eval_batch = min(500, len(ds.valid[1]) + len(ds.test[1]))
        self.train_fn, self.eval_fn = self.model.compile(ds, cfg.batch_size, self.eval_batch,
                                                         mode=mode)
        # What model.rate_vars hold (apply_rate): the step size, and AdamW's decay.
        self.applied = tuple(np.float32(v.get_value()) for v in self.model.rate_vars)
        self._rates = {}  # step: (schedule, its rate, the rates applied, those on the device)
        self._split_rates = None  # jitted: an array of rates into scalars (apply_rate)
        self.jax = None
        self._jit_cache = {}
        self._steps = {}
        if cfg.backend == "jax":
            import jax
            import jax.numpy as jnp
            self.jax, self.jnp = jax, jnp
            if ctx.device is not None:
                # Whatever JAX sees, everything this rank computes goes to its own GPU:
                # arrays put without a device, and every jit whose inputs are such arrays.
                jax.config.update("jax_default_device", jax_device(jax, ctx))
            # Shared variables hold numpy arrays until a function first updates them, and
            # the dataset never is updated: left alone, every call would copy it from the
            # host. Put every one on the device once.
            for s in self.model.state + self.model.data_vars + self.model.rate_vars:
                _assign(s, jax.device_put(s.get_value(borrow=True)))
            if ctx.device is not None:
                self._check_device(self.model.state[0].get_value(borrow=True))

    def apply_rate(self, schedule, t):
        """Set the learning rate of the run's step ``t`` (from 0): ``schedule``'s, with the
        optimizer's own factor (Adam's bias correction) and AdamW's decay (Model.rates);
        returns the schedule's. Only a new value costs anything, so a constant rate costs
        nothing."""
        if self._rates.get(t, (None,))[0] is not schedule:
            # The next RATES_AHEAD steps' rates in one transfer of one array, split into
            # scalars on the device by one jitted call (docs/DECISIONS.md, "Learning rates
            # on the device").
            steps = range(t, t + RATES_AHEAD)
            rates = [schedule(u) for u in steps]
            values = [tuple(self.np.float32(v) for v in self.model.rates(r, u + 1))
                      for u, r in zip(steps, rates)]
            put = values
            if self.jax is not None and any(v != self.applied for v in values):
                if self._split_rates is None:
                    self._split_rates = self.jax.jit(lambda a: [tuple(row) for row in a])
                put = self._split_rates(self.jax.device_put(self.np.array(values)))
            self._rates = {u: (schedule, r, v, d) for u, r, v, d in zip(steps, rates, values, put)}
        _, rate, values, put = self._rates[t]
        if values != self.applied:  # the host's copy: reading the device's would wait for it
            self.applied = values
            for var, v in zip(self.model.rate_vars, put):
                _assign(var, self.np.asarray(v) if self.jax is None else v)
        return rate

    def seed_noise(self, epoch):
        """Seed the generators the training step draws from (Model.dropout's) for this
        rank and ``epoch``, from --seed: ranks draw different masks, and a run resumed at
        an epoch draws the same ones as the run it continues."""
        from ..models import seed_noise
        seed_noise(self.train_fn, self.cfg.seed, self.ctx.rank, epoch)

    def _check_device(self, array):
        """Fail if JAX put the model on another GPU than this rank's.

        JAX, left to itself, uses the first GPU it sees: every rank would compute there,
        and each step would pull data across the link.
        """
        from .. import cuda
        where = cuda.pointer_device(array.unsafe_buffer_pointer())
        if where != self.ctx.device:
            raise RuntimeError(
                f"rank {self.ctx.rank}: JAX put the model on GPU {where}, not on this rank's "
                f"GPU {self.ctx.device}; was jax_default_device set elsewhere?")

    def part(self, name):
        """The entries (lo, hi) of the state that an exchange of ``name`` averages: 'state'
        (all of it), 'params' or 'momentum' (the optimizer's state: SGD's momentum, Adam's
        two moments). The state lists the parameters, then the optimizer's arrays, each kind
        of the parameters' shapes: either part crosses where the state's first entries
        go (Exchanger.part)."""
        k, n = len(self.model.params), len(self.model.state)
        return {"state": (0, n), "params": (0, k), "momentum": (k, n)}[name]

    def step(self, idx, inside=None, part="state", overlap=False, gradients=False):
        """One training step on the minibatch idx; returns its cost.

        With JAX the compiled program is called directly (pympgu.xla.step), so that given
        ``inside`` (a pympgu.xla.StepExchange) the step also averages ``part`` of the state
        (Replica.part) with every rank inside the same jitted call (average_results; see
        Sync for when the parameters alone are enough). With ``gradients`` (every rank
        starts the step from the same state) its update takes the ranks' mean gradients
        instead, where the update allows (average_gradients). With overlap it averages the
        values it starts from while it computes, and corrects its result by that average
        (--overlap).
        """
        if self.jax is None:
            return self.train_fn(idx)
        return self.jax_step(inside, part, overlap, gradients)(idx)

    def forget(self):
        """Drop what was compiled around an exchange now closed (its buffers are in the
        program): an exchange re-formed after a loss gets programs of its own."""
        self._steps = {key: fn for key, fn in self._steps.items() if not key[0]}
        self._jit_cache = {}

    def jax_step(self, inside=None, part="state", overlap=False, gradients=False):
        """The JaxStep that step() calls for these arguments, built once."""
        key = (inside is not None, part, overlap, gradients)
        fn = self._steps.get(key)
        if fn is None:
            from .. import xla
            from ..xla.step import JaxStep
            ex = inside
            exchange = during = options = None
            inputs = []
            lo, hi = self.part(part)
            if ex is not None and overlap:
                # With the shared shadow as an input, XLA's update applies the correction
                # itself (pympgu.xla.correct_during).
                shadow = ex.shadow()
                inputs = [] if shadow is None else [shadow]

                def during(old, compute, *args, inputs=()):
                    def ordered(*args):
                        # correct_during takes the averaged entries' successors first; the
                        # rest of the new state follows, so that XLA's update of all of it
                        # (the parameters' reads the momentum's) stays one elementwise tail
                        # for the correction to join.
                        new, outs = compute(*args)
                        return new[lo:hi] + new[:lo] + new[hi:], (new, outs)

                    # The rest of the state need not wait for the start.
                    fixed, (new, outs) = ex.correct_during(
                        old[lo:hi], ordered, *args, shadow=inputs[0] if inputs else None,
                        ready=old[:lo] + old[hi:])
                    return new[:lo] + fixed + new[hi:], outs
            elif ex is not None and gradients:
                shadow = ex.shadow(correction=False)
                inputs = [] if shadow is None else [shadow]
                # Every rank computes the update from the same mean gradients, so every
                # rank must compile it to the same kernels (pympgu.xla.alike).
                options = xla.alike_options()

                def exchange(compute, which, *args, local=(), inputs=()):
                    # The whole state's update from the mean gradients; where the update
                    # does not allow it, `part` averaged after the step.
                    return ex.average_gradients(
                        compute, which, which[lo:hi], *args,
                        shadow=inputs[0] if inputs else None, local=local,
                        exact=self.model.affine_update, alike=options is not None)
            elif ex is not None:
                def exchange(compute, which, *args, local=()):
                    return ex.average_results(compute, which[lo:hi], *args)
            # A worker alone gives XLA its state to write the new one over, as a JAX user's
            # step does; beside others, the exchange may still read it (docs/DECISIONS.md,
            # "The state donated").
            alone = ex is None and self.ctx.nranks == 1
            fn = self._steps[key] = JaxStep(self.train_fn, self.model.state, exchange, during,
                                            inputs, options, donate=alone)
        return fn

    def device_batches(self, batches):
        """The minibatches' indices where the step reads them: on the GPU, uploaded once
        here rather than at every call."""
        if self.jax is None:
            return batches
        return [self.jax.device_put(b) for b in batches]

    def values(self):
        return [s.get_value(borrow=True) for s in self.model.state]

    def digest(self, each=False):
        """A hash of the whole state, equal on every rank when the replicas are; ``each``:
        one short hash per array, by name, to show which ones differ."""
        arrays = [self.np.asarray(v).tobytes() for v in self.values()]
        if each:
            return ", ".join(f"{s.name} {hashlib.sha256(a).hexdigest()[:12]}"
                             for s, a in zip(self.model.state, arrays))
        return hashlib.sha256(b"".join(arrays)).hexdigest()

    def set_values(self, values):
        for s, v in zip(self.model.state, values):
            _assign(s, v)

    def wait(self):
        if self.jax is not None:
            self.jax.block_until_ready(self.values())

    def exchange(self, ex, reach="world", part="state"):
        """Average ``part`` of the state (Replica.part: by default parameters and momentum)
        with every other replica (``reach``: see Exchanger.start; host exchanges)."""
        lo, hi = self.part(part)
        values = list(self.values())
        self._start(ex, values[lo:hi], part, reach)
        self.set_values(values[:lo] + list(self._adopt(ex, hi - lo)) + values[hi:])

    def adopt(self, ex, root=None, source=None):
        """Take rank ``root``'s whole state (CPU workers), or node ``source``'s (``ex``
        the exchange that meets the other nodes): a joining worker's, or a joining node's,
        first exchange."""
        ex.start(self._on_host(ex, self.values()), root=root, source=source)
        self.set_values(self._adopt(ex, len(self.model.state)))

    def _on_host(self, ex, values):
        """``values`` as a host exchange takes them: a GPU's cross to the host in one call
        (GPU workers' exchange between nodes, every H steps)."""
        if self.jax is not None and not self.ctx.is_cpu and ex.on_host:
            return self.jax.device_get(list(values))
        return values

    def _start(self, ex, values, part, reach="world"):
        lo, hi = self.part(part)
        if self.jax is None or ex.on_host:
            # CPU JAX arrays are host memory already: pack reads them where they are
            # (docs/DECISIONS.md, "One export of the state").
            ex.start(self._on_host(ex, values), entries=(lo, hi), reach=reach)
        else:
            # JAX packs its arrays into one (a jitted concatenation) and hands pympgu a
            # single DLPack export: one more pass on the GPU, and one export's host time
            # rather than one per array (docs/DECISIONS.md, "One export of the state").
            ex.start(self._jitted(ex, "pack", hi - lo)(values), flat=True, entries=(lo, hi))

    def exchange_start(self, ex, part="state"):
        """Start averaging the current values of ``part`` (Replica.part); training may go on
        while it runs (--overlap)."""
        lo, hi = self.part(part)
        self.started = part
        self.snapshot = self.values()[lo:hi]
        if self.jax is None:
            # PyTensor's C backend updates shared variables in place: keep a copy. JAX
            # arrays are immutable, so holding them is enough.
            self.snapshot = [self.np.array(v, copy=True) for v in self.snapshot]
        self._start(ex, self.snapshot, part)

    def exchange_correct(self, ex, stepped=True):
        """Finish the exchange begun by exchange_start, after `stepped` training steps.

        The steps taken since then are kept and the average replaces what they started
        from: values += average - snapshot (the one-step-delayed correction). With no step
        taken in between (stepped False), the values simply become the average, so every
        replica is identical again. Only the part that was sent changes.
        """
        lo, hi = self.part(self.started)
        now, snap, self.snapshot = list(self.values()), self.snapshot, None
        if not stepped:
            fixed = self._adopt(ex, hi - lo)
        elif self.ctx.is_cpu:
            fixed = [v + (a - s) for v, a, s in zip(now[lo:hi], ex.finish(), snap)]
        else:
            flat = self.jax.dlpack.from_dlpack(ex.finish(flat=True, wait=False))
            fixed = self._jitted(ex, "correct", hi - lo)(now[lo:hi], flat, snap)
        self.set_values(now[:lo] + list(fixed) + now[hi:])

    def _adopt(self, ex, k):
        """Finish ex and return its result (k arrays) as this backend's arrays."""
        if self.ctx.is_cpu:
            return ex.finish()
        if ex.on_host:  # back to the GPU: copies, the host buffers being reused
            return [self.jnp.array(a) for a in ex.finish()]
        # One DLPack import of pympgu's whole buffer, then one jitted split into JAX-owned
        # arrays (jit outputs never alias its inputs): the buffer is reused by the next
        # exchange, so JAX must not keep pointing into it (docs/DECISIONS.md, "One export of
        # the state"). Nothing waits here:
        # the import orders JAX's stream after the average (the DLPack stream handshake),
        # and the next exchange's pack waits for arrays computed from the split's output,
        # so the split has read the buffer before it is overwritten.
        return self._jitted(ex, "split", k)(
            self.jax.dlpack.from_dlpack(ex.finish(flat=True, wait=False)))

    def _jitted(self, ex, what, k):
        """The jitted pack ('pack'), split ('split') or overlap correction ('correct') for
        the first k entries of ex's layout (where any k entries of their shapes go)."""
        key = (id(ex), what, k)
        fn = self._jit_cache.get(key)
        if fn is None:
            pieces = [(off, size, tuple(shape)) for (_, shape, _), off, size
                      in zip(ex.layout[:k], ex.offsets, ex.sizes)]

            def split(flat):
                return [flat[o:o + n].reshape(shape) for o, n, shape in pieces]

            if what == "pack":
                jnp = self.jnp
                ends = [*ex.offsets[1:], ex.total][:k]
                fn = self.jax.jit(lambda values: jnp.concatenate([
                    jnp.pad(v.reshape(-1), (0, end - o - n))
                    for v, (o, n, _), end in zip(values, pieces, ends)]))
            elif what == "split":
                fn = self.jax.jit(split)
            else:
                fn = self.jax.jit(lambda now, flat, snap: [
                    v + (a - s) for v, a, s in zip(now, split(flat), snap)])
            self._jit_cache[key] = fn
        return fn

    def errors(self):
        """(validation error, test error) of the replica as it now is."""
        from ..models import error_rates, statistics_batches
        # Batch norms' population statistics, from the parameters as they now are.
        self.model.estimate_statistics(statistics_batches(
            len(self.dataset.train[1]), self.cfg.batch_size, self.cfg.bn_examples))
        return error_rates(self.eval_fn, len(self.dataset.valid[1]), len(self.dataset.test[1]),
                           self.eval_batch)

    @property
    def layout(self):
        """The Exchanger layout of the replica's state: parameters, then the optimizer's."""
        return [(s.name, list(s.get_value(borrow=True).shape), "float32")
                for s in self.model.state]

    def save(self, out, epoch, history, extra=None):
        """This replica as the checkpoint of ``epoch`` in ``out`` (an OutDir), with
        ``extra`` arrays (checkpoint.save's)."""
        checkpoint.save(out, self.model, self.values(), epoch, history, extra=extra)

    def load(self, path):
        epoch, history, values = checkpoint.read(path, self.model)
        if self.jax is not None:
            values = [self.jnp.asarray(v) for v in values]
        self.set_values(values)
        return epoch, history

