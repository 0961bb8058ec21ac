"""A worker's life: its backend set up, its replica built and made like its peers', and
the training loop, epoch by epoch, with the exchange and rank 0's evaluation and checkpoints."""
import math
import os
import time
import warnings

from . import checkpoint
from .outdir import OutDir
from .replica import Replica
from .sync import Sync, same_start


def setup_backend(ctx, backend):
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
        # then fails on the rank of GPU 1: "Device id 1 is out of range [0, 1)".
        if ctx.device is None:
            os.environ["JAX_PLATFORMS"] = "cpu"
    # Workers compile the same graphs at once; separate cache dirs avoid lock waits.
    flags = os.environ.get("PYTENSOR_FLAGS", "")
    if "compiledir" not in flags and ctx.nranks > 1:
        base = os.path.expanduser("~/.pytensor")
        flags = ",".join(f for f in (flags, f"base_compiledir={base}/rank{ctx.rank}") if f)
        os.environ["PYTENSOR_FLAGS"] = flags


def make_schedule(cfg, ntrain, nranks):
    """The run's learning rates (pympgu.schedule.Schedule) for ``nranks`` workers sharing
    ``ntrain`` examples (each takes as many steps an epoch, data.shard_batches): --warmup
    is in epochs, and the decay spans --epochs."""
    from .. import data
    from ..schedule import Schedule
    per_epoch = data.batches_per_epoch(ntrain, cfg.batch_size, nranks) // nranks
    return Schedule(cfg.lr, cfg.epochs * per_epoch, cfg.schedule, round(cfg.warmup * per_epoch))


def make_exchanger(ctx, rep, cfg, inside=True):
    """The worker's Exchanger, after one exact exchange (which also proves it works), and
    its StepExchange (None without ``inside``: the exchanges are then queued from Python
    after each step); (None, None) for a lone worker."""
    from .. import methods, settings
    from ..exchange import Exchanger
    from ..xla import StepExchange, copies_to_every_peer
    if ctx.nranks == 1:
        return None, None
    blocks = cfg.exchange_blocks
    if blocks is None and cfg.overlap:
        # The averaging kernel runs beside the next step's kernels, capped as any kernel
        # beside XLA's work is (docs/DECISIONS.md, "Kernels beside the step").
        blocks = settings.get().beside_blocks
    # A shared shadow lets the exchanges inside the step's XLA call start as soon as the
    # last layers are computed, and spares the overlapped one its pack ('gather'). It costs
    # nranks - 1 copies of the state on each GPU: only where one of the two will use it.
    shadow = (rep.jax is not None and not ctx.is_cpu and inside
              and methods.get(cfg.method).shadow and ctx.nnodes == 1 and copies_to_every_peer(ctx.nranks)
              and (cfg.exchange_dtype == "float32" or same_start(cfg.sync_every, cfg.overlap)))
    ex = Exchanger(ctx, rep.layout, method=cfg.method, wire_dtype=cfg.exchange_dtype,
                   max_blocks=blocks, shadow=shadow)
    try:
        rep.exchange(ex)  # replicas start identical (--init-seed); a resumed run too
    except BaseException:
        ex.close()
        raise
    return ex, StepExchange(ex) if inside else None


def worker(ctx, cfg):
    """The training loop of one worker (``cfg``: a RunConfig); returns its summary: rank
    0's history, a digest of the replica, and the epoch and loss where the loss stopped
    being finite, if it did (``diverged``)."""
    setup_backend(ctx, cfg.backend)
    stage(ctx, "building the model and compiling its step")
    rep = Replica(ctx, cfg)
    start_epoch, history, diverged = 0, [], None
    if cfg.resume:
        start_epoch, history = rep.load(cfg.resume)
    if ctx.nnodes > 1:  # each node reads its own files: they must be the same
        ctx.barrier("dataset (every node must read the same --data-dir and --resume)",
                    f"{rep.dataset} {_fingerprint(rep.dataset)} from epoch {start_epoch}")
    if ctx.nranks > 1:
        # Data parallelism needs one starting point. The first exchange would average
        # replicas built differently (a model drawing its values elsewhere than from its
        # seed) into a model none of them is: refuse them instead, naming the rank.
        ctx.barrier("initial values (a model must draw them from its seed argument)",
                    rep.digest(each=True))
        stage(ctx, "connecting the workers' exchange")
    ex, inside = make_exchanger(ctx, rep, cfg)
    out = OutDir(cfg.out, create=False) if cfg.out and ctx.rank == 0 else None
    try:
        schedule = make_schedule(cfg, len(rep.dataset.train[1]), ctx.nranks)
        stage(ctx, f"training from epoch {start_epoch + 1} (its first steps compile)")
        for epoch in range(start_epoch, cfg.epochs):
            record = _epoch(ctx, cfg, rep, ex, inside, schedule, epoch)
            stop = False
            if ctx.rank == 0:
                if not math.isfinite(record["loss"]):
                    # Nothing of this epoch is kept: the last checkpoint stays the last
                    # good one.
                    diverged = {"epoch": record["epoch"], "loss": record["loss"]}
                    stop = True
                else:
                    record["valid_error"], record["test_error"] = rep.errors()
                    history.append(record)
                    ctx.metric(kind="epoch", **record)
                    if out is not None:
                        _save(out, rep, history, first=epoch == start_epoch)
                    stop = bool(cfg.patience
                                and checkpoint.epochs_since_best(history) >= cfg.patience)
            # Rank 0 alone evaluates, so it decides, and every rank stops after the same
            # epoch, the replicas identical. Across nodes the replicas are compared every
            # epoch (one digest a rank): a difference is named at once.
            if ctx.nranks > 1:
                stop = ctx.barrier("replica (every node's must stay identical)",
                                   rep.digest() if ctx.nnodes > 1 else None, shared=stop)
            if stop:
                break
        # Replicas must end identical: a digest per rank lets the launcher's caller check.
        digest = rep.digest()
    finally:
        if ex is not None:
            ex.close()
        if out is not None:
            out.close()
    return {"rank": ctx.rank, "history": history if ctx.rank == 0 else None,
            "digest": digest, "diverged": diverged}


def _fingerprint(ds):
    """A short hash of a dataset's labels and input sizes (what a node's copy must match)."""
    import hashlib

    import numpy as np
    h = hashlib.sha256()
    for x, y in (ds.train, ds.valid, ds.test):
        h.update(repr((x.shape, str(x.dtype))).encode())
        h.update(np.ascontiguousarray(y).tobytes())
    return h.hexdigest()[:16]


def stage(ctx, text):
    """Rank 0 says what the run does before its first epoch, so that a log shows it."""
    if ctx.rank == 0:
        ctx.metric(kind="stage", text=text)


def _epoch(ctx, cfg, rep, ex, inside, schedule, epoch):
    """Train one epoch; returns its record (loss, rate, speed, the exchange's road)."""
    import numpy as np

    from .. import data
    ntrain = len(rep.dataset.train[1])
    batches = data.shard_batches(ntrain, cfg.batch_size, ctx.nranks, ctx.rank, cfg.seed, epoch)
    rep.seed_noise(epoch)
    sync = Sync(rep, ex, cfg.sync_every, cfg.overlap, inside)
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
    return {"epoch": epoch + 1, "loss": float(np.mean([float(c) for c in costs])), "lr": rate,
            "time_s": epoch_s,
            "samples_per_s": ctx.nranks * len(batches) * cfg.batch_size / epoch_s,
            "exchange_share": None if sync.fused else sync.seconds / epoch_s,
            # Which road the step's exchange took inside XLA, in words (None when no step
            # traced average_gradients), so that a run says whether the gradients or the
            # parameters crossed, and why; or why it runs outside XLA (a build without
            # jaxlib's headers, say).
            "road": _road(ctx, sync, inside)}


def _road(ctx, sync, inside):
    """Which road the step's exchange took, in words: inside XLA (None when no step traced
    average_gradients), queued from Python after the step and why, or on CPU workers
    through shared memory (and between nodes by JAX's gloo)."""
    if sync.ex is None:
        return None
    if ctx.is_cpu:
        every = "the step" if sync.every == 1 else f"every {sync.every} steps"
        across = ", and between the nodes by JAX's gloo" if ctx.nnodes > 1 else ""
        return f"averaged after {every}, through shared memory{across} (CPU workers)"
    outside = sync.outside
    if outside:
        return f"queued from Python after the step: {outside}"
    return None if inside is None else inside.road


def _save(out, rep, history, first):
    """Rank 0's checkpoint of the epoch just ended into ``out`` (an OutDir), best.npz if it
    is the best so far, and, after a run's first epoch, its config.json in place of an
    earlier run's."""
    rep.save(out, history[-1]["epoch"], history)
    if first and out.exists(checkpoint.CONFIG_NEXT):  # the launcher wrote it
        out.rename(checkpoint.CONFIG_NEXT, checkpoint.CONFIG)
    if all(history[-1]["valid_error"] < h["valid_error"] for h in history[:-1]):
        checkpoint.keep_best(out)
