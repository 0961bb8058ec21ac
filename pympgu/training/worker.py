"""A worker's life: its backend set up, its replica built and made like its peers', and
its exchange connected for the training loop (pympgu.training.loop)."""
import os
import warnings

from ..exchange import outer
from .replica import Replica
from .sync import same_start


def setup_backend(ctx, backend, restarts=0):
    """Environment for PyTensor and JAX in this worker; must run before they are imported.
    ``restarts``: --restart-workers."""
    if backend == "jax" and restarts and ctx.device is None:
        # A worker started in a lost one's place compiles what its predecessor compiled:
        # from the run's own cache, which goes with it (docs/DECISIONS.md, "New workers
        # compile from the run's cache"; CPU workers').
        import tempfile
        os.environ.setdefault("JAX_COMPILATION_CACHE_DIR",
                              os.path.join(tempfile.gettempdir(), "xla"))
        os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
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
    if ctx.device is None:
        from ..runtime import cores
        cores.pin(ctx.local_nranks, ctx.local_rank)  # (before XLA sizes its thread pool)
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


def make_exchanger(ctx, rep, cfg, inside=True, root=None, reach="world"):
    """The worker's Exchanger, after one exact exchange (which also proves it works), and
    its StepExchange (None without ``inside``: the exchanges are then queued from Python
    after each step); (None, None) for a lone worker. With ``root`` (CPU workers that a
    restarted one joins) every replica takes rank root's state instead. ``reach``: the
    first exchange's (Exchanger.start); 'node' where each node's replicas, as they stand,
    go on under an outer optimizer's state put back after it."""
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
    # GPU workers under an outer optimizer exchange inside their node as on one node, and
    # meet the other nodes through the host every H steps (docs/DECISIONS.md, "Outer
    # optimizers on GPU workers").
    within = not ctx.is_cpu and ctx.nnodes > 1 and cfg.across_nodes != "every-step"
    # A shared shadow lets the exchanges inside the step's XLA call start as soon as the
    # last layers are computed, and spares the overlapped one its pack ('gather'). It costs
    # nranks - 1 copies of the state on each GPU: only where one of the two will use it.
    shadow = (rep.jax is not None and not ctx.is_cpu and inside
              and methods.get(cfg.method).shadow and (ctx.nnodes == 1 or within)
              and copies_to_every_peer(ctx.local_nranks)
              and (cfg.exchange_dtype == "float32" or same_start(cfg.sync_every, cfg.overlap)))
    ex = Exchanger(ctx, rep.layout, method=cfg.method, wire_dtype=cfg.exchange_dtype,
                   max_blocks=blocks, shadow=shadow, nodes=not within)
    try:
        if within:
            ex.between = Exchanger(ctx, rep.layout, host=True)
        nodes = ex.across
        # Its shared state: what the first exchange gives (none once a single node is left).
        if cfg.across_nodes in outer.REGISTRY and ctx.nnodes > 1:
            kind = outer.REGISTRY[cfg.across_nodes]
            lo, hi = rep.part("params")
            nodes.set_outer(cfg.across_nodes, nodes.part(lo, hi),
                            None if cfg.outer_dtype == "float32" else cfg.outer_dtype,
                            cfg.outer_streams, cfg.outer_overlap,
                            **{k: getattr(cfg, field) for k, field in kind.flags.items()})
            for key, attr in kind.saved.items() if cfg.resume else ():
                from . import checkpoint
                whole = checkpoint.read_extra(cfg.resume, key)
                if whole is not None:  # (none: resumed from a run without it, from rest)
                    nodes.backend.set_outer_state(attr, whole)
        if root is not None:
            rep.adopt(ex, root=root)
        if ctx.source is not None:  # a node joins: every node takes node source's state
            rep.adopt(nodes, source=ctx.source)
        if root is None or ctx.nnodes > 1:
            # Replicas start identical (--init-seed; a resumed run too). Across nodes a node
            # whose worker was replaced (root) averages too, as the other nodes do.
            rep.exchange(ex, reach)
            if ex.between is not None:
                rep.exchange(ex.between, reach)
    except BaseException:
        ex.close()
        raise
    return ex, StepExchange(ex) if inside else None


def worker(ctx, cfg):
    """The training loop of one worker (``cfg``: a RunConfig); returns its summary: the
    run's history (every rank holds it), a digest of the replica, and the epoch and loss where the loss stopped
    being finite, if it did (``diverged``)."""
    from .loop import Training
    setup_backend(ctx, cfg.backend, cfg.restart_workers)
    stage(ctx, "building the model and compiling its step")
    rep = Replica(ctx, cfg)
    start_epoch, history = 0, []
    if ctx.joining:  # restarted in a lost worker's place: the others hand it all it needs
        return Training(ctx, cfg, rep, history, make_exchanger).run(start_epoch)
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
    return Training(ctx, cfg, rep, history, make_exchanger).run(start_epoch)


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
