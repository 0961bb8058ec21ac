"""Training benchmark: pympgu against PyTorch DDP and a plain JAX step, at 1 and N GPUs.

    python -m pympgu.bench train --gpus 0 1            # every row, seed and wide MLPs
    python -m pympgu.bench train --gpus 0 --models wide
    python -m pympgu.bench train --gpus 0 1 2 3 --ranks 2 4   # scaling at 2 and 4 GPUs

For each model (the seed's MLP 784-500-10 at batch 5000, plain SGD; the wide MLP
784-4096-4096-10 at batch 1024 with momentum 0.9) it times ``--steps`` training steps after
``--warmup`` and prints samples/s (all GPUs together) for:

- pympgu on each GPU given alone, and on all of them (with ``--ranks N...``, on the first
  N for each N) with --sync-every 1 and 4 (the
  exchange inside the step's jitted XLA call, as pympgu.train runs it; the '-py' variants
  queue it from Python after the step instead), --overlap (inside the step's XLA call, the
  average on a side stream while the step computes; '-py' queued from Python) and a
  bfloat16 wire ('sync1-bf16': the gradients rounded to it inside the step; 'bf16-py': the
  change since the last exchange, queued from Python);
- PyTorch DistributedDataParallel on the same architecture, batch and optimiser (when
  torch is importable and every rank has its own GPU), with TF32 matmuls as JAX uses (with
  ``--compute-dtype bfloat16``, under torch.autocast to bfloat16) and a convnet's images
  channels last (``--ddp-layout``): eager ('DDP', as most scripts run it; it also reports
  the GPU time of its step alone) and with each step captured in a CUDA graph
  ('DDP-graph', its fastest form here; --no-ddp-graph skips it), and, with 'sync1-bf16',
  eager with PyTorch's bf16_compress_hook ('DDP-bf16'), and with ``--ddp-pympgu``, eager
  and in a graph, with pympgu.ddp's hook averaging its buckets in place of NCCL
  ('DDP-pympgu', 'DDP-pympgu-graph');
- a plain JAX step (jax.grad of the same loss, jitted) against the PyTensor-compiled call,
  on one GPU: the per-step cost of PyTensor's wrapper.

Scaling efficiency is N-GPU samples/s over N times the same system's 1-GPU samples/s, on
the first GPU given (a 1-GPU row on another GPU shows its rate against the first's). GPUs of
one model differ by a per cent or so, and ranks that wait for one another run at the
slowest one's pace. So for pympgu it also prints the scaling against the sum of each GPU's
own rate alone, what the exchange costs with the GPUs' difference set aside, and what the
exchange adds per step (ms/step over the 1-GPU row's: the
host queues exchanges without waiting, so only the step time shows their cost), beside the
bare kernel's device time for the same bytes. Minibatches are random indices into the dataset
(the embedded MNIST test set unless --data-dir): speed does not depend on the labels. Each
pympgu row also shows the SM clock it ran at (pympgu.bench.clocks; the slowest rank's mean, and
the largest share of samples the driver held down for power or heat): a step is slower on
a GPU held below its top clock. With ``--repeats N`` every row runs N times, in rounds, and
shows its median run, with the spread and each round's scaling: one run in new processes
says little where the rows differ by a few per cent, and eager DDP's, paced by its host,
moves the most between runs.

``--env NAME=A,B`` compares settings of an environment variable that pympgu's workers read
(PYMPGU_BESIDE_BLOCKS, say; pympgu.settings): every multi-GPU pympgu row
runs once per value, its variant named with the setting, and with --repeats the settings
alternate within each round, beside the same round's 1-GPU runs, which keep the environment
as given. Several --env flags run every combination.

    python -m pympgu.bench train --gpus 0 1 --models wide --variants overlap4 --no-ddp \\
        --repeats 4 --env PYMPGU_BESIDE_BLOCKS=64,128
"""
import argparse
import contextlib
import itertools
import json
import os
import re
import sys

from ..exchange import METHODS
from ..models import OPTIMIZERS
from ..precision import DTYPES as COMPUTE_DTYPES
from ..schedule import SCHEDULES
from ..training.config import ADAM_LR, RunConfig, optimizer_defaults
from .steps import pympgu_worker
from .torch_ddp import (DDP_LAYOUTS, DDP_SYSTEMS, DDP_TIMEOUT_S, ddp_systems, has_torch_twin,
                        run_ddp)

MODELS = {
    "seed": dict(hidden=[500], lr=0.13, momentum=0.0, batch_size=5000, l1=0.0, l2=1e-4),
    "wide": dict(hidden=[4096, 4096], lr=0.05, momentum=0.9, batch_size=1024, l1=0.0, l2=1e-4),
}


def model_config(name, hidden=None):
    """The RunConfig fields of a model to time: MODELS[name], or, for a model of one's own
    (``FILE.py:CLASS`` or ``MODULE:CLASS``, as pympgu.train's --model), the wide MLP's batch
    and optimiser with ``hidden`` (default: the model's default_hidden, as pympgu.train's)
    passed to it."""
    if name in MODELS:
        return dict(MODELS[name])
    if not hidden:
        from ..models import load
        hidden = load(name).default_hidden
    return dict(MODELS["wide"], hidden=list(hidden), model=name)


def model_label(name):
    """A model's name in the table: MODELS' key, or the class of a model of one's own."""
    return name if name in MODELS else name.rpartition(":")[2]


VARIANTS = {  # name: (sync_every, overlap, exchange dtype, exchange inside the step's XLA call)
    "sync1": (1, False, "float32", True),
    "sync4": (4, False, "float32", True),
    "sync1-py": (1, False, "float32", False),
    "sync4-py": (4, False, "float32", False),
    "overlap": (1, True, "float32", True),
    "overlap-py": (1, True, "float32", False),
    "overlap4": (4, True, "float32", True),
    # The gradients in bfloat16 inside the step (DDP-bf16's counterpart), and the wire's
    # change since the last exchange queued from Python after the step.
    "sync1-bf16": (1, False, "bfloat16", True),
    "bf16-py": (1, False, "bfloat16", False),
}


def env_settings(specs):
    """The combinations of ``--env`` specs (each ``NAME=V1,V2,...``), as a list of dicts in
    the order given: [{}] for none. Raises ValueError naming a spec that is not of that
    form."""
    axes = []
    for spec in specs:
        name, eq, values = spec.partition("=")
        if not eq or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
            raise ValueError(f"{spec!r} is not NAME=VALUE[,VALUE...]")
        if name in (n for n, _ in axes):
            raise ValueError(f"{name} is given twice; list its values in one flag")
        values = values.split(",")
        if "" in values or len(set(values)) < len(values):
            raise ValueError(f"{spec!r}: every value must be given, once")
        axes.append((name, values))
    return [dict(zip((n for n, _ in axes), combo))
            for combo in itertools.product(*(v for _, v in axes))]


@contextlib.contextmanager
def environment(values):
    """os.environ with ``values`` set while the block runs (the workers it spawns inherit
    them), and as it was afterwards."""
    before = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def run_pympgu(devices, cfg, steps, warmup, plain_jax=False, inside=True):
    """pympgu on devices (None entries: CPU workers); rank 0's timings, every rank's clock."""
    from ..runtime import launch
    cfg = cfg.replace(devices=tuple(devices))
    args = (cfg, steps, warmup, plain_jax, inside)
    if devices[0] is None:
        results = launch(pympgu_worker, args, cpu=len(devices))
    else:
        results = launch(pympgu_worker, args, gpus=devices)
    # Every rank's clock: the slowest GPU paces a run whose ranks wait for one another.
    return dict(results[0], sm_mhz=[r["sm_mhz"] for r in results],
                clock_capped=[r["clock_capped"] for r in results])


def measure(gpus, models, variants, steps, warmup, data, ddp=("DDP",), log=print,
            exchange_blocks=None, method="auto", repeats=1, settings=({},), ranks=None,
            hidden=None, optimizer="sgd", schedule="constant", batch_size=None, dropout=0.0,
            compute_dtype="float32", ddp_layout=DDP_LAYOUTS[0], clip_norm=0.0, ema=0.0):
    """Every row of the benchmark, as a list of dicts; ``ddp``: the DDP_SYSTEMS to run;
    ``settings``: the environments (env_settings) each multi-GPU pympgu row runs under, one
    row each, its variant named with the setting and its ``env`` the setting; ``ranks``:
    the numbers of ranks of the multi-GPU rows, each on the first that many of ``gpus``
    (default: all of them); ``models``: names in MODELS, or models of one's own
    (model_config), built with ``hidden``; ``optimizer`` trains every row (with
    pympgu.train's optimizer_defaults), and ``schedule`` sets pympgu's rate before every step;
    ``clip_norm`` is pympgu.train's --clip-norm, for every row (DDP's by clip_grad_norm_);
    ``ema`` its --ema, for every row (DDP's by a fused lerp after the optimizer's step);
    ``batch_size``, if given, is every row's batch per GPU instead of its model's;
    ``dropout`` is pympgu's --dropout, for its rows alone (no plain JAX step, no DDP);
    ``compute_dtype`` is pympgu.train's --compute-dtype, for every row (DDP's by
    torch.autocast); ``ddp_layout`` is the memory layout of DDP's convolutions (DDP_LAYOUTS).

    With ``repeats`` > 1 every run is made that many times, in rounds (each round runs
    every row once, so that a drift of the machine between process starts touches every
    row alike), and each row is its median run; ``runs_ms`` lists every run's ms per step
    and ``run_scalings`` each round's scaling against the 1-GPU run of the same round (and
    ``run_scalings_alone`` against each GPU's own run alone in that round)."""
    from .. import data as datamod
    from .. import models as modelmod
    ds = datamod.load(data)
    for name in models:  # a model of one's own that cannot be built: ModelError, here
        if name not in MODELS:
            modelmod.build(name, ds.n_in, model_config(name, hidden)["hidden"], ds.n_classes)
    rows = []
    multi = len(gpus) > 1
    groups = [gpus[:n] for n in (ranks or [len(gpus)]) if n > 1]
    for name in models:
        fields = dict(model_config(name, hidden), data=data, backend="jax", method=method,
                      epochs=1, exchange_blocks=exchange_blocks, optimizer=optimizer,
                      schedule=schedule, dropout=dropout, compute_dtype=compute_dtype,
                      clip_norm=clip_norm, ema=ema)
        fields.update(optimizer_defaults(optimizer))
        if batch_size is not None:
            fields["batch_size"] = batch_size
        base = RunConfig(**fields)
        # A model of one's own has no plain JAX form, and a PyTorch twin (DDP) only if its
        # class gives one (has_torch_twin). Each run: (system, devices, variant, config,
        # plain JAX step, environment, the exchange inside the step's XLA call).
        runs = [("pympgu", gpus[:1], "-", base, base.model is None and not dropout, {}, True)]
        if multi and gpus[0] is not None:  # each other GPU alone
            runs += [("pympgu", [g], "-", base, False, {}, True)
                     for g in dict.fromkeys(gpus[1:]) if g != gpus[0]]
        for group in groups:
            for v in variants:
                k, overlap, wire, in_xla = VARIANTS[v]
                cfg = base.replace(sync_every=k, overlap=overlap, exchange_dtype=wire)
                for env in settings:
                    label = " ".join([v, *(f"{n}={x}" for n, x in env.items())])
                    runs.append(("pympgu", group, label, cfg, False, env, in_xla))
        if has_torch_twin(base):
            # CPU workers: DDP on gloo, eager alone (no CUDA graph, no pympgu hook).
            cpu_ddp = [s for s in ddp if DDP_SYSTEMS[s] == (False, None)]
            for system in ddp if gpus[0] is not None else cpu_ddp:
                runs.append((system, gpus[:1], "-", base, False, {}, None))
                # NCCL refuses two ranks on one GPU; pympgu's hook shares one (gloo then
                # carries DDP's setup, ddp_rank), which checks its logic, not its speed.
                runs += [(system, group, "-", base, False, {}, None) for group in groups
                         if group[0] is None or len(set(group)) == len(group)
                         or DDP_SYSTEMS[system][1] == "pympgu"]
        done = [[] for _ in runs]  # each run's results, one per round
        for k in range(repeats):
            for (system, devs, variant, cfg, plain, env, inside), results in zip(runs, done):
                where = f"{len(devs)} CPU workers" if devs[0] is None else f"GPUs {devs}"
                what = f"{model_label(name)}: {system} on {where}, variant {variant}" + (
                    f", run {k + 1} of {repeats}" if repeats > 1 else "")
                log(f"  {what}", flush=True)
                if system == "pympgu":
                    # The plain JAX step's timings once: they do not depend on the round.
                    with environment(env):
                        r = run_pympgu(devs, cfg, steps, warmup, plain and k == 0, inside)
                else:
                    try:
                        graph, hook = DDP_SYSTEMS[system]
                        r = run_ddp(devs, cfg, ds.n_in, ds.n_classes, steps, warmup,
                                    graph=graph, layout=ddp_layout, hook=hook)
                    except RuntimeError as e:  # a baseline that fails leaves the others
                        log(f"  {what} failed, no row: {e}", flush=True)
                        r = None
                results.append(r)
                # Each run as it comes: a benchmark that is cut short keeps what it measured.
                if r is not None:
                    log(f"  {what}: {r['ms_per_step']:.3f} ms/step, "
                        f"{r['samples_per_s']:.0f} samples/s", flush=True)
        for (system, devs, variant, cfg, _, env, _), results in zip(runs, done):
            kept = [r for r in results if r is not None]
            if not kept:
                continue
            # The median run (the lower one of an even count: a run that happened), with
            # what only the first run timed.
            median = sorted(kept, key=lambda r: r["ms_per_step"])[(len(kept) - 1) // 2]
            row = dict(kept[0], **median, model=model_label(name), system=system,
                       gpus=list(devs), variant=variant, batch=cfg.batch_size,
                       optimizer=optimizer, compute_dtype=compute_dtype, clip_norm=clip_norm,
                       ema=ema,
                       schedule=schedule if system == "pympgu" else None,
                       dropout=dropout if system == "pympgu" else None,
                       runs_ms=[r and r["ms_per_step"] for r in results],
                       runs_samples=[r and r["samples_per_s"] for r in results])
            if env:
                row["env"] = dict(env)
            rows.append(row)
    for row in rows:  # scaling against the same system's 1-GPU row
        one = next((r for r in rows if r["model"] == row["model"] and
                    r["system"] == row["system"] and len(r["gpus"]) == 1), None)
        if one is None:  # its 1-GPU run failed
            continue
        row["scaling"] = row["samples_per_s"] / (len(row["gpus"]) * one["samples_per_s"])
        row["run_scalings"] = [a / (len(row["gpus"]) * b) if a and b else None
                               for a, b in zip(row["runs_samples"], one["runs_samples"])]
        if len(row["gpus"]) > 1 and row["system"] == "pympgu":
            row["added_ms_per_step"] = row["ms_per_step"] - one["ms_per_step"]
    for row in rows:
        alone = scaling_alone(row, rows)
        if alone is not None:
            row["scaling_alone"] = alone
            row["run_scalings_alone"] = run_scalings_alone(row, rows)
    return rows


def scaling_alone(row, rows):
    """``row``'s samples/s over the sum of each of its GPUs' own 1-GPU samples/s (the same
    model and system, among ``rows``), or None: not a row of several distinct GPUs, or a GPU
    without its 1-GPU row."""
    alone = _alone(row, rows)
    return None if alone is None else row["samples_per_s"] / sum(
        r["samples_per_s"] for r in alone)


def run_scalings_alone(row, rows):
    """scaling_alone round by round (each of row's runs against its GPUs' runs alone in the
    same round; None where one of them failed), or None where scaling_alone is."""
    alone = _alone(row, rows)
    if alone is None or "runs_samples" not in row:
        return None
    return [a / sum(rates) if a and all(rates) else None
            for a, *rates in zip(row["runs_samples"], *(r["runs_samples"] for r in alone))]


def _alone(row, rows):
    """The 1-GPU rows of each of row's GPUs (the same model and system), or None."""
    if len(row["gpus"]) < 2 or len(set(row["gpus"])) < len(row["gpus"]):
        return None
    alone = {r["gpus"][0]: r for r in rows
             if r["model"] == row["model"] and r["system"] == row["system"]
             and len(r["gpus"]) == 1}
    if not all(g in alone for g in row["gpus"]):
        return None
    return [alone[g] for g in row["gpus"]]


def _run_by_run(scalings):
    """Each run's scaling, '-' for a failed run, to four places: 0.9496 must not read as
    0.950, a target reached."""
    return ", ".join("-" if x is None else f"{x:.4f}" for x in scalings)


def table(rows):
    """The rows (measure) as the benchmark prints them."""
    from .clocks import describe

    def where(r):
        return ",".join("cpu" if g is None else str(g) for g in r["gpus"])

    # --env names a variant with its setting, 8 GPUs take 15 characters, and a model of
    # one's own is named by its class: the columns widen to the longest.
    mw = max([5, *(len(r["model"]) for r in rows)])
    wide = max([10, *(len(r["variant"]) for r in rows)])
    gw = max([10, *(len(where(r)) for r in rows)])
    head = (f"{'model':<{mw}} {'system':<9} {'GPUs':<{gw}} {'variant':<{wide}} {'batch/GPU':>9} "
            f"{'samples/s':>12} {'ms/step':>8} {'scaling':>8} {'added ms':>9} "
            f"{'kernel ms':>10} {'wire MB':>8} {'SM MHz':>12}")
    lines = [head, "-" * len(head)]
    for r in rows:
        def opt(key, fmt):
            return format(r[key], fmt) if key in r else "-"
        lines.append(f"{r['model']:<{mw}} {r['system']:<9} {where(r):<{gw}} "
                     f"{r['variant']:<{wide}} {r['batch']:>9} {r['samples_per_s']:12.0f} "
                     f"{r['ms_per_step']:8.3f} {opt('scaling', '8.2f'):>8} "
                     f"{opt('added_ms_per_step', '9.3f'):>9} {opt('bare_kernel_ms', '10.3f'):>10} "
                     f"{(format(r['wire_bytes'] / 1e6, '8.1f') if 'wire_bytes' in r else '-'):>8}"
                     f" {describe(r.get('sm_mhz', []), r.get('clock_capped', [])):>12}")
    for r in rows:
        if "plain_jax_ms" in r:
            lines.append(f"{r['model']}: PyTensor-compiled step {r['pytensor_ms']:.3f} ms through "
                         f"PyTensor's call, {r['direct_ms']:.3f} ms called directly (pympgu's "
                         f"loop), plain JAX step {r['plain_jax_ms']:.3f} ms: PyTensor's overhead "
                         f"{r['pytensor_ms'] - r['plain_jax_ms']:+.3f} ms per step, "
                         f"{r['direct_ms'] - r['plain_jax_ms']:+.3f} ms called directly")
        if "host_ms" in r:
            gpu = (f"; queued behind a held GPU, a step takes {r['gpu_ms']:.3f} ms"
                   if "gpu_ms" in r else "")
            lines.append(f"{r['model']}: {r['system']} on GPUs {r['gpus']}: the host issues a "
                         f"step in {r['host_ms']:.3f} ms of its {r['ms_per_step']:.3f} ms{gpu} "
                         f"(TF32 matmuls {'on' if r['tf32'] else 'off'}" +
                         (f", convolutions {r['layout']}" if r.get("layout") else "") + ")")
        runs = [m for m in r.get("runs_ms", []) if m is not None]
        if len(r.get("runs_ms", [])) > 1:
            scalings = _run_by_run(r.get("run_scalings", []))
            lines.append(f"{r['model']}: {r['system']} {r['variant']} on GPUs {r['gpus']}: "
                         f"{len(runs)} of {len(r['runs_ms'])} runs, {min(runs):.3f} to "
                         f"{max(runs):.3f} ms/step (the row: the median run)" +
                         (f"; scaling run by run {scalings}" if len(r["gpus"]) > 1 and scalings
                          else ""))
        if r.get("road"):
            lines.append(f"{r['model']}: pympgu {r['variant']} on GPUs {r['gpus']}: "
                         f"{r['road']}")
        if "scaling_alone" in r:
            each = _run_by_run(r.get("run_scalings_alone") or [])
            lines.append(f"{r['model']}: {r['system']} {r['variant']} on GPUs {r['gpus']}: "
                         f"scaling {r['scaling_alone']:.3f} against each GPU's own rate alone"
                         f" ({r['scaling']:.3f} against GPU {r['gpus'][0]}'s)" +
                         (f"; run by run {each}" if len(r.get("runs_ms", [])) > 1 else ""))
        if "r1" in r:
            o = r["r1"]
            lines.append(f"{r['model']}: one exchange of {o['bytes'] / 1e6:.1f} MB at R = 1 takes "
                         f"{o['exchange_ms']:.3f} ms until ready, the kernel alone "
                         f"{o['kernel_ms']:.3f} ms; the host queues it in {o['queued_ms']:.3f} ms "
                         f"(pack {o['pack_ms']:.3f}, average {o['average_ms']:.3f}, unpack "
                         f"{o['unpack_ms']:.3f}, JAX import and split {o['copy_back_ms']:.3f})")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m pympgu.bench train", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gpus", type=int, nargs="+", default=None,
                        help="GPU indexes (default: every visible GPU); a repeated index puts "
                             "several ranks on one GPU, which checks logic, not speed")
    parser.add_argument("--cpu", type=int, default=None, metavar="N",
                        help="N CPU workers (JAX on CPU) instead of GPUs: a smoke test of the "
                             "benchmark itself, no DDP")
    parser.add_argument("--models", nargs="+", choices=sorted(MODELS), default=None,
                        help="models to time (default: both, or none with --model)")
    parser.add_argument("--model", default=None, metavar="FILE.py:CLASS",
                        help="also time a model of one's own, as pympgu.train's --model "
                             "(docs/MODELS.md), at the wide MLP's batch and optimiser; DDP "
                             "rows too if its class gives a PyTorch twin (torch_twin, as "
                             "examples/lenet.py's); no plain JAX row")
    parser.add_argument("--hidden", type=int, nargs="+", default=None, metavar="H",
                        help="--model's hidden widths, as pympgu.train's flag (default: "
                             "the model's default_hidden)")
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS),
                        help="pympgu variants for the multi-GPU rows (default: all)")
    parser.add_argument("--batch-size", type=int, default=None, metavar="B",
                        help="every row's minibatch per GPU, drawn at random from the "
                             "training set (default: each model's own: 5000 for the seed, "
                             "1024 for the wide MLP and a model of one's own)")
    parser.add_argument("--steps", type=int, default=300, help="timed steps (default: 300)")
    parser.add_argument("--repeats", type=int, default=1, metavar="N",
                        help="run every row N times, in rounds, and show each row's median "
                             "run, with the spread and each round's scaling (default: 1). "
                             "Runs in new processes differ by more than runs in one: eager "
                             "DDP's, which its host paces, by the most")
    parser.add_argument("--warmup", type=int, default=20,
                        help="untimed steps first, compilation included (default: 20)")
    parser.add_argument("--data-dir", default=None, help="dataset, as for pympgu.train")
    parser.add_argument("--exchange-blocks", type=int, default=None, metavar="B",
                        help="as pympgu.train's flag: cap the averaging kernel's grid (default: "
                             "the training loop's)")
    parser.add_argument("--method", choices=METHODS, default="auto",
                        help="as pympgu.train's flag: the GPU averaging algorithm (default: auto)")
    parser.add_argument("--optimizer", choices=list(OPTIMIZERS), default="sgd",
                        help="train every row with this optimizer, as pympgu.train's flag; "
                             f"DDP's twin is torch.optim's (default: sgd; adam and adamw at "
                             f"lr {ADAM_LR})")
    parser.add_argument("--schedule", choices=list(SCHEDULES), default="constant",
                        help="set pympgu's learning rate before every step along this "
                             "schedule, as the training loop does, to time what a changing "
                             "rate costs; pympgu's rows alone, so it needs --no-ddp "
                             "(default: constant)")
    parser.add_argument("--dropout", type=float, default=0.0, metavar="RATE",
                        help="pympgu.train's --dropout in pympgu's rows, to time what drawing "
                             "the masks costs; pympgu's rows alone, so it needs --no-ddp "
                             "(default: 0)")
    parser.add_argument("--compute-dtype", choices=list(COMPUTE_DTYPES), default="float32",
                        help="as pympgu.train's flag: bfloat16 multiplies in bfloat16, "
                             "accumulating in float32; DDP's rows then run under "
                             "torch.autocast(bfloat16), the plain JAX step autocast as "
                             "pympgu's (default: float32, TF32 on GPUs, DDP's too)")
    parser.add_argument("--clip-norm", type=float, default=0.0, metavar="C",
                        help="as pympgu.train's flag, in every row: DDP's rows call "
                             "torch.nn.utils.clip_grad_norm_ before the optimizer's step "
                             "(default: 0, off)")
    parser.add_argument("--ema", type=float, default=0.0, metavar="DECAY",
                        help="as pympgu.train's flag, in every row: the parameters' moving "
                             "average moved after every step; DDP's rows by one fused lerp "
                             "after the optimizer's step (default: 0, off)")
    parser.add_argument("--ddp-layout", choices=DDP_LAYOUTS, default=DDP_LAYOUTS[0],
                        help="memory layout of the convolutions in DDP's twin of a convnet: "
                             "channels-last (NHWC, the fast one on tensor cores) or PyTorch's "
                             "default nchw (default: channels-last)")
    parser.add_argument("--no-ddp", action="store_true", help="skip PyTorch DDP")
    parser.add_argument("--ddp-pympgu", action="store_true",
                        help="also run DDP with pympgu.ddp's hook averaging its gradient "
                             "buckets in place of NCCL: eager ('DDP-pympgu') and, unless "
                             "--no-ddp-graph, each step a CUDA graph ('DDP-pympgu-graph')")
    parser.add_argument("--no-ddp-graph", action="store_true",
                        help="skip DDP with each step captured in a CUDA graph (a rank that "
                             f"stalls is reported as failed after {DDP_TIMEOUT_S} s, with its "
                             "stacks)")
    parser.add_argument("--env", action="append", default=[], metavar="NAME=A,B",
                        help="run every multi-GPU pympgu row once per value of environment "
                             "variable NAME (alternating within each round with --repeats); "
                             "the 1-GPU rows keep the environment as given. Give it again for "
                             "every combination of several variables")
    parser.add_argument("--ranks", type=int, nargs="+", default=None, metavar="N",
                        help="run the multi-GPU rows on the first N GPUs (or CPU workers) "
                             "for each N given, for scaling at several sizes in one run: "
                             "--gpus 0 1 2 3 --ranks 2 4 (default: all of them)")
    parser.add_argument("--json", default=None, help="also write the rows to this file")
    args = parser.parse_args(argv)
    try:
        settings = env_settings(args.env)
    except ValueError as e:
        parser.error(f"--env: {e}")
    from .. import cuda
    if args.schedule != "constant" and not args.no_ddp and args.cpu is None:
        parser.error("--schedule times pympgu's rows alone: add --no-ddp")
    if args.dropout and not args.no_ddp and args.cpu is None:
        parser.error("--dropout times pympgu's rows alone: add --no-ddp")
    if not 0 <= args.dropout < 1:
        parser.error(f"--dropout must be in [0, 1), got {args.dropout}")
    if not args.clip_norm >= 0:
        parser.error(f"--clip-norm must be 0 (off) or above, got {args.clip_norm}")
    if not 0 <= args.ema < 1:
        parser.error(f"--ema must be in [0, 1) (0: off), got {args.ema}")
    if args.steps < 1 or args.warmup < 1 or args.repeats < 1:
        parser.error("--steps, --warmup and --repeats must be at least 1")
    if args.batch_size is not None and args.batch_size < 1:
        parser.error(f"--batch-size must be at least 1, got {args.batch_size}")
    if args.cpu is not None:
        if args.gpus is not None or not 1 <= args.cpu <= 8:
            parser.error("--cpu takes 1 to 8 workers and excludes --gpus")
        gpus, names = [None] * args.cpu, "CPU workers"
    else:
        ok, info = cuda.availability()
        if not ok:
            parser.error(f"no usable GPU: {info} (--cpu N runs a smoke test on CPU workers)")
        gpus = args.gpus if args.gpus is not None else list(range(min(info, 8)))
        bad = [g for g in gpus if not 0 <= g < info]
        if bad:
            parser.error(f"--gpus: GPU {bad[0]} does not exist ({info} visible)")
        if not 1 <= len(gpus) <= 8:
            parser.error("--gpus: 1 to 8 ranks")
        names = ", ".join(cuda.device_name(d) for d in sorted(set(gpus)))
    if args.ranks is not None:
        bad = [n for n in args.ranks if not 2 <= n <= len(gpus)]
        if bad:
            parser.error(f"--ranks: {bad[0]} is not between 2 and {len(gpus)}, the number "
                         f"of {'--cpu workers' if args.cpu is not None else '--gpus'} given")
        args.ranks = sorted(set(args.ranks))
    models = args.models if args.models is not None else (
        [] if args.model else ["seed", "wide"])
    if args.model:
        models.append(args.model)
    elif args.hidden is not None:
        parser.error("--hidden sizes --model's model; the MLPs of --models have their own")
    # On CPU workers, a run that DDP's twin cannot match is pympgu's rows alone, said so.
    alone = ("--schedule" if args.schedule != "constant" else
             "--dropout" if args.dropout else None) if args.cpu is not None else None
    use_ddp = not args.no_ddp and alone is None
    if alone and not args.no_ddp:
        print(f"pympgu.bench train: {alone} times pympgu's rows alone; no DDP rows",
              file=sys.stderr)
    if use_ddp:
        try:
            import torch.distributed  # noqa: F401
        except ImportError:
            print("pympgu.bench train: torch is not importable; no DDP rows", file=sys.stderr)
            use_ddp = False
    print(f"pympgu.bench train: {len(gpus)} ranks on {gpus} ({names}); {args.steps} steps after "
          f"{args.warmup} warm-up; {args.optimizer}" +
          ("" if args.schedule == "constant" else f", {args.schedule} schedule") +
          (f", dropout {args.dropout}" if args.dropout else "") +
          (f", clipped to norm {args.clip_norm:g}" if args.clip_norm else "") +
          (f", moving average {args.ema:g}" if args.ema else "") +
          ("" if args.compute_dtype == "float32" else f", {args.compute_dtype} products") +
          (f"; {args.repeats} runs of each row" if args.repeats > 1 else ""), flush=True)
    if len(gpus) == 1:
        print("  one GPU: only the 1-GPU rows (give two or more GPUs for scaling)", flush=True)
    ddp = (ddp_systems(args.variants, graphs=not args.no_ddp_graph, hook=args.ddp_pympgu)
           if use_ddp else ())
    from ..data import DataError
    from ..models import ModelError
    try:  # measure loads the dataset and builds a --model before any worker starts
        rows = measure(gpus, models, args.variants, args.steps, args.warmup,
                       args.data_dir, ddp, exchange_blocks=args.exchange_blocks,
                       method=args.method, repeats=args.repeats, settings=settings,
                       ranks=args.ranks, hidden=args.hidden, optimizer=args.optimizer,
                       schedule=args.schedule, batch_size=args.batch_size,
                       dropout=args.dropout, compute_dtype=args.compute_dtype,
                       ddp_layout=args.ddp_layout, clip_norm=args.clip_norm, ema=args.ema)
    except DataError as e:
        parser.error(f"--data-dir: {e}")
    except ModelError as e:
        parser.error(str(e))
    print(table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gpus": gpus, "names": names, "rows": rows}, f, indent=1)
    return 0

