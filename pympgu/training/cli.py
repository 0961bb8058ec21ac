"""Train one network on several GPUs (or CPU workers) by data parallelism.

    python -m pympgu.train --gpus 0 1            # one worker per GPU
    python -m pympgu.train --cpu 2               # two CPU workers, no GPU needed
    python -m pympgu.train                       # every visible GPU, else 2 CPU workers
    python -m pympgu.train --model examples/residual_mlp.py:ResidualMLP   # your own model
    python -m pympgu.train --out runs/a && python -m pympgu.evaluate runs/a   # then its errors

Each worker trains a replica on its own minibatches (disjoint shards of every epoch); every
--sync-every steps the replicas are averaged GPU to GPU by pympgu's kernels (CPU workers:
through shared memory). Without --data-dir the MNIST test set shipped with pympgu is used,
so it runs offline. docs/TRAINING.md explains the exchange's options.
"""
import argparse
import os
import signal
import sys

from .. import settings
from .. import methods
from ..log import log
from ..log import setup as setup_log
from ..models import OPTIMIZERS, STATISTICS_EXAMPLES
from ..precision import DTYPES as COMPUTE_DTYPES
from ..schedule import SCHEDULES
from . import checkpoint
from . import resume as resuming
from .config import (ACROSS_NODES, OUTER_DTYPES, ADAM_LR, ADAMW_DECAY, MAX_WORKERS, PRESETS,
                     RunConfig, UsageError, auto_backend, optimizer_defaults)

DEFAULTS = RunConfig()


class Parser(argparse.ArgumentParser):
    """A parser whose errors take one line, the flag and the fix named, not the usage."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def build_parser():
    """The parser of pympgu.train's flags, in the groups --help shows."""
    p = Parser(prog="python -m pympgu.train", description=__doc__,
               formatter_class=argparse.RawDescriptionHelpFormatter)
    _flags_where(p)
    _flags_nodes(p)
    _flags_data(p)
    _flags_model(p)
    _flags_optimizer(p)
    _flags_exchange(p)
    _flags_output(p)
    _flags_advanced(p)
    return p


def _flags_where(p):
    """--help's group 'where to run'."""
    g = p.add_argument_group("where to run")
    g.add_argument("--gpus", type=int, nargs="+", metavar="I",
                   help="GPU indexes, one worker each (default: every visible GPU)")
    g.add_argument("--cpu", type=int, metavar="N",
                   help="N CPU workers instead of GPUs (default without a usable GPU: 2)")
    g.add_argument("--min-workers", type=int, metavar="N",
                   help="go on without a lost worker while N remain (default: every worker: "
                        "any loss stops the run; across nodes a node other than node 0 is "
                        "lost whole; GPU workers: only across nodes under --across-nodes "
                        "average, diloco or easgd)")
    g.add_argument("--restart-workers", type=int, metavar="K",
                   help="with --min-workers: start a new worker in a lost one's place, K "
                        "times in all (on each node); it joins the others with their state; "
                        "across nodes every node waits for it, and GPU workers start again "
                        "as a node (default: 0)")


def _flags_nodes(p):
    """--help's group 'several nodes'."""
    g = p.add_argument_group("several nodes (one launch per node; README: Several machines)")
    g.add_argument("--nnodes", type=int, metavar="N",
                   help="nodes in the run (default: 1, or what Slurm, mpirun or torchrun say)")
    g.add_argument("--node-rank", type=int, metavar="K", help="this node's index, 0 to N-1")
    g.add_argument("--coordinator", metavar="HOST:PORT",
                   help="node 0's address, where it listens for the others")
    g.add_argument("--secret-file", metavar="FILE",
                   help="the run's shared secret (mode 600), else $PYMPGU_SECRET; a run of "
                        "several nodes needs one")
    g.add_argument("--across-nodes", choices=list(ACROSS_NODES),
                   help="between nodes: every-step (exact, the default), or every "
                        "--outer-every steps average (local SGD), diloco (an outer Nesterov "
                        "step on the nodes' mean change) or easgd (each node pulled toward a "
                        "shared centre, and the centre toward them); inside a node, exact "
                        "as ever")
    g.add_argument("--outer-every", type=int, metavar="H",
                   help="steps between two exchanges across nodes (default: 50)")
    g.add_argument("--outer-lr", type=float, metavar="LR",
                   help="diloco's outer learning rate (default: 0.7)")
    g.add_argument("--outer-momentum", type=float, metavar="MU",
                   help="diloco's outer Nesterov momentum (default: 0.9)")
    g.add_argument("--outer-streams", type=int, metavar="F",
                   help="diloco or easgd on the parameters in F fragments, one meeting "
                        "across the nodes every H/F steps, each every H (Streaming DiLoCo): "
                        "F times fewer bytes a meeting (default: 1)")
    g.add_argument("--outer-overlap", type=int, metavar="T",
                   help="diloco or easgd: each meeting across the nodes runs beside the next "
                        "T steps, its outer step then applied as the change it makes "
                        "(Streaming DiLoCo's overlap; default: 0, the steps wait for it)")
    g.add_argument("--easgd-alpha", type=float, metavar="A",
                   help="easgd's elastic rate: how far each node and the centre move toward "
                        "each other (default: 0.9 / nodes)")
    g.add_argument("--outer-dtype", choices=list(OUTER_DTYPES),
                   help="what diloco or easgd sends between nodes: bfloat16 or int8 (one "
                        "scale for 256 values) send 2 or 3.9 times fewer bytes (default: "
                        "float32)")


def _flags_data(p):
    """--help's group 'data'."""
    g = p.add_argument_group("data")
    g.add_argument("--data-dir", metavar="DIR",
                   help="MNIST-format IDX files, mnist.pkl.gz, 'fashion', 'digits', CIFAR's "
                        "python version, or a .npz (docs/MODELS.md; default: embedded MNIST)")
    g.add_argument("--flip", action=argparse.BooleanOptionalAction,
                   help="mirror each training image left to right with probability 1/2")
    g.add_argument("--shift", type=int, metavar="PIXELS",
                   help="move each training image by up to PIXELS each way (default: 0)")
    g.add_argument("--seed", type=int,
                   help="seed of the minibatch order, dropout and augmentation (default: 0); "
                        "the starting weights are --init-seed's")


def _flags_model(p):
    """--help's group 'model'."""
    g = p.add_argument_group("model")
    g.add_argument("--model", metavar="FILE.py:CLASS",
                   help="a pympgu.models.Model subclass to train (default: the MLP)")
    g.add_argument("--hidden", type=int, nargs="+", metavar="H",
                   help=f"hidden widths (default: {DEFAULTS.hidden[0]}, or the model's own)")
    g.add_argument("--preset", choices=sorted(PRESETS),
                   help="dual_mlp: the 2014 seed's run; explicit flags override it")
    g.add_argument("--dropout", type=float, metavar="RATE",
                   help="drop hidden units with probability RATE in training (default: 0)")
    g.add_argument("--bn-examples", type=int, metavar="N",
                   help="training examples that estimate batch norms' statistics (default: "
                        f"{STATISTICS_EXAMPLES})")
    g.add_argument("--init-seed", type=int, metavar="SEED",
                   help=f"seed of the starting weights, the same on every worker (default: "
                        f"{DEFAULTS.init_seed}, the 2014 demo's)")
    g.add_argument("--compute-dtype", choices=list(COMPUTE_DTYPES),
                   help="dtype of products and convolutions: bfloat16 is mixed precision "
                        "(default: float32)")


def _flags_optimizer(p):
    """--help's group 'optimizer'."""
    g = p.add_argument_group("optimizer")
    g.add_argument("--epochs", type=int, help=f"epochs (default: {DEFAULTS.epochs})")
    g.add_argument("--batch-size", type=int,
                   help=f"minibatch per worker (default: {DEFAULTS.batch_size})")
    g.add_argument("--optimizer", choices=list(OPTIMIZERS),
                   help="sgd (with momentum), adam, or adamw (default: sgd)")
    g.add_argument("--lr", type=float, help=f"learning rate (default: {DEFAULTS.lr}; "
                   f"{ADAM_LR} for adam and adamw)")
    g.add_argument("--schedule", choices=list(SCHEDULES),
                   help="the rate after --warmup: held, or decayed to zero (default: constant)")
    g.add_argument("--warmup", type=float, metavar="EPOCHS",
                   help="ramp the rate up over this many epochs (default: 0)")
    g.add_argument("--momentum", type=float,
                   help=f"SGD's momentum, or Adam's beta1 (default: {DEFAULTS.momentum})")
    g.add_argument("--nesterov", action=argparse.BooleanOptionalAction,
                   help="SGD with Nesterov's momentum")
    g.add_argument("--beta2", type=float,
                   help=f"Adam's second-moment decay (default: {DEFAULTS.beta2})")
    g.add_argument("--weight-decay", type=float, metavar="WD",
                   help=f"AdamW's decoupled weight decay (default: {ADAMW_DECAY})")
    g.add_argument("--l1", type=float, help="L1 weight penalty (default: 0)")
    g.add_argument("--l2", type=float, help=f"L2 weight penalty (default: {DEFAULTS.l2}; "
                   "0 for adam and adamw)")
    g.add_argument("--clip-norm", type=float, metavar="C",
                   help="clip the gradients to a 2-norm of at most C (default: 0, off)")
    g.add_argument("--label-smoothing", type=float, metavar="EPS",
                   help="smooth the targets by EPS (default: 0, off)")
    g.add_argument("--ema", type=float, metavar="DECAY",
                   help="evaluate a moving average of the parameters (default: 0, off)")
    g.add_argument("--patience", type=int, metavar="EPOCHS",
                   help="stop after EPOCHS epochs without a better validation error")


def _flags_exchange(p):
    """--help's group 'exchange'."""
    g = p.add_argument_group("exchange")
    g.add_argument("--sync-every", type=int, metavar="K",
                   help="average the replicas every K steps (default: 1)")
    g.add_argument("--overlap", action=argparse.BooleanOptionalAction,
                   help="average while the next step computes, then correct it")
    g.add_argument("--exchange-dtype", choices=list(methods.WIRES),
                   help="dtype on the wire: bfloat16 or float16 send half the bytes "
                        "(default: float32)")


def _flags_output(p):
    """--help's group 'output'."""
    g = p.add_argument_group("output")
    g.add_argument("--out", metavar="DIR",
                   help="write config.json, metrics.jsonl, checkpoints and curves.png here")
    g.add_argument("--resume", metavar="PATH",
                   help="continue from a checkpoint, or from an --out directory, with the "
                        "settings of its config.json; flags given override them")
    g.add_argument("-q", "--quiet", action="store_true",
                   help="no progress bar, and of pympgu's messages warnings alone")
    g.add_argument("-v", "--verbose", action="store_true",
                   help="every message, a failing worker's runtime log among them")


def _flags_advanced(p):
    """--help's group 'advanced'."""
    g = p.add_argument_group("advanced")
    g.add_argument("--backend", choices=["auto", "c", "jax"],
                   help="PyTensor's backend: jax (GPUs need it) or c (default: auto)")
    g.add_argument("--method", choices=list(methods.NAMES),
                   help="the GPU averaging algorithm (default: auto, by size); nccl: NCCL alone, "
                        "every rank in one communicator (across nodes too)")
    g.add_argument("--exchange-blocks", type=int, metavar="B",
                   help="cap the GPU averaging kernel at B thread blocks (1-512)")


# Flags whose value goes into the RunConfig as it is, when given.
_PLAIN = ("hidden", "epochs", "batch_size", "lr", "momentum", "l1", "l2", "beta2",
          "weight_decay", "clip_norm", "ema", "patience", "warmup", "dropout",
          "label_smoothing", "shift", "bn_examples", "seed", "init_seed", "schedule",
          "compute_dtype", "sync_every", "overlap", "exchange_dtype", "exchange_blocks",
          "nesterov", "flip", "method", "min_workers", "restart_workers", "across_nodes",
          "outer_every", "outer_lr", "outer_momentum", "easgd_alpha", "outer_dtype",
          "outer_streams", "outer_overlap")


class Resolved:
    """What the flags resolve to: the RunConfig, a note (why the run falls back to CPU
    workers, or to PyTensor's backend; or None), and for a resumed run what differs from
    the run it continues (``changed``, {setting: [before, after]}) and which settings the
    flags gave (``given``)."""

    def __init__(self, cfg, note, changed=None, given=()):
        self.cfg, self.note, self.changed, self.given = cfg, note, changed, set(given)


def resolve(args, parser, where=None):
    """The run's settings (Resolved) from the flags, or a parser error naming the flag at
    fault. A resumed run starts from the settings of the run it continues, the flags given
    in their place. ``where``: the run's nodes (nodes()), found from the flags when not
    given."""
    try:
        settings.get()  # read again by every worker: a bad value fails here, before any
    except settings.SettingsError as e:
        parser.error(str(e))
    resume = _resume(args.resume, parser)
    try:
        before = resuming.saved(resume)[0] if resume else None
    except UsageError as e:
        parser.error(str(e))
    values = resuming.carried(before) if before else {}
    given = set()
    if args.preset:
        values.update(PRESETS[args.preset])
        given |= set(PRESETS[args.preset])
    optimizer = args.optimizer or values.get("optimizer", DEFAULTS.optimizer)
    if before is None or optimizer != before.optimizer:
        values["optimizer"] = optimizer
        values.update(optimizer_defaults(optimizer))  # a preset's rate is SGD's
    if not OPTIMIZERS[optimizer].beta2 and args.beta2 is not None:
        parser.error("--beta2 is Adam's; give --optimizer adam or adamw with it")
    for key in _PLAIN + ("optimizer",):
        if getattr(args, key) is not None:
            values[key] = getattr(args, key)
            given.add(key)
    if args.hidden is None and args.model and not args.preset:
        from .. import models
        try:  # the model's own widths (a convnet's channels are not the MLP's 500 units)
            values["hidden"] = list(models.load(args.model).default_hidden)
        except models.ModelError as e:
            parser.error(str(e))
    if before is None or args.gpus is not None or args.cpu is not None:
        devices, note = _devices(args, parser)
        given |= {"devices"} if before is not None else set()
    else:
        devices, note = _resumed_devices(before.devices, parser), None
    cpu = devices[0] is None
    values["nnodes"] = (where or nodes(args, parser)[0]).nnodes
    if args.backend not in (None, "auto") or before is None or before.cpu != cpu:
        backend = args.backend if args.backend not in (None, "auto") else auto_backend(cpu)
        if args.backend in (None, "auto") and backend == "c":
            note = "; ".join(n for n in (note, _WITHOUT_JAX) if n)
    else:
        backend = before.backend
    given |= {"backend"} if args.backend is not None else set()
    # A resumed run goes on writing where it was, unless --out says otherwise.
    out = args.out if args.out or not resume else os.path.dirname(resume)
    values.update(devices=devices, backend=backend, out=out, resume=resume)
    for key, flag, value in (("data", args.data_dir, _data(args.data_dir, parser)),
                             ("model", args.model, _model(args.model))):
        if flag is not None or before is None:
            values[key] = value
            given.add(key)
    try:
        cfg = RunConfig(**values)
    except UsageError as e:
        parser.error(str(e))
    if cfg.warmup > cfg.epochs:
        parser.error(f"--warmup must be 0 to --epochs ({cfg.epochs}), got {cfg.warmup}")
    if not cpu:
        _check_jax_for_gpus(parser)
        nccl = methods.get(cfg.method).nccl
        # (an outer step between nodes goes through the host: no NCCL)
        if (cfg.nnodes > 1 and cfg.across_nodes == "every-step") or nccl:
            _check_nccl(parser, f"--method {cfg.method}" if nccl else "--nnodes")
    changed = resuming.changes(before, cfg) if before is not None else None
    return Resolved(cfg, note, changed, given)


def _resumed_devices(devices, parser):
    """The devices of the run a resume continues, where this machine has them."""
    if devices[0] is None:
        return list(devices)
    from .. import cuda
    ok, info = cuda.availability()
    if not ok or any(d >= info for d in devices):
        here = f"{info} visible" if ok else f"none usable: {info}"
        parser.error(f"--resume: the run trained on GPUs {list(devices)}, and this machine "
                     f"has {here}; give --gpus or --cpu N")
    return list(devices)


def _check_nccl(parser, flag):
    """Refuse a run that needs NCCL where none loads, before any worker starts."""
    from .. import cuda
    try:
        cuda.nccl_load()
    except cuda.CudaError as e:
        parser.error(f"{flag}: {e}")


_WITHOUT_JAX = ("JAX is not installed, so the CPU workers run PyTensor's C backend: its "
                "first compile takes up to a minute before the first epoch, and it trains "
                "about half as fast (docs/DECISIONS.md, \"JAX on CPU workers\"); pip "
                "install jax for the faster one")


def nodes(args, parser):
    """(pympgu.runtime.nodes.Nodes, the shared secret or None) from the flags or a job launcher's
    environment, or a parser error naming the flag or variable at fault."""
    from ..runtime import nodes as _nodes
    try:
        where = _nodes.resolve(args.nnodes, args.node_rank, args.coordinator)
        secret = _nodes.read_secret(args.secret_file)
    except _nodes.NodesError as e:
        parser.error(str(e))
    if where.nnodes > 1 and secret is None:
        parser.error(f"a run of {where.nnodes} nodes ({where.source}) needs a secret the "
                     "nodes share: export PYMPGU_SECRET=$(openssl rand -hex 32) on every "
                     "node, or give --secret-file FILE (mode 600)")
    return where, secret


def _devices(args, parser):
    """The workers' devices (a GPU index, or None per CPU worker) and a note when the run
    falls back to CPU workers, from --gpus and --cpu."""
    from .. import cuda
    if args.gpus is not None and args.cpu is not None:
        parser.error("give --gpus or --cpu, not both")
    if args.cpu is not None:
        if not 1 <= args.cpu <= MAX_WORKERS:
            parser.error(f"--cpu must be 1 to {MAX_WORKERS}, got {args.cpu}")
        return [None] * args.cpu, None
    ok, info = cuda.availability()
    if args.gpus is None:
        if ok:
            return list(range(min(info, MAX_WORKERS))), None
        return [None, None], f"no usable GPU ({info}); running 2 CPU workers"
    if not ok:
        parser.error(f"--gpus: no usable GPU here ({info}); --cpu N trains on N CPU workers")
    if len(set(args.gpus)) != len(args.gpus):
        parser.error(f"--gpus: indexes must be distinct, got {args.gpus}")
    bad = [g for g in args.gpus if not 0 <= g < info]
    if bad:
        parser.error(f"--gpus: GPU {bad[0]} does not exist ({info} visible: 0..{info - 1})")
    if len(args.gpus) > MAX_WORKERS:
        parser.error(f"--gpus: at most {MAX_WORKERS} GPUs")
    return list(args.gpus), None


def _check_jax_for_gpus(parser):
    """Refuse GPU workers when JAX has no CUDA backend installed, before any worker starts
    (each would fail on its own). Found without importing JAX, which would take a CUDA
    context on every GPU in this process."""
    import importlib.util
    if importlib.util.find_spec("jax") is None:
        parser.error('--gpus: JAX is not installed; pip install "jax[cuda13]" (or cuda12, as '
                     "your driver allows), or train on CPU workers with --cpu N")
    plugins = ("jax_cuda13_plugin", "jax_cuda12_plugin", "jax_plugins.xla_cuda13",
               "jax_plugins.xla_cuda12")
    for name in plugins:
        try:
            if importlib.util.find_spec(name) is not None:
                return
        except ModuleNotFoundError:
            continue
    parser.error('--gpus: JAX is installed without CUDA; pip install "jax[cuda13]" (or '
                 "cuda12, as your driver allows), or train on CPU workers with --cpu N")


def _data(data, parser):
    """--data-dir, made absolute (so that pympgu.evaluate and --resume find it from any
    directory), or a flag error when it names nothing."""
    if data is None or data in ("fashion", "digits"):
        return data
    if not os.path.exists(data):
        hint = ""
        if "cifar" in data.lower():  # a name, as 'fashion' is: CIFAR must be downloaded
            hint = (" (pympgu reads CIFAR as its authors ship it: download "
                    "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz, or "
                    "cifar-100-python.tar.gz, and give its path)")
        parser.error(f"--data-dir {data}: no such file or directory{hint}")
    return os.path.abspath(data)


def _model(model):
    """--model with its file made absolute, for the same reason as --data-dir."""
    if model and model.rpartition(":")[0].endswith(".py"):
        where, _, name = model.rpartition(":")
        return f"{os.path.abspath(where)}:{name}"
    return model


def _resume(resume, parser):
    """--resume as a checkpoint file (an --out directory's checkpoint.npz)."""
    if not resume:
        return None
    path = os.path.join(resume, checkpoint.CHECKPOINT) if os.path.isdir(resume) else resume
    if not os.path.isfile(path):
        parser.error(f"--resume {resume}: no checkpoint there")
    return os.path.abspath(path)


def main(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    setup_log(-1 if args.quiet else 1 if args.verbose else 0)
    where, secret = nodes(args, parser)
    resolved = resolve(args, parser, where)
    cfg = resolved.cfg
    if resolved.note:
        log.warning(resolved.note)
    from ..data import DataError
    from ..runtime import Terminated, WorkerFailed
    from .launcher import Diverged, run
    if resolved.changed is not None:
        changed = resuming.describe(resolved.changed, resolved.given)
        log.info(f"--resume {args.resume}: the run goes on with the settings of its "
                 f"config.json{'; ' + changed if changed else ''}")
    if cfg.resume and not args.out:
        log.info(f"--resume: this run goes on writing into {cfg.out} (--out DIR writes "
                 "elsewhere)")
    before = checkpoint.stamp(cfg.out)
    try:
        run(cfg, quiet=args.quiet, nodes=where if where.nnodes > 1 else None,
            secret=secret, changed=resolved.changed,
            fit_batch=args.preset if args.batch_size is None else None)
    except UsageError as e:
        parser.error(str(e))
    except DataError as e:
        log.error(str(e))
        return 2
    except WorkerFailed as e:
        log.error("training failed: %s", e)
        log.error(checkpoint.left(cfg.out, before))
        return 1
    except Diverged as e:
        path = cfg.out and os.path.join(cfg.out, checkpoint.CHECKPOINT)
        epoch = checkpoint.epoch_of(path) if path else None
        kept = (f"{path} keeps epoch {epoch}, the last good one" if epoch is not None else
                checkpoint.left(cfg.out, before))
        log.error(str(e))
        log.error(kept)
        return 1
    except Terminated:  # a scheduler's stop (Slurm's, say): the status a SIGTERM gives
        log.error("stopped by SIGTERM; every worker was stopped")
        log.error(checkpoint.left(cfg.out, before))
        return 128 + signal.SIGTERM
    except KeyboardInterrupt:
        log.error("interrupted; every worker was stopped")
        log.error(checkpoint.left(cfg.out, before))
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
