"""A training run from the launcher's side: everything checked before any worker starts,
the workers launched and supervised, their reports shown, and the result summed up."""
import json
import os
import time

from . import checkpoint
from . import resume as resuming
from ..log import log
from .outdir import OutDir, OutDirError
from .config import UsageError
from .replica import build_model
from .report import Reporter, plot
from .worker import make_schedule, worker


def run(cfg, quiet=False, nodes=None, secret=None, changed=None, fit_batch=None):
    """Train as ``cfg`` (a RunConfig) says: launch the workers, report as they go, and
    return the run's history. Raises UsageError for a setting the data or model cannot take,
    before any worker starts; pympgu.runtime.WorkerFailed when a worker fails.

    ``changed``: what a resumed run changes of the run it continues ({setting: [before,
    after]}), kept in config.json. ``fit_batch``: the preset whose batch this is (not
    given): one the data cannot fill becomes the largest it can, with a note.

    On several nodes (``nodes``, pympgu.runtime.nodes.Nodes, and their shared ``secret``) this
    launches this node's workers; node 0's run reports, writes --out and returns the
    history, another node's returns None."""
    if cfg.nnodes > 1 and (nodes is None or nodes.nnodes != cfg.nnodes):
        raise UsageError("--nnodes", f"--nnodes {cfg.nnodes} needs this node's place among "
                                     "them (--node-rank and --coordinator)")
    if nodes is not None and nodes.node_rank > 0:
        return _run_node(cfg, nodes, secret)
    from .. import data
    from ..runtime.control import BindError
    ds = data.load(cfg.data)  # fail here, with the file's name, before any worker starts
    model = _check_model(cfg, ds)
    resumed = 0
    if cfg.resume:  # a checkpoint of another model, or damaged: said here, not by every worker
        try:
            resumed, _, _ = checkpoint.read(cfg.resume, model,
                                            note=lambda line: log.info("--resume %s", line))
        except ValueError as e:
            raise UsageError("--resume", str(e)) from None
        if resumed >= cfg.epochs:
            raise UsageError("--epochs", f"--resume {cfg.resume}: the run has trained its "
                                         f"{cfg.epochs} epochs; give --epochs N (above "
                                         f"{resumed}) to train on")
    cfg = _fit_batch(cfg, len(ds.train[1]), ds, fit_batch)
    out = _out_dir(cfg)
    try:
        return _launch_run(cfg, ds, model, out, resumed, changed, quiet, nodes, secret)
    except BindError as e:  # before any worker started
        if cfg.nnodes == 1:
            raise
        if e.filename and e.filename.startswith("port "):  # the rendezvous, the next port
            raise UsageError("--coordinator", f"--coordinator {nodes.address}: node 0 cannot "
                                              f"listen on {e.filename}, the next one "
                                              f"({e.strerror}): give another port") from None
        raise UsageError("--coordinator", f"--coordinator {nodes.address}: node 0 cannot "
                                          f"listen there ({e.strerror})") from None
    finally:
        if out is not None:
            out.close()


def _launch_run(cfg, ds, model, out, resumed, changed, quiet, nodes, secret):
    from ..runtime import launch
    replacing = checkpoint.replaces_a_run(cfg.out, cfg.resume)
    config = _write_config(cfg, out, replacing, resuming.history(cfg.resume, resumed, changed))
    if cfg.resume and out is not None and not replacing:  # the log goes on from its epoch
        checkpoint.sync_metrics(out)
    workers = cfg.nworkers
    schedule = make_schedule(cfg, len(ds.train[1]), workers)
    print(f"pympgu: {describe(cfg, ds, model, schedule)}", flush=True)
    reporter = Reporter(out, cfg.epochs, quiet=quiet,
                        resume=bool(cfg.resume) and not replacing,
                        rates=schedule.kind != "constant" or schedule.warmup > 0)
    t0 = time.perf_counter()
    if cfg.nnodes > 1:
        log.info("node 0 of %d, waiting for the others at %s", cfg.nnodes, nodes.address)
    try:
        results = launch(worker, (cfg,), on_metric=reporter, nodes=nodes,
                         secret=secret, min_workers=cfg.min_workers,
                         restarts=cfg.restart_workers, **_workers(cfg))
    finally:
        reporter.close()
        if out is not None:
            out.remove_temporaries()  # what a worker stopped mid-write left
            if replacing and config and out.exists(config):  # no epoch ended: it stays
                out.remove(config)
            # A run stopped between an epoch's checkpoint and its line in the log: the
            # line comes back from the checkpoint.
            checkpoint.sync_metrics(out)
    if results[0]["diverged"]:
        raise Diverged(**results[0]["diverged"])
    if len({r["digest"] for r in results}) != 1:
        raise RuntimeError("the replicas ended with different parameters: " +
                           ", ".join(f"rank {r['rank']} {r['digest'][:12]}" for r in results))
    history = results[0]["history"]
    if history:
        _summarize(cfg, out, history, time.perf_counter() - t0)
    return history


def _fit_batch(cfg, ntrain, ds, preset):
    """``cfg``, its batch checked against the data: every worker takes whole, disjoint
    batches each epoch (data.shard_batches), so refuse a batch no epoch can fill here,
    rather than in every worker after they start; a preset's batch is fitted instead."""
    from .. import data
    workers = cfg.nworkers
    if data.batches_per_epoch(ntrain, cfg.batch_size, workers):
        return cfg
    fits = ntrain // workers
    if preset and fits >= 1:
        log.warning(f"--preset {preset}: its batch of {cfg.batch_size} a worker needs "
                 f"{cfg.batch_size * workers:,} training examples a step and {ds.name} has "
                 f"{ntrain:,}: batch {fits} a worker instead (--batch-size sets it)")
        return cfg.replace(batch_size=fits)
    raise UsageError("--batch-size",
                     f"--batch-size {cfg.batch_size} with {workers} workers needs "
                     f"{cfg.batch_size * workers} training examples a step, and {ds.name} "
                     f"has {ntrain}: give at most {fits}")


def _out_dir(cfg):
    """--out, checked and held open (OutDir), or None without one."""
    if not cfg.out:
        return None
    try:
        out = OutDir(cfg.out)
    except OutDirError as e:
        raise UsageError("--out", f"--out {e}") from None
    links = out.links(checkpoint.FILES)
    if links:
        out.close()
        raise UsageError("--out", f"--out {cfg.out} holds a link named {links[0]}: pympgu "
                                  "writes no file through one; remove it")
    return out


class Diverged(RuntimeError):
    """The training loss stopped being finite; the run stopped after that epoch, which it
    did not checkpoint."""

    def __init__(self, epoch, loss):
        self.epoch, self.loss = epoch, loss
        super().__init__(f"the training loss was {loss} in epoch {epoch}: the run diverged "
                         "and stopped there, keeping no part of that epoch (a smaller --lr, "
                         "a --warmup or --clip-norm may keep it finite)")


def _workers(cfg):
    """launch()'s arguments for this node's workers."""
    return dict(cpu=len(cfg.devices)) if cfg.cpu else dict(gpus=list(cfg.devices))


def _run_node(cfg, nodes, secret):
    """Node 1, 2...: this node's workers, joined to node 0's, which reports and saves."""
    from .. import data
    from ..runtime import launch
    data.load(cfg.data)  # fail here, with the file's name, before any worker starts
    log.info("node %d of %d, joining node 0 at %s", nodes.node_rank, nodes.nnodes,
             nodes.address)
    launch(worker, (cfg,), nodes=nodes, secret=secret, restarts=cfg.restart_workers,
           **_workers(cfg))
    log.info("node %d done", nodes.node_rank)
    return None


def _check_model(cfg, ds):
    """The run's model, built here so that a --model that cannot be loaded or built, or a
    flag it cannot take, is named before any worker starts."""
    from .. import models
    try:
        model = build_model(cfg, ds)
    except models.ModelError as e:
        raise UsageError("--model", str(e)) from None
    if cfg.dropout or cfg.flip or cfg.shift:
        import pytensor.tensor as pt
        try:
            model.training_logits(pt.tensor("x", dtype="float32", shape=(cfg.batch_size, ds.n_in)))
        except models.FlagError as e:
            raise UsageError(e.flag, str(e)) from None
    if cfg.bn_examples != models.STATISTICS_EXAMPLES and not model.norms:
        raise UsageError("--bn-examples", f"--bn-examples {cfg.bn_examples}: "
                         f"{type(model).__name__} has no batch norms (Model.batch_norm)")
    return model


def _write_config(cfg, out, replacing, changes):
    """Write config.json into ``out`` (an OutDir, or None) before any worker starts, so that
    an --out that cannot be written loses no training; returns its name (None without
    --out). ``changes``: the run's history of changes on resuming (resume.history). Over
    an earlier run it waits beside it (config.json.next) until this run's first checkpoint,
    so that a run stopped sooner leaves that run whole (its config.json builds its model
    for pympgu.evaluate)."""
    if out is None:
        return None
    name = checkpoint.CONFIG_NEXT if replacing else checkpoint.CONFIG
    values = cfg.to_json()
    if changes:
        values["changes"] = changes
    try:
        out.write_text(name, json.dumps(values, indent=1))
        if not replacing:
            out.remove(checkpoint.CONFIG_NEXT)  # a stopped run's
    except OSError as e:
        raise UsageError("--out", f"--out {cfg.out}: {e.strerror or e}") from e
    if replacing:
        log.warning(f"--out {cfg.out} holds an earlier run; this run replaces its "
                    "config.json, checkpoints and metrics.jsonl after its first epoch "
                    f"(--resume {cfg.out} would continue it)")
    return name


def describe(cfg, ds, model, schedule):
    """The run in one line: data, model, optimizer, workers, batch and exchange."""
    from ..models import OPTIMIZERS
    where = f"{len(cfg.devices)} CPU workers" if cfg.cpu else f"GPUs {list(cfg.devices)}"
    if cfg.nnodes > 1:
        where = f"{cfg.nnodes} nodes x {where}"
    noise = "".join([f", dropout {cfg.dropout:g}" if cfg.dropout else "",
                     f", label smoothing {cfg.label_smoothing:g}" if cfg.label_smoothing else "",
                     ", flipped" if cfg.flip else "",
                     f", shifted by {cfg.shift}" if cfg.shift else ""])
    decay = (f" decay {model.weight_decay:g}" if OPTIMIZERS[model.optimizer].decays else
             " nesterov" if model.nesterov else "")
    if model.clip_norm:
        decay += f", clipped to norm {model.clip_norm:g}"
    if model.ema:
        decay += f", evaluated by its moving average ({model.ema:g})"
    wire = "" if cfg.exchange_dtype == "float32" else f", {cfg.exchange_dtype} wire"
    products = "" if cfg.compute_dtype == "float32" else f"{cfg.compute_dtype} products, "
    return (f"{ds} | {model.describe()} | {model.optimizer}{decay}, {schedule}{noise} | "
            f"{where} | batch {cfg.batch_size}/worker | sync every {cfg.sync_every}"
            f"{' overlapped' if cfg.overlap else ''}{wire} | {products}backend {cfg.backend}")


def _summarize(cfg, out, history, seconds):
    """The last lines of a run: its best epoch, where its checkpoint is, and the curves."""
    best = min(history, key=lambda h: h["valid_error"])
    mean_rate = sum(h["samples_per_s"] for h in history) / len(history)
    kept = ""
    best_path = os.path.join(cfg.out, checkpoint.BEST) if cfg.out else None
    if best_path and checkpoint.epoch_of(best_path) == best["epoch"]:
        kept = f", its checkpoint {best_path}"
    last = history[-1]["epoch"]
    if cfg.patience and last < cfg.epochs:
        print(f"stopped after epoch {last} of {cfg.epochs}: no better validation error than "
              f"epoch {best['epoch']}'s in {last - best['epoch']} epochs "
              f"(--patience {cfg.patience})")
    print(f"done in {seconds:.1f} s: best validation error {100 * best['valid_error']:.2f}% "
          f"(epoch {best['epoch']}{kept}), its test error {100 * best['test_error']:.2f}%, "
          f"{mean_rate:.0f} samples/s")
    if out is not None:
        try:
            plot(history, out)
        except OSError as e:  # the run is done and saved: its picture is not worth a failure
            log.warning("%s not written (%s)", out.join(checkpoint.CURVES), e)
        if kept:
            print(f"its errors class by class: python -m pympgu.evaluate {cfg.out}")
