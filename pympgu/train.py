"""Train one network on several GPUs (or CPU workers) by data parallelism.

    python -m pympgu.train --gpus 0 1            # one worker per GPU
    python -m pympgu.train --cpu 2               # two CPU workers, no GPU needed
    python -m pympgu.train                       # every visible GPU, else 2 CPU workers
    python -m pympgu.train --model examples/residual_mlp.py:ResidualMLP   # your own model
    python -m pympgu.train --out runs/a && python -m pympgu.evaluate runs/a   # then its errors

Each worker trains a replica on its own minibatches (disjoint shards of every epoch); every
--sync-every steps the replicas' parameters and momentum (or Adam's moments) are averaged
GPU to GPU by pympgu's fused kernel (CPU workers: through shared memory). Without
--data-dir the MNIST test set shipped with pympgu is used, so it runs offline.
"""
import argparse
import hashlib
import json
import os
import shutil
import sys
import time
import warnings

from .precision import DTYPES as COMPUTE_DTYPES
from .models import OPTIMIZERS, STATISTICS_EXAMPLES
from .schedule import SCHEDULES
from .xla import BESIDE_BLOCKS, copies_to_every_peer, overlap_whole

PRESETS = {
    # The 2014 seed: MLP 784-500-10, plain SGD, lr 0.13, batch 5000, L2 1e-4, 10 epochs.
    "dual_mlp": dict(hidden=[500], lr=0.13, momentum=0.0, batch_size=5000, l1=0.0, l2=1e-4,
                     epochs=10),
}
DEFAULTS = dict(hidden=[500], lr=0.05, momentum=0.9, batch_size=128, l1=0.0, l2=1e-4, epochs=5,
                optimizer="sgd", nesterov=False, beta2=0.999, weight_decay=0.0, clip_norm=0.0,
                ema=0.0, patience=0,
                schedule="constant", warmup=0.0,
                dropout=0.0, label_smoothing=0.0, flip=False, shift=0,
                bn_examples=STATISTICS_EXAMPLES)
# Adam's (and AdamW's) learning rate when --lr is not given: SGD's would be far too large.
ADAM_LR = 1e-3
# AdamW's --weight-decay when not given: torch.optim.AdamW's default.
ADAMW_DECAY = 1e-2
# How many steps' learning rates Replica.apply_rate puts on the device at once.
RATES_AHEAD = 256
# What every rank builds its model with (pympgu.models.Model): replicas start identical.
MODEL_SEED = 1234
CHECKPOINT = "checkpoint.npz"
BEST = "best.npz"  # the checkpoint of the epoch of least validation error
CONFIG = "config.json"  # the run's flags, from which pympgu.evaluate builds its model
# A fresh run's config.json while the directory still holds an earlier run's checkpoints:
# rank 0 moves it into place beside its own first checkpoint.
CONFIG_NEXT = "config.json.next"


def optimizer_defaults(name):
    """What the optimizer ``name`` changes in DEFAULTS (or a preset) when its flags are not
    given: Adam's and AdamW's learning rate, AdamW's decay, and no L2 penalty for either.
    Adam divides a penalty's gradient by its second moment; the seed's 1e-4 cost Adam 1.8
    points of test error on the wide MLP (Fashion-MNIST, 10 epochs: 14.21% against 12.45%
    without; docs/TRAINING.md), as torch.optim.Adam's and AdamW's defaults have none."""
    if name == "sgd":
        return {}
    decay = {"weight_decay": ADAMW_DECAY} if name == "adamw" else {}
    return dict(lr=ADAM_LR, l2=0.0, **decay)


# ---------------------------------------------------------------- the worker

def _setup_backend(ctx, backend):
    """Environment for PyTensor and JAX in this worker; must run before they are imported."""
    if backend == "jax":
        os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
        # PyTensor asks for float64 accumulators of float32 sums (and int64 indices); JAX,
        # without x64, keeps 32 bits and warns at every compile, three times a worker,
        # about what no user can change: the step is float32 on GPUs as intended.
        warnings.filterwarnings("ignore", category=UserWarning,
                                message=r"Explicitly requested dtype (float64|int64) "
                                        r"requested in astype is not available")
        # Said once per compile of a step that draws (Model.dropout): models.seed_noise
        # seeds the copy that the JAX program reads, as intended.
        warnings.filterwarnings("ignore", category=UserWarning,
                                message=r"The RandomType SharedVariables .* will not be used")
        # On GPUs JAX sees every GPU, as pympgu's own CUDA context must (IPC to the peers),
        # and Replica makes this rank's GPU its default device. Restricting JAX to one GPU
        # (jax_cuda_visible_devices) would save it a context on each other GPU, but JAX
        # 0.11.2 then fails on the rank of GPU 1: "Device id 1 is out of range [0, 1)".
        if ctx.device is None:
            os.environ["JAX_PLATFORMS"] = "cpu"
    # Workers compile the same graphs at once; separate cache dirs avoid lock waits.
    flags = os.environ.get("PYTENSOR_FLAGS", "")
    if "compiledir" not in flags and ctx.nranks > 1:
        base = os.path.expanduser("~/.pytensor")
        flags = ",".join(f for f in (flags, f"base_compiledir={base}/rank{ctx.rank}") if f)
        os.environ["PYTENSOR_FLAGS"] = flags


def _jax_device(jax, ctx):
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
    if isinstance(value, __import__("numpy").ndarray):
        shared.set_value(value, borrow=True)
    else:
        shared.container.storage[0] = value


def build_model(cfg, ds):
    """The run's model for the dataset ``ds`` (pympgu.models.build), with its optimizer."""
    from . import models
    return models.build(cfg.get("model"), ds.n_in, cfg["hidden"], ds.n_classes, seed=MODEL_SEED,
                        optimizer=cfg.get("optimizer", "sgd"), beta2=cfg.get("beta2", 0.999),
                        weight_decay=cfg.get("weight_decay", 0.0),
                        nesterov=cfg.get("nesterov", False),
                        clip_norm=cfg.get("clip_norm", 0.0), ema=cfg.get("ema", 0.0),
                        dropout=cfg.get("dropout", 0.0), flip=cfg.get("flip", False),
                        label_smoothing=cfg.get("label_smoothing", 0.0),
                        shift=cfg.get("shift", 0))


class Replica:
    """One worker's model, its compiled functions, and its share of each epoch."""

    def __init__(self, ctx, cfg):
        import numpy as np

        from . import data, precision
        self.np, self.ctx, self.cfg = np, ctx, cfg
        self.dataset = data.load(cfg["data"])
        ds = self.dataset
        self.model = build_model(cfg, ds)
        mode = precision.mode(cfg.get("compute_dtype"), cfg["backend"])
        self.eval_batch = min(500, len(ds.valid[1]) + len(ds.test[1]))
        self.train_fn, self.eval_fn = self.model.compile(
            ds, cfg["batch_size"], self.eval_batch, cfg["lr"], cfg["momentum"], cfg["l1"],
            cfg["l2"], mode)
        # What model.rate_vars hold (apply_rate): the step size, and AdamW's decay.
        self.applied = tuple(np.float32(v.get_value()) for v in self.model.rate_vars)
        self._rates = {}  # step: (schedule, its rate, the rates applied, those on the device)
        self._split_rates = None  # jitted: an array of rates into scalars (apply_rate)
        self.jax = None
        self._jit_cache = {}
        self._steps = {}
        if cfg["backend"] == "jax":
            import jax
            import jax.numpy as jnp
            self.jax, self.jnp = jax, jnp
            if ctx.device is not None:
                # Whatever JAX sees, everything this rank computes goes to its own GPU:
                # arrays put without a device, and every jit whose inputs are such arrays.
                jax.config.update("jax_default_device", _jax_device(jax, ctx))
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
            # scalars on the device by one jitted call. On an H200 the wide MLP's step took
            # 0.583 ms against 0.578 with one scalar put before each step, and 0.596-0.606
            # with a list of 256 scalars put at once (each its own transfer, the host held
            # long enough for the GPU to run dry; docs/BENCHMARKS.md, session 29).
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
        from .models import seed_noise
        seed_noise(self.train_fn, self.cfg["seed"], self.ctx.rank, epoch)

    def _check_device(self, array):
        """Fail if JAX put the model on another GPU than this rank's.

        JAX, left to itself, uses the first GPU it sees: every rank would compute there,
        and each step would pull data across the link.
        """
        from . import cuda
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

    def step(self, idx, ex=None, part="state", overlap=False, gradients=False):
        """One training step on the minibatch idx; returns its cost.

        With JAX the compiled program is called directly (pympgu.jaxstep), so that given
        ex the step also averages ``part`` of the state (Replica.part) with every rank
        inside the same jitted call (Exchanger.xla_average_results; see Sync for when the
        parameters alone are enough). With ``gradients`` (every rank starts the step from
        the same state) its update takes the ranks' mean gradients instead, where the
        update allows (Exchanger.xla_average_gradients). With overlap it averages the
        values it starts from while it computes, and corrects its result by that average
        (--overlap).
        """
        if self.jax is None:
            return self.train_fn(idx)
        return self.jax_step(ex, part, overlap, gradients)(idx)

    def jax_step(self, ex=None, part="state", overlap=False, gradients=False):
        """The JaxStep that step() calls for these arguments, built once."""
        key = (ex is not None, part, overlap, gradients)
        fn = self._steps.get(key)
        if fn is None:
            from . import xla
            from .jaxstep import JaxStep
            exchange = during = options = None
            inputs = []
            lo, hi = self.part(part)
            if ex is not None and overlap:
                # With the shared shadow as an input, XLA's update applies the correction
                # itself (pympgu.xla.correct_during).
                shadow = ex.xla_shadow()
                inputs = [] if shadow is None else [shadow]

                def during(old, compute, *args, inputs=()):
                    def ordered(*args):
                        # correct_during takes the averaged entries' successors first; the
                        # rest of the new state follows, so that XLA's update of all of it
                        # (the parameters' reads the momentum's) stays one elementwise tail
                        # for the correction to join.
                        new, outs = compute(*args)
                        return new[lo:hi] + new[:lo] + new[hi:], (new, outs)

                    # The rest of the state need not wait for the start (xla._hold).
                    fixed, (new, outs) = ex.xla_correct_during(
                        old[lo:hi], ordered, *args, shadow=inputs[0] if inputs else None,
                        ready=old[:lo] + old[hi:])
                    return new[:lo] + fixed + new[hi:], outs
            elif ex is not None and gradients:
                shadow = ex.xla_shadow(correction=False)
                inputs = [] if shadow is None else [shadow]
                # Every rank computes the update from the same mean gradients, so every
                # rank must compile it to the same kernels (pympgu.xla.ALIKE_OPTIONS).
                options = xla.alike_options()

                def exchange(compute, which, *args, local=(), inputs=()):
                    # The whole state's update from the mean gradients; where the update
                    # does not allow it, `part` averaged after the step.
                    return ex.xla_average_gradients(
                        compute, which, which[lo:hi], *args,
                        shadow=inputs[0] if inputs else None, local=local,
                        exact=self.model.affine_update, alike=options is not None)
            elif ex is not None:
                def exchange(compute, which, *args, local=()):
                    return ex.xla_average_results(compute, which[lo:hi], *args)
            fn = self._steps[key] = JaxStep(self.train_fn, self.model.state, exchange, during,
                                            inputs, options)
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

    def exchange(self, ex):
        """Average parameters and momentum with every other replica."""
        self._start(ex, self.values(), "state")
        self.set_values(self._adopt(ex, len(self.model.state)))

    def _start(self, ex, values, part):
        lo, hi = self.part(part)
        if self.jax is None or self.ctx.is_cpu:
            # CPU JAX arrays are host memory already: pack reads them where they are. The
            # jitted concatenation below took 5.7 ms a step there (the MLP's 3.2 MB), more
            # than the step itself.
            ex.start(values, entries=(lo, hi))
        else:
            # JAX packs its arrays into one (a jitted concatenation) and hands pympgu a
            # single DLPack export: one more pass on the GPU, but 0.1 ms of host time per
            # exchange instead of 0.3-0.5 ms for twelve exports (docs/BENCHMARKS.md).
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
        # One DLPack import of pympgu's whole buffer, then one jitted split into JAX-owned
        # arrays (jit outputs never alias its inputs): the buffer is reused by the next
        # exchange, so JAX must not keep pointing into it. Importing and copying each array
        # on its own cost about 0.12 ms per array (docs/BENCHMARKS.md). Nothing waits here:
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
        from .models import error_rates, statistics_batches
        # Batch norms' population statistics, from the parameters as they now are.
        self.model.estimate_statistics(statistics_batches(
            len(self.dataset.train[1]), self.cfg["batch_size"],
            self.cfg.get("bn_examples", STATISTICS_EXAMPLES)))
        return error_rates(self.eval_fn, len(self.dataset.valid[1]), len(self.dataset.test[1]),
                           self.eval_batch)

    def save(self, path, epoch, history):
        np = self.np
        arrays = {s.name: np.asarray(v) for s, v in zip(self.model.state, self.values())}
        # The norms' population statistics that the epoch's errors were evaluated with.
        arrays.update({s.name: s.get_value() for s in self.model.statistics})
        tmp = path + ".tmp"
        with open(tmp, "wb") as f:
            np.savez(f, __epoch__=epoch, __history__=json.dumps(history),
                     __model__=self.model.describe(), __optimizer__=self.model.optimizer,
                     **arrays)
        os.replace(tmp, path)  # atomic: a crash leaves the previous checkpoint intact

    def load(self, path):
        epoch, history, values = read_checkpoint(path, self.model)
        if self.jax is not None:
            values = [self.jnp.asarray(v) for v in values]
        self.set_values(values)
        return epoch, history


def read_checkpoint(path, model, use="--resume {path}: cannot resume from it", variables=None,
                    note=None):
    """(epoch, history, values of ``variables``: ``model``'s state by default) from a
    checkpoint that Replica.save wrote, or a ValueError, ``use`` (formatted with the path)
    and what does not fit this model. ``note`` is called with a line when the checkpoint
    fits but another optimizer trained it (Adam's moments serve AdamW as they are, and
    back), which nothing else would tell."""
    import numpy as np
    made = None
    try:
        with np.load(path) as f:
            epoch = int(f["__epoch__"])
            history = json.loads(str(f["__history__"]))
            # The optimizer saved since session 29; SGD before.
            saved = str(f["__optimizer__"]) if "__optimizer__" in f.files else "sgd"
            made = str(f["__model__"]) if "__model__" in f.files else None
            if made:
                made += f", trained by {saved}"
            values, started = [], False
            averaged = {id(a): p.name for p, a in zip(model.params, model.averages)}
            for s in model.state if variables is None else variables:
                name = s.name
                if name not in f.files and id(s) in averaged:
                    # Saved without --ema: this run starts the average at its parameters.
                    name, started = averaged[id(s)], True
                if name not in f.files:
                    raise ValueError(f"it has no {name!r}")
                v = f[name]
                if v.shape != s.get_value(borrow=True).shape:
                    raise ValueError(f"{s.name!r} is {v.shape}, this model's is "
                                     f"{s.get_value(borrow=True).shape}")
                values.append(v.astype(np.float32))
    except (OSError, ValueError, KeyError) as e:
        # Checkpoints since session 28 say which model made them.
        builds = f"{model.describe()}, trained by {model.optimizer}"
        other = f" (it holds {made}; this run builds {builds})" if made and made != builds else ""
        raise ValueError(f"{use.format(path=path)}: {e}{other}") from None
    if note and saved != model.optimizer:
        note(f"{path}: its state was trained by {saved}; this run goes on by {model.optimizer}")
    if note and started:
        note(f"{path}: it holds no moving average of the parameters; this run starts one at "
             "them (--ema)")
    return epoch, history, values


def same_start(every, overlap):
    """Whether every rank starts each step from the same state (an exact exchange after
    every step): the gradients' road, the one on which a half-precision wire also enters
    the step's XLA call."""
    return every == 1 and not overlap


class Sync:
    """When and how a replica meets the others: every ``every`` steps, plainly or overlapped.

    Plain: average, carry on. Overlapped: start averaging the current values, so that the
    next step computes while it runs, and after that step apply the average with the
    one-step-delayed correction. On GPUs nothing waits on the host: the work is queued in
    order on the streams. ``seconds`` adds up the host time the training loop spends here
    (on GPUs, queueing, plus any wait when the host is an exchange ahead). The epoch's last
    exchange is plain, so that replicas end identical.

    Overlapped with every = K > 1, the whole state crosses once a cycle, during the due
    step (the K-th), and is corrected after it. While kernels moved the bytes the whole
    state stalled that step (160 MB for the wide MLP: 0.81 ms against 0.58; session 11);
    since the copy engines move them it lands within the step, and on 2 H200s the cycle ran
    faster than with the state in halves in 11 of 12 pairs of alternating runs (the twelfth
    level), by 0.0021 ms a step at the median (sessions 24 and 25): one exchange's
    operations fewer a cycle. PYMPGU_OVERLAP_WHOLE=0 (pympgu.xla.overlap_whole) sends the
    momentum during the due step and the parameters during the next, half the state each,
    as --overlap's every step does: it spreads the traffic over two steps, for a model
    whose whole state takes longer than a step to cross. On CPU, Fashion-MNIST, momentum
    0.9, K = 4, the whole state trained to 16.20% test error, the halves to 16.28%, plain
    averaging to 15.96% (session 25). No correction comes later than the step after its
    start: kept K steps, a late correction made training unstable (31% test error; 17.4%
    two steps late; session 11).

    Exchanges of JAX workers are ``fused``: the average runs inside the step's own jitted
    call (Exchanger.xla_average_results, xla_correct_during), so no separate exchange is
    queued at all and its host time is part of the step's; an overlapped one spans the step
    whose call it is in. The fp32 wire and the kernel methods allow fusing, and a
    half-precision wire does with every=1, not overlapped, where the gradients cross in it
    (below); fuse=False (PYMPGU_XLA_EXCHANGE=0 in pympgu.train) turns it off.

    Fused with every=1, an exchange averages the parameters alone (half the bytes) and each
    rank keeps its own momentum, except at the epoch's last step, which averages everything
    so that replicas end identical. That changes nothing but rounding: when the parameters
    are averaged after every step, p' = mean(p + v_r') = p + mean(v_r'), and mean(v_r')
    obeys the same recurrence (mu * mean(v_r) - lr * mean(g_r)) as an averaged momentum
    would, from the same start. This is why data-parallel SGD needs only the gradients.
    Overlapped, the same holds of the replicas' mean: p_r' = mean(p) + v_r', so mean(p') =
    mean(p) + mean(v'). With every > 1 the argument fails and the momentum is averaged too:
    keeping it local there (local SGD's model averaging) cost 0.74 points of test error on
    Fashion-MNIST (docs/BENCHMARKS.md, session 8).

    That argument needs an update affine in the gradients: with Adam, or gradients clipped
    by their norm (Model.affine_update False), every exchange averages the whole state,
    Adam's moments or SGD's momentum too.

    Fused with every=1 and not overlapped, every rank starts each step from the same state,
    so the step takes the ``gradients`` road where it can (Exchanger.xla_average_gradients):
    the update of every rank reads the ranks' mean gradient, as DDP's does, and the whole
    state, momentum too, stays identical on every rank. For an update affine in its
    gradients (SGD with momentum) that is the same trajectory again, up to rounding; the
    parameters' own average after the update remains where it does not apply. Adam's
    update is not affine (nor a clipped one), and there the road changes what is computed:
    Adam's step on the mean gradient, DDP's Adam (the norm of the mean gradient, DDP's
    clip_grad_norm_), at every size of model (elsewhere: on CPU workers, outside
    the step's XLA call, overlapped or with every > 1, each replica takes its own Adam step
    and the whole state is averaged).
    """

    def __init__(self, rep, ex, every=1, overlap=False, fuse=True):
        self.rep, self.ex, self.every, self.overlap = rep, ex, every, overlap
        self.seconds = 0.0
        self.stepped = False  # a step was taken since the pending exchange started
        self.fused = (fuse and ex is not None and rep.jax is not None
                      and ex.xla_unavailable(gradients=same_start(every, overlap)) is None)
        self.whole = overlap_whole()
        # SGD's momentum may stay local (below), Adam's moments may not.
        self.params_only = (self.fused and every == 1  # but the epoch's last exchange
                            and rep.model.affine_update)
        self.gradients = self.fused and same_start(every, overlap)

    @property
    def outside(self):
        """Why a GPU worker's exchanges are queued from Python after its steps rather than
        run inside their XLA call (half the wide MLP's speed on 2 H200s, docs/BENCHMARKS.md),
        in words; None where they run inside, or where there is no XLA call to join (CPU
        workers)."""
        if self.fused or self.ex is None or self.rep.ctx.is_cpu:
            return None
        if self.rep.jax is None:
            return "PyTensor's C backend has no XLA call"
        return self.ex.xla_unavailable() or "turned off (PYMPGU_XLA_EXCHANGE=0)"

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
            return "state" if self.whole else "momentum"
        if t and not t % self.every and not self.whole:
            return "params"
        return None

    def step(self, idx, step, last=False):
        """Training step `step` (counted from 0) of an epoch on minibatch idx, then the
        exchange if one is due (`last` forces one); returns the step's cost."""
        if not self.fused:
            cost = self.rep.step(idx)
            self.after_step(step, last)
            return cost
        if last:  # the whole state, plain: replicas end identical
            return self.rep.step(idx, self.ex, gradients=self.gradients)
        if self.overlap:
            part = self.spanning(step)
            if part is None:
                return self.rep.step(idx)
            return self.rep.step(idx, self.ex, part, overlap=True)
        if not (step + 1) % self.every:
            return self.rep.step(idx, self.ex, "params" if self.params_only else "state",
                                 gradients=self.gradients)
        return self.rep.step(idx)

    def after_step(self, step, last=False):
        """Call after step `step` (counted from 0) of an epoch; `last` forces a sync."""
        self.stepped = True
        if self.ex is None:
            return
        due = (not (step + 1) % self.every and not self.overlap) or last
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
            self.rep.exchange(self.ex)
        self.seconds += time.perf_counter() - t0

    def drain(self):
        """Finish an overlapped exchange: afterwards every replica holds the same values."""
        if self.ex is not None and self.ex.pending:
            t0 = time.perf_counter()
            self.rep.exchange_correct(self.ex, self.stepped)
            self.seconds += time.perf_counter() - t0


def state_layout(rep):
    """The Exchanger layout of a replica's state: parameters, then momentum."""
    return [(s.name, list(s.get_value(borrow=True).shape), "float32") for s in rep.model.state]


def make_schedule(cfg, ntrain, nranks):
    """The run's learning rates (pympgu.schedule.Schedule) for ``nranks`` workers sharing
    ``ntrain`` examples (each takes as many steps an epoch, data.shard_batches): --warmup
    is in epochs, and the decay spans --epochs."""
    from . import data
    from .schedule import Schedule
    per_epoch = data.batches_per_epoch(ntrain, cfg["batch_size"], nranks) // nranks
    return Schedule(cfg["lr"], cfg["epochs"] * per_epoch, cfg.get("schedule", "constant"),
                    round(cfg.get("warmup", 0.0) * per_epoch))


def make_exchanger(ctx, rep, cfg):
    """The worker's Exchanger, after one exact exchange (which also proves it works)."""
    from .exchange import Exchanger
    if ctx.nranks == 1:
        return None
    blocks = cfg.get("exchange_blocks")
    if blocks is None and cfg.get("overlap"):
        # The averaging kernel runs beside the next step's kernels, capped as any kernel
        # beside XLA's work is (pympgu.xla.BESIDE_BLOCKS says why).
        blocks = BESIDE_BLOCKS
    # A shared shadow lets the exchanges inside the step's XLA call start as soon as the
    # last layers are computed, and spares the overlapped one its pack ('gather'). It costs
    # nranks - 1 copies of the state on each GPU: only where one of the two will use it.
    shadow = (rep.jax is not None and not ctx.is_cpu and cfg.get("xla_exchange", True)
              and cfg["method"] == "auto" and copies_to_every_peer(ctx.nranks)
              and (cfg["exchange_dtype"] in (None, "float32")
                   or same_start(cfg["sync_every"], cfg.get("overlap"))))
    ex = Exchanger(ctx, state_layout(rep), method=cfg["method"], wire_dtype=cfg["exchange_dtype"],
                   max_blocks=blocks, shadow=shadow)
    try:
        rep.exchange(ex)  # replicas start identical (seed 1234); a resumed run too
    except BaseException:
        ex.close()
        raise
    return ex


def worker(ctx, cfg):
    """The training loop of one worker; returns its summary."""
    _setup_backend(ctx, cfg["backend"])
    from . import data
    rep = Replica(ctx, cfg)
    np = rep.np
    start_epoch, history = 0, []
    if cfg["resume"]:
        start_epoch, history = rep.load(cfg["resume"])
    if ctx.nranks > 1:
        # Data parallelism needs one starting point. The first exchange would average
        # replicas built differently (a model drawing its values elsewhere than from its
        # seed) into a model none of them is: refuse them instead, naming the rank.
        ctx.barrier("initial values (a model must draw them from its seed argument)",
                    rep.digest(each=True))
    ex = make_exchanger(ctx, rep, cfg)
    ntrain = len(rep.dataset.train[1])
    schedule = make_schedule(cfg, ntrain, ctx.nranks)
    try:
        for epoch in range(start_epoch, cfg["epochs"]):
            batches = data.shard_batches(ntrain, cfg["batch_size"], ctx.nranks, ctx.rank,
                                         cfg["seed"], epoch)
            rep.seed_noise(epoch)
            sync = Sync(rep, ex, cfg["sync_every"], cfg["overlap"], cfg.get("xla_exchange", True))
            costs = []
            report_every = max(1, len(batches) // 20)
            t_epoch = time.perf_counter()
            for step, idx in enumerate(rep.device_batches(batches)):
                last = step == len(batches) - 1
                # The run's step, from which a resumed run goes on.
                rate = rep.apply_rate(schedule, epoch * len(batches) + step)
                costs.append(sync.step(idx, step, last))
                if ctx.rank == 0 and (step % report_every == 0 or last):
                    ctx.metric(kind="progress", epoch=epoch + 1, step=step + 1, steps=len(batches))
            sync.drain()
            rep.wait()
            epoch_s = time.perf_counter() - t_epoch
            outside = sync.outside
            loss = float(np.mean([float(c) for c in costs]))
            record = {"epoch": epoch + 1, "loss": loss, "lr": rate, "time_s": epoch_s,
                      "samples_per_s": ctx.nranks * len(batches) * cfg["batch_size"] / epoch_s,
                      "exchange_share": None if sync.fused else sync.seconds / epoch_s,
                      # Which road the step's exchange took inside XLA, in words (None when
                      # no step traced xla_average_gradients), so that a run says whether
                      # the gradients or the parameters crossed, and why; or why it runs
                      # outside XLA (a build without jaxlib's headers, say).
                      "road": (f"queued from Python after the step: {outside}"
                               if outside else None if ex is None else ex.xla_road)}
            if ctx.rank == 0:
                record["valid_error"], record["test_error"] = rep.errors()
                history.append(record)
                ctx.metric(kind="epoch", **record)
                if cfg["out"]:
                    path = os.path.join(cfg["out"], CHECKPOINT)
                    rep.save(path, epoch + 1, history)
                    pending = os.path.join(cfg["out"], CONFIG_NEXT)
                    if epoch == start_epoch and os.path.exists(pending):  # run() wrote it
                        os.replace(pending, os.path.join(cfg["out"], CONFIG))
                    if all(record["valid_error"] < h["valid_error"] for h in history[:-1]):
                        # The best epoch so far by validation error, kept beside the last:
                        # a copy of the file just written, replaced atomically too.
                        shutil.copyfile(path, path + ".best.tmp")
                        os.replace(path + ".best.tmp", os.path.join(cfg["out"], BEST))
            if cfg.get("patience"):
                # Rank 0 alone evaluates, so it decides, and every rank stops after the
                # same epoch, the replicas identical.
                stop = ctx.rank == 0 and epochs_since_best(history) >= cfg["patience"]
                if ctx.barrier(shared=stop):
                    break
        # Replicas must end identical: a digest per rank lets the launcher's caller check.
        digest = rep.digest()
    finally:
        if ex is not None:
            ex.close()
    return {"rank": ctx.rank, "history": history if ctx.rank == 0 else None,
            "digest": digest}


def epochs_since_best(history):
    """Epochs since the one of least validation error in ``history`` (the first of equals,
    the one best.npz keeps): 0 when the last epoch is the best."""
    errors = [h["valid_error"] for h in history]
    return len(errors) - 1 - errors.index(min(errors))


# ---------------------------------------------------------------- the launcher side

class Reporter:
    """Prints the progress bar and one line per epoch; appends metrics.jsonl."""

    def __init__(self, out, epochs, stream=sys.stderr, quiet=False, resume=False, rates=False):
        # A resumed run adds its epochs to the log; a fresh one starts it over, at its first
        # epoch, when its worker replaces the checkpoint too: until then the directory
        # still holds the earlier run whole.
        self.path, self.mode = (os.path.join(out, "metrics.jsonl") if out else None,
                                "a" if resume else "w")
        self.metrics = None
        self.epochs, self.stream, self.quiet = epochs, stream, quiet
        self.tty = stream.isatty()
        self.road = None  # the exchange's road last printed
        self.rates = rates  # the learning rate changes: print each epoch's last

    def __call__(self, rank, data):
        kind = data.pop("kind", None)
        data.pop("rank", None)
        if kind == "progress" and self.tty and not self.quiet:
            width = 30
            done = int(width * data["step"] / data["steps"])
            self.stream.write(f"\repoch {data['epoch']}/{self.epochs} "
                              f"[{'#' * done}{'.' * (width - done)}] {data['step']}/{data['steps']}")
            self.stream.flush()
        elif kind == "epoch":
            if self.tty and not self.quiet:
                self.stream.write("\r" + " " * 70 + "\r")
            share = data["exchange_share"]
            share = "in the step" if share is None else f"{100 * share:5.1f}%"
            print(f"epoch {data['epoch']:3d}  loss {data['loss']:.4f}  "
                  f"valid {100 * data['valid_error']:6.2f}%  test {100 * data['test_error']:6.2f}%  "
                  f"{data['samples_per_s']:9.0f} samples/s  exchange {share}" +
                  (f"  lr {data['lr']:.3g}" if self.rates else ""), flush=True)
            if data.get("road") and data["road"] != self.road:  # once, and if it changes
                self.road = data["road"]
                print(f"          exchange: {self.road}", flush=True)
            if self.path:
                if self.metrics is None:
                    self.metrics = open(self.path, self.mode)
                self.metrics.write(json.dumps(data) + "\n")
                self.metrics.flush()

    def close(self):
        if self.metrics:
            self.metrics.close()


def plot(history, path):
    """Loss and error curves as a PNG (skipped, with a note, without matplotlib)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("pympgu: matplotlib is not installed; no plot written", file=sys.stderr)
        return
    epochs = [h["epoch"] for h in history]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    a.plot(epochs, [h["loss"] for h in history], marker="o")
    a.set_xlabel("epoch")
    a.set_ylabel("training loss")
    b.plot(epochs, [100 * h["valid_error"] for h in history], marker="o", label="validation")
    b.plot(epochs, [100 * h["test_error"] for h in history], marker="o", label="test")
    b.set_xlabel("epoch")
    b.set_ylabel("error (%)")
    b.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def build_parser():
    from .exchange import METHODS
    p = argparse.ArgumentParser(prog="python -m pympgu.train", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    where = p.add_argument_group("where to run")
    where.add_argument("--gpus", type=int, nargs="+", metavar="I",
                       help="GPU indexes, one worker each (default: every visible GPU)")
    where.add_argument("--cpu", type=int, metavar="N",
                       help="run N CPU workers instead of GPUs (default when no GPU is usable: 2)")
    where.add_argument("--backend", choices=["auto", "c", "jax"], default="auto",
                       help="PyTensor backend: 'jax' (XLA; GPUs need it) or 'c' (PyTensor's "
                            "own CPU backend, its FAST_RUN mode: compiled by Numba from "
                            "PyTensor 3, by C before) (default: 'jax' wherever JAX is "
                            "installed, CPU workers too, where it ran the MLP about twice and "
                            "the convnets 8 to 10 times as fast as 'c'; else 'c')")
    where.add_argument("--method", choices=list(METHODS), default="auto",
                       help="GPU averaging algorithm: the kernels 'll' (buffers up to 256 KiB), "
                            "'oneshot', 'twoshot' and "
                            "'push' (two-shot by stores), 'ce' (two-shot, every byte by DMA), or "
                            "'copy', the seed's peer-copy method (default: auto, by buffer "
                            "size; for GPU workers from 16 MiB, the step is cut so that the "
                            "last layers' gradients cross the link, by DMA on 2 GPUs and by "
                            "the kernel on more, while the first layers' gradients compute: "
                            "docs/TRAINING.md)")
    where.add_argument("--port", type=int, default=None,
                       help="coordinator port on 127.0.0.1 (default: a free one)")
    d = p.add_argument_group("data")
    d.add_argument("--data-dir", default=None,
                   help="MNIST-format IDX files (gzipped or not), or a path to the seed's "
                        "mnist.pkl.gz; 'fashion' for Debian's Fashion-MNIST; 'digits' for "
                        "scikit-learn's 8x8 digits; CIFAR-10 or CIFAR-100's python version "
                        "(cifar-10-python.tar.gz, the directory it unpacks to, or one "
                        "holding either; 3x32x32 images for a convnet); a .npz of one's "
                        "own with x_train, y_train, x_test, y_test (and optionally x_valid, "
                        "y_valid; docs/MODELS.md) (default: the embedded MNIST test set)")
    m = p.add_argument_group("model and optimiser")
    m.add_argument("--preset", choices=sorted(PRESETS),
                   help="dual_mlp: the 2014 seed's run (MLP 500, lr 0.13, batch 5000, L2 1e-4, "
                        "10 epochs); explicit flags override it")
    m.add_argument("--model", default=None, metavar="FILE.py:CLASS",
                   help="train your own model: a subclass of pympgu.models.Model in a file "
                        "(FILE.py:CLASS) or an importable module (MODULE:CLASS), built in "
                        "every worker as CLASS(n_in, hidden, n_out, seed=...), trained as the "
                        "MLP is (docs/MODELS.md; default: the MLP of --hidden)")
    m.add_argument("--hidden", type=int, nargs="+", metavar="H",
                   help="hidden layer widths, e.g. 4096 4096 (default: "
                        f"{DEFAULTS['hidden'][0]}, or --model's default_hidden)")
    m.add_argument("--epochs", type=int, help=f"epochs (default: {DEFAULTS['epochs']})")
    m.add_argument("--batch-size", type=int, help="minibatch per worker "
                   f"(default: {DEFAULTS['batch_size']})")
    m.add_argument("--optimizer", choices=list(OPTIMIZERS), default=DEFAULTS["optimizer"],
                   help="'sgd': SGD with momentum; 'adam': Adam, whose two moments the "
                        "replicas average with the parameters (on GPUs at --sync-every 1, "
                        "every rank's update reads the mean gradient, as DDP's Adam does; "
                        "docs/TRAINING.md); 'adamw': Adam with decoupled weight decay "
                        "(--weight-decay), as torch.optim.AdamW (default: sgd)")
    m.add_argument("--lr", type=float, help=f"learning rate, the peak of --schedule (default: "
                   f"{DEFAULTS['lr']}; {ADAM_LR} with --optimizer adam or adamw)")
    m.add_argument("--schedule", choices=list(SCHEDULES), default=DEFAULTS["schedule"],
                   help="the learning rate over the run, after --warmup: held at --lr, or "
                        "decayed towards zero at the last step along half a cosine or a line "
                        "(default: constant)")
    m.add_argument("--warmup", type=float, metavar="EPOCHS",
                   help="ramp the learning rate linearly up to --lr over this many epochs "
                        "(fractions allowed), as large data-parallel batches often need "
                        "(default: 0)")
    m.add_argument("--momentum", type=float, help=f"SGD's momentum, or Adam's beta1 (default: "
                   f"{DEFAULTS['momentum']})")
    m.add_argument("--nesterov", action="store_true",
                   help="SGD with Nesterov's momentum, as torch.optim.SGD's nesterov: each "
                        "step moves the parameters by momentum * v - lr * g with the new "
                        "velocity v, looking ahead along it (default: off)")
    m.add_argument("--clip-norm", type=float, metavar="C",
                   help="scale every step's gradients down to a 2-norm of at most C, taken "
                        "over all of them together, as torch.nn.utils.clip_grad_norm_ does "
                        "(with any optimizer). On GPUs at --sync-every 1 it is the norm of "
                        "the ranks' mean gradient, as with DDP; elsewhere each rank clips its "
                        "own before the replicas are averaged (docs/TRAINING.md) (default: "
                        "0, off)")
    m.add_argument("--ema", type=float, metavar="DECAY",
                   help="keep an exponential moving average of the parameters, moved after "
                        "every step by DECAY * average + (1 - DECAY) * parameters (timm's "
                        "ModelEmaV2; 0.999 is usual), and evaluate, checkpoint and choose "
                        "best.npz by it: the errors printed are the average's. The replicas "
                        "average it with the rest of the state (docs/TRAINING.md) "
                        "(default: 0, off)")
    m.add_argument("--beta2", type=float, help=f"Adam's beta2, the decay of its second moment "
                   f"(default: {DEFAULTS['beta2']})")
    m.add_argument("--patience", type=int, metavar="EPOCHS",
                   help="stop once the validation error has not improved for EPOCHS epochs "
                        "(the early stopping of the Theano tutorials); "
                        "best.npz keeps the best epoch, and a resumed run counts the epochs "
                        "before it. A --schedule still decays towards --epochs' last step "
                        "(default: 0, every epoch)")
    m.add_argument("--dropout", type=float, metavar="RATE",
                   help="drop each hidden unit with probability RATE at every training step, "
                        "scaling the rest by 1/(1-RATE); evaluation drops none. The MLP "
                        "drops after each hidden layer, the examples where docs/MODELS.md "
                        "says, a model of one's own where its logits call self.dropout. "
                        "Each rank draws its own masks, from --seed, its rank and the epoch "
                        "(default: 0, off)")
    m.add_argument("--label-smoothing", type=float, metavar="EPS",
                   help="train towards targets of 1 - EPS on the true class and EPS spread "
                        "evenly over all classes (Szegedy et al. 2016; torch's cross_entropy "
                        "label_smoothing), which keeps the logits from growing without end; "
                        "the loss printed is the smoothed one, the errors are as ever "
                        "(default: 0, off)")
    m.add_argument("--flip", action="store_true",
                   help="mirror each training image left to right with probability 1/2, "
                        "every step anew (images of 1 or 3 channels; not digits, whose "
                        "mirror is another glyph) (default: off)")
    m.add_argument("--shift", type=int, metavar="PIXELS",
                   help="move each training image by up to PIXELS pixels each way, every "
                        "step anew, zeros filling in: a random crop of the image padded by "
                        "PIXELS (CIFAR's usual is 4) (default: 0, off). With either, "
                        "evaluation sees the images unvaried, and each rank varies its own, "
                        "reseeded every epoch as --dropout's masks are")
    m.add_argument("--bn-examples", type=int, metavar="N",
                   help="estimate a model's batch norms' population statistics, which "
                        "evaluation normalises by, from N training examples before every "
                        "evaluation (Model.batch_norm; examples/resnet.py). Fewer cost less: "
                        "on a 2-core CPU a small ResNet took 10 s for 8,192, and 512 gave "
                        "the same test error within 0.16 points (default: "
                        f"{STATISTICS_EXAMPLES})")
    m.add_argument("--compute-dtype", choices=list(COMPUTE_DTYPES), default="float32",
                   help="the dtype of matrix products and convolutions: bfloat16 rounds "
                        "their operands and results to bfloat16 and accumulates in float32, "
                        "as torch.autocast does (mixed precision: the tensor cores' "
                        "bfloat16 rate, against TF32's for float32 on GPUs, and half the "
                        "bytes between a product and the work after it); parameters, the "
                        "optimizer's state, the update and the exchange stay float32 "
                        "(--backend jax only; default: float32; docs/TRAINING.md, "
                        "\"Mixed precision\")")
    m.add_argument("--l1", type=float, help="L1 weight penalty (default: 0)")
    m.add_argument("--l2", type=float, help=f"L2 weight penalty (default: {DEFAULTS['l2']}; 0 "
                   "with --optimizer adam or adamw)")
    m.add_argument("--weight-decay", type=float, metavar="WD",
                   help="AdamW's decoupled weight decay: every step multiplies the weights "
                        "(not biases, nor a norm's scale and shift) by 1 - rate * WD, the "
                        "schedule's rate, rather than adding an L2 penalty's gradient that "
                        "Adam would divide by its second moment (--optimizer adamw only; "
                        f"default: {ADAMW_DECAY}, torch.optim.AdamW's)")
    m.add_argument("--sync-every", type=int, default=1, metavar="K",
                   help="average parameters and momentum every K steps (default: 1, the seed's)")
    m.add_argument("--overlap", action="store_true",
                   help="average the parameters each step starts from while it computes "
                        "(GPU workers: inside the step's XLA call, on a side stream, the "
                        "peers' bytes moved by the copy engines on 2 GPUs, by a kernel "
                        "capped at --exchange-blocks on more), then apply the average with a "
                        "one-step-delayed correction, whatever --sync-every is (default: "
                        "off; every average is exact). With K > 1 the whole state crosses "
                        "during the due step. On 2 H200s it runs the wide MLP at 0.62 ms "
                        "per step against 0.68 without, and at 0.61 with --sync-every 4 "
                        "against 0.68 without (one GPU: 0.58), within 0.33 points of the "
                        "same test error (docs/BENCHMARKS.md, docs/TRAINING.md)")
    m.add_argument("--exchange-dtype", choices=["float32", "bfloat16", "float16"],
                   default="float32",
                   help="dtype on the wire: bfloat16 or float16 send half the bytes, while "
                        "parameters and sums stay float32 (default: float32, exact). On GPUs "
                        "with --sync-every 1 the "
                        "gradients cross rounded to it inside the step's XLA call (DDP's "
                        "bf16_compress_hook); otherwise each sync's change crosses in it, "
                        "queued from Python outside the step's XLA call, which on 2 H200s is "
                        "slower than the default")
    m.add_argument("--exchange-blocks", type=int, default=None, metavar="B",
                   help="cap the GPU averaging kernel at B thread blocks (1-512). Fewer blocks "
                        "leave SMs to the training step that runs beside an overlapped "
                        "exchange (inside XLA on 2 GPUs the copy engines move it and it "
                        f"takes no SM) (default: {BESIDE_BLOCKS} with --overlap, else two "
                        "per SM)")
    m.add_argument("--seed", type=int, default=0, help="seed of the minibatch order (default: 0)")
    o = p.add_argument_group("output")
    o.add_argument("--out", default=None, metavar="DIR",
                   help="write config.json, metrics.jsonl, checkpoint.npz (the last epoch's), "
                        "best.npz (the epoch of least validation error) and curves.png here")
    o.add_argument("--resume", default=None, metavar="PATH",
                   help="continue from a checkpoint (a file, or an --out directory)")
    o.add_argument("--quiet", action="store_true", help="no progress bar")
    return p


def resolve(args, parser):
    """The run's configuration and devices from the flags, or a parser error naming the flag."""
    from . import cuda
    cfg = dict(DEFAULTS)
    if args.preset:
        cfg.update(PRESETS[args.preset])
    cfg.update(optimizer=args.optimizer, schedule=args.schedule)
    cfg.update(optimizer_defaults(args.optimizer))  # a preset's rate is SGD's
    if args.optimizer == "sgd" and args.beta2 is not None:
        parser.error("--beta2 is Adam's; give --optimizer adam or adamw with it")
    if args.nesterov and args.optimizer != "sgd":
        parser.error("--nesterov is SGD's momentum; Adam's beta1 is --momentum")
    if args.optimizer != "adamw" and args.weight_decay is not None:
        parser.error("--weight-decay is AdamW's decoupled decay; give --optimizer adamw with "
                     "it (--l2 penalises the weights for sgd and adam)")
    for key in ("hidden", "epochs", "batch_size", "lr", "momentum", "nesterov", "l1", "l2",
                "beta2", "weight_decay", "clip_norm", "ema", "patience", "warmup", "dropout",
                "label_smoothing",
                "flip", "shift", "bn_examples"):
        if getattr(args, key) is not None:
            cfg[key] = getattr(args, key)
    if not cfg["lr"] > 0:
        parser.error(f"--lr must be positive, got {cfg['lr']}")
    if not 0 <= cfg["momentum"] < 1 or not 0 <= cfg["beta2"] < 1:
        parser.error(f"--momentum and --beta2 must be in [0, 1), got {cfg['momentum']} and "
                     f"{cfg['beta2']}")
    if cfg["nesterov"] and not cfg["momentum"] > 0:
        parser.error(f"--nesterov needs a --momentum above 0, got {cfg['momentum']}")
    if not 0 <= cfg["weight_decay"] < 1:
        parser.error(f"--weight-decay must be in [0, 1), got {cfg['weight_decay']}")
    if not cfg["clip_norm"] >= 0:
        parser.error(f"--clip-norm must be 0 (off) or above, got {cfg['clip_norm']}")
    if not 0 <= cfg["ema"] < 1:
        parser.error(f"--ema must be in [0, 1) (0: off), got {cfg['ema']}")
    if cfg["patience"] < 0:
        parser.error(f"--patience must be 0 (off) or more epochs, got {cfg['patience']}")
    if not 0 <= cfg["dropout"] < 1:
        parser.error(f"--dropout must be in [0, 1), got {cfg['dropout']}")
    if not 0 <= cfg["label_smoothing"] < 1:
        parser.error(f"--label-smoothing must be in [0, 1), got {cfg['label_smoothing']}")
    if cfg["shift"] < 0:
        parser.error(f"--shift must be 0 or more pixels, got {cfg['shift']}")
    # Counts first: --warmup is checked against --epochs.
    for key in ("epochs", "batch_size", "sync_every", "bn_examples"):
        value = cfg[key] if key in cfg else getattr(args, key)
        if value < 1:
            parser.error(f"--{key.replace('_', '-')} must be at least 1, got {value}")
    if not 0 <= cfg["warmup"] <= cfg["epochs"]:
        parser.error(f"--warmup must be 0 to --epochs ({cfg['epochs']}), got {cfg['warmup']}")
    try:  # read again by every worker's Sync: a bad value fails here, before any starts
        overlap_whole()
    except ValueError as e:
        parser.error(str(e))
    if args.exchange_blocks is not None and not 1 <= args.exchange_blocks <= 512:
        parser.error(f"--exchange-blocks must be 1 to 512, got {args.exchange_blocks}")
    if args.hidden is None and args.model and not args.preset:
        from . import models
        try:  # the model's own widths (a convnet's channels are not the MLP's 500 units)
            cfg["hidden"] = list(models.load(args.model).default_hidden)
        except models.ModelError as e:
            parser.error(str(e))
    if any(h < 1 for h in cfg["hidden"]):
        parser.error(f"--hidden widths must be positive, got {cfg['hidden']}")
    if args.gpus is not None and args.cpu is not None:
        parser.error("give --gpus or --cpu, not both")
    note = None
    if args.cpu is not None:
        if not 1 <= args.cpu <= 8:
            parser.error(f"--cpu must be 1 to 8, got {args.cpu}")
        devices = [None] * args.cpu
    else:
        ok, info = cuda.availability()
        if args.gpus is not None:
            if not ok:
                parser.error(f"--gpus: no usable GPU here ({info})")
            if len(set(args.gpus)) != len(args.gpus):
                parser.error(f"--gpus: indexes must be distinct, got {args.gpus}")
            bad = [g for g in args.gpus if not 0 <= g < info]
            if bad:
                parser.error(f"--gpus: GPU {bad[0]} does not exist ({info} visible: 0..{info - 1})")
            if len(args.gpus) > 8:
                parser.error("--gpus: at most 8 GPUs")
            devices = list(args.gpus)
        elif ok:
            devices = list(range(min(info, 8)))
        else:
            devices = [None, None]
            note = f"no usable GPU ({info}); running 2 CPU workers"
    cpu = devices[0] is None
    backend = args.backend if args.backend != "auto" else auto_backend(cpu)
    if not cpu and backend != "jax":
        parser.error("--backend c runs on CPUs only; GPU workers use --backend jax")
    if args.compute_dtype != "float32" and backend != "jax":
        parser.error(f"--compute-dtype {args.compute_dtype} needs --backend jax (PyTensor's "
                     "own backend multiplies in its variables' dtype)")
    data = args.data_dir
    if data is not None and data not in ("fashion", "digits") and not os.path.exists(data):
        hint = ""
        if "cifar" in data.lower():  # a name, as 'fashion' is: CIFAR must be downloaded
            hint = (" (pympgu reads CIFAR as its authors ship it: download "
                    "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz, or "
                    "cifar-100-python.tar.gz, and give its path)")
        parser.error(f"--data-dir {data}: no such file or directory{hint}")
    resume = args.resume
    if resume:
        if os.path.isdir(resume):
            resume = os.path.join(resume, CHECKPOINT)
        if not os.path.isfile(resume):
            parser.error(f"--resume {args.resume}: no checkpoint there")
    # Paths made absolute in config.json, so that pympgu.evaluate (and --resume) find the
    # model's file and the data from any directory.
    model = args.model
    if model and model.rpartition(":")[0].endswith(".py"):
        where, _, name = model.rpartition(":")
        model = f"{os.path.abspath(where)}:{name}"
    if data is not None and data not in ("fashion", "digits"):
        data = os.path.abspath(data)
    cfg.update(model=model, data=data, backend=backend, method=args.method,
               sync_every=args.sync_every, overlap=args.overlap,
               exchange_dtype=args.exchange_dtype, exchange_blocks=args.exchange_blocks,
               compute_dtype=args.compute_dtype,
               # An escape hatch, not a flag: the exchange queued from Python, as before
               # it ran inside the step's XLA program.
               xla_exchange=os.environ.get("PYMPGU_XLA_EXCHANGE", "1") != "0",
               seed=args.seed, out=args.out, resume=resume,
               devices=["cpu" if d is None else d for d in devices])
    return cfg, devices, note


def auto_backend(cpu):
    """What --backend auto means: JAX on GPUs, and on CPU workers wherever it is installed,
    where XLA ran the MLP about twice and the convnets 8 to 10 times as fast as PyTensor's
    own backend (docs/MODELS.md, "On CPU workers"); else 'c'."""
    import importlib.util
    return "jax" if not cpu or importlib.util.find_spec("jax") is not None else "c"


class UsageError(ValueError):
    """A flag that cannot be honoured (a batch the dataset cannot fill, an --out that cannot
    be written): main reports it as the parser reports a bad flag. ``flag`` names it."""

    def __init__(self, flag, message):
        super().__init__(message)
        self.flag = flag


def run(cfg, devices, port=None, quiet=False):
    """Launch the workers, report as they go, and return rank 0's history."""
    from . import data, models
    from .control import BindError
    from .launch import launch
    ds = data.load(cfg["data"])  # fail here, with the file's name, before any worker starts
    try:  # and a model that cannot be loaded or built, naming --model
        model = build_model(cfg, ds)
    except models.ModelError as e:
        raise UsageError("--model", str(e)) from None
    if cfg.get("dropout") or cfg.get("flip") or cfg.get("shift"):
        # Said here, not by every worker after it loads the data.
        import pytensor.tensor as pt
        try:
            model.training_logits(pt.tensor("x", dtype="float32",
                                            shape=(cfg["batch_size"], ds.n_in)))
        except models.FlagError as e:
            raise UsageError(e.flag, str(e)) from None
    if cfg.get("bn_examples", STATISTICS_EXAMPLES) != STATISTICS_EXAMPLES and not model.norms:
        raise UsageError("--bn-examples", f"--bn-examples {cfg['bn_examples']}: "
                         f"{type(model).__name__} has no batch norms (Model.batch_norm)")
    if cfg["resume"]:  # a checkpoint of another model: said here, not by every worker
        try:
            read_checkpoint(cfg["resume"], model, note=lambda line: print(
                f"pympgu: --resume {line}", file=sys.stderr, flush=True))
        except ValueError as e:
            raise UsageError("--resume", str(e)) from None
    # Every worker takes whole, disjoint batches each epoch (data.shard_batches): refuse a
    # batch no epoch can fill here, rather than in every worker after they start.
    ntrain, workers = len(ds.train[1]), len(devices)
    if not data.batches_per_epoch(ntrain, cfg["batch_size"], workers):
        raise UsageError("--batch-size",
                         f"--batch-size {cfg['batch_size']} with {workers} workers needs "
                         f"{cfg['batch_size'] * workers} training examples a step, and {ds.name} "
                         f"has {ntrain}: give at most {ntrain // workers}")
    replacing = replaces_a_run(cfg["out"], cfg["resume"])
    if cfg["out"]:
        # Written before any worker starts: an --out that cannot be written loses no
        # training. Over an earlier run it waits beside it until this run's first
        # checkpoint, so that a run stopped sooner leaves that run whole (its config.json
        # builds its model for pympgu.evaluate).
        pending = os.path.join(cfg["out"], CONFIG_NEXT)
        config = pending if replacing else os.path.join(cfg["out"], CONFIG)
        try:
            os.makedirs(cfg["out"], exist_ok=True)
            with open(config, "w") as f:
                json.dump(cfg, f, indent=1)
            if not replacing and os.path.exists(pending):
                os.remove(pending)  # a stopped run's
        except OSError as e:
            raise UsageError("--out", f"--out {cfg['out']}: {e.strerror or e}") from e
        if replacing:
            print(f"pympgu: --out {cfg['out']} holds an earlier run; this run replaces its "
                  f"config.json, checkpoints and metrics.jsonl after its first epoch "
                  f"(--resume {cfg['out']} would continue it)", file=sys.stderr, flush=True)
    where = (f"{len(devices)} CPU workers" if devices[0] is None
             else f"GPUs {devices}")
    schedule = make_schedule(cfg, ntrain, workers)
    noise = "".join([f", dropout {cfg['dropout']:g}" if cfg.get("dropout") else "",
                     f", label smoothing {cfg['label_smoothing']:g}"
                     if cfg.get("label_smoothing") else "",
                     ", flipped" if cfg.get("flip") else "",
                     f", shifted by {cfg['shift']}" if cfg.get("shift") else ""])
    decay = (f" decay {model.weight_decay:g}" if model.optimizer == "adamw" else
             " nesterov" if model.nesterov else "")
    if model.clip_norm:
        decay += f", clipped to norm {model.clip_norm:g}"
    if model.ema:
        decay += f", evaluated by its moving average ({model.ema:g})"
    print(f"pympgu: {ds} | {model.describe()} | {model.optimizer}{decay}, {schedule}{noise} | "
          f"{where} | batch {cfg['batch_size']}/worker | sync every {cfg['sync_every']}"
          f"{' overlapped' if cfg['overlap'] else ''}"
          f"{'' if cfg['exchange_dtype'] == 'float32' else ', ' + cfg['exchange_dtype'] + ' wire'} | "
          f"{'' if cfg.get('compute_dtype', 'float32') == 'float32' else cfg['compute_dtype'] + ' products, '}"
          f"backend {cfg['backend']}", flush=True)
    reporter = Reporter(cfg["out"], cfg["epochs"], quiet=quiet,
                        resume=bool(cfg["resume"]) and not replacing,
                        rates=schedule.kind != "constant" or schedule.warmup > 0)
    t0 = time.perf_counter()
    try:
        if devices[0] is None:
            results = launch(worker, (cfg,), cpu=len(devices), port=port, on_metric=reporter)
        else:
            results = launch(worker, (cfg,), gpus=devices, port=port, on_metric=reporter)
    except BindError as e:  # before any worker started
        if not port:  # no free port to be had: not a flag's fault
            raise
        raise UsageError("--port", f"--port {port}: {e.strerror} (another run's? without "
                                   "--port the coordinator takes a free one)") from None
    finally:
        reporter.close()
        if replacing and os.path.exists(config):  # no epoch ended: the earlier run stays
            os.remove(config)
    total = time.perf_counter() - t0
    if len({r["digest"] for r in results}) != 1:
        raise RuntimeError("the replicas ended with different parameters: " +
                           ", ".join(f"rank {r['rank']} {r['digest'][:12]}" for r in results))
    history = results[0]["history"]
    if history:
        best = min(history, key=lambda h: h["valid_error"])
        mean_rate = sum(h["samples_per_s"] for h in history) / len(history)
        kept = ""
        if cfg["out"] and checkpoint_epoch(os.path.join(cfg["out"], BEST)) == best["epoch"]:
            kept = f", its checkpoint {os.path.join(cfg['out'], BEST)}"
        last, patience = history[-1]["epoch"], cfg.get("patience")
        if patience and last < cfg["epochs"]:
            print(f"stopped after epoch {last} of {cfg['epochs']}: no better validation error "
                  f"than epoch {best['epoch']}'s in {last - best['epoch']} epochs "
                  f"(--patience {patience})")
        print(f"done in {total:.1f} s: best validation error {100 * best['valid_error']:.2f}% "
              f"(epoch {best['epoch']}{kept}), its test error {100 * best['test_error']:.2f}%, "
              f"{mean_rate:.0f} samples/s")
        if cfg["out"]:
            plot(history, os.path.join(cfg["out"], "curves.png"))
            if kept:
                print(f"its errors class by class: python -m pympgu.evaluate {cfg['out']}")
    return history


def replaces_a_run(out, resume):
    """Whether a run writing into ``out`` replaces another run's checkpoints there: one it
    does not resume from (a --resume from elsewhere appends to no log but its own)."""
    if not out or not os.path.exists(os.path.join(out, CHECKPOINT)):
        return False
    return not resume or (os.path.realpath(os.path.dirname(os.path.abspath(resume)))
                          != os.path.realpath(out))


def saved(out, before):
    """What a run stopped early (interrupted, or a worker failed) leaves to resume from, in
    words: the training itself is lost, but each finished epoch was checkpointed under
    --out. ``before``: checkpoint_stamp(out) when the run started, to tell its checkpoint
    from one an earlier run left in the same directory."""
    if not out:
        return "nothing was saved (--out DIR keeps a checkpoint after every epoch)"
    path = os.path.join(out, CHECKPOINT)
    epoch = checkpoint_epoch(path)
    if epoch is None:
        if os.path.exists(path):
            return f"{path} cannot be read as a checkpoint"
        return f"no epoch finished, so {out} holds no checkpoint"
    if checkpoint_stamp(out) == before:
        return f"no epoch of this run finished; {path} is an earlier run's (epoch {epoch})"
    return f"epoch {epoch}'s checkpoint is in {path}: continue with --resume {out}"


def checkpoint_epoch(path):
    """The epoch after which the checkpoint at ``path`` was written, or None where there is
    none (or it cannot be read: this runs on the error path too, and never fails)."""
    try:
        import numpy as np
        with np.load(path) as f:  # lazy: reads this one entry
            return int(f["__epoch__"])
    except Exception:
        return None


def checkpoint_stamp(out):
    """When --out's checkpoint was last written (ns), or None: a worker replaces the file
    after each epoch (Replica.save), so a new stamp means a new checkpoint."""
    try:
        return os.stat(os.path.join(out, CHECKPOINT)).st_mtime_ns if out else None
    except OSError:
        return None


def main(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    cfg, devices, note = resolve(args, parser)
    if note:
        print(f"pympgu: {note}", file=sys.stderr)
    from .data import DataError
    from .launch import WorkerFailed
    before = checkpoint_stamp(cfg["out"])
    try:
        run(cfg, devices, port=args.port, quiet=args.quiet)
    except UsageError as e:
        preset = (f" (the batch of --preset {args.preset}, which --batch-size overrides)"
                  if e.flag == "--batch-size" and args.preset and args.batch_size is None
                  else "")
        parser.error(f"{e}{preset}")
    except DataError as e:
        print(f"pympgu: {e}", file=sys.stderr)
        return 2
    except WorkerFailed as e:
        print(f"pympgu: training failed: {e}\npympgu: {saved(cfg['out'], before)}",
              file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("pympgu: interrupted; every worker was stopped\n"
              f"pympgu: {saved(cfg['out'], before)}", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
