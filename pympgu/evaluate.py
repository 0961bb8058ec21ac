"""Evaluate a trained run: its error on a split, class by class, and where it errs.

    python -m pympgu.evaluate runs/fashion                       # best.npz, the test split
    python -m pympgu.evaluate runs/fashion --checkpoint last --split valid
    python -m pympgu.evaluate runs/fashion --data-dir other.npz  # the same model, other data

A run is what ``pympgu.train --out DIR`` wrote: config.json names the model, its widths and
the data, best.npz (the epoch of least validation error) and checkpoint.npz (the last) hold
its values. From Python::

    from pympgu import evaluate
    run = evaluate.load("runs/fashion")
    probabilities = run.predict(x)        # (n, classes), for float32 rows x as the data's
    report = run.evaluate("test")         # error, per class, and the confusion matrix

It runs on the CPU (CPU JAX where it is installed, as pympgu.train's CPU workers do; else
PyTensor's own backend): evaluating needs no GPU, and should not take one from a training
run. A run trained with ``--compute-dtype bfloat16`` is evaluated so too, under JAX (its
products rounded as training's were); PyTensor's own backend evaluates it in float32, and
says so.
"""
import argparse
import json
import os
import sys
import types

import numpy as np

from .data import DataError
from .training import checkpoint as files
from .training.checkpoint import BEST, CHECKPOINT, CONFIG
from .training.config import RunConfig, UsageError, auto_backend
from .training.replica import build_model

CHECKPOINTS = {"best": BEST, "last": CHECKPOINT}
SPLITS = ("test", "valid", "train")


class EvaluateError(ValueError):
    """A run that cannot be evaluated; the message names the file at fault."""


class Trained:
    """A trained model with a checkpoint's values, and the data it was trained on."""

    def __init__(self, model, config, dataset, checkpoint, epoch, backend, batch_size):
        self.model, self.config, self.dataset = model, config, dataset
        self.checkpoint, self.epoch, self.backend = checkpoint, epoch, backend
        self.batch_size = batch_size
        # The run's products, where the backend can compute them so (precision.mode).
        self.compute_dtype = config.compute_dtype if backend == "jax" \
            else "float32"
        self._fn = None

    def _function(self):
        # Compiled once, for a batch of static size: under JAX every size must be known
        # when the graph is traced (a convnet's reshapes), so the last batch is padded.
        if self._fn is None:
            from . import precision
            from ._pytensor import import_pytensor
            pytensor = import_pytensor()
            import pytensor.tensor as pt
            from pytensor.tensor.special import softmax
            x = pt.tensor("x", dtype="float32", shape=(self.batch_size, self.dataset.n_in))
            self._fn = pytensor.function(
                [x], softmax(self.model.logits(x), axis=1),
                mode=precision.mode(self.compute_dtype, self.backend))
        return self._fn

    def predict(self, x) -> "np.ndarray":
        """Class probabilities (n, classes) of ``x``: n examples, each of the data's
        ``n_in`` values (any shape that flattens to it), scaled as the data the model was
        trained on (pympgu's loaders give pixels in [0, 1])."""
        x = np.asarray(x, np.float32)
        x = x.reshape(len(x), -1) if x.size else x.reshape(0, self.dataset.n_in)
        if x.shape[1] != self.dataset.n_in:
            raise ValueError(f"the model takes {self.dataset.n_in} values an example "
                             f"({self.dataset.name}), got {x.shape[1]}")
        fn, b = self._function(), self.batch_size
        out = []
        for start in range(0, len(x), b):
            chunk = x[start:start + b]
            padded = np.zeros((b, x.shape[1]), np.float32)
            padded[:len(chunk)] = chunk
            out.append(np.asarray(fn(padded))[:len(chunk)])
        return np.concatenate(out) if out else np.zeros((0, self.dataset.n_classes),
                                                        np.float32)

    def evaluate(self, split="test") -> dict:
        """The model's errors on a split of its data ('test', 'valid' or 'train'): a dict
        of the split, its size, the error rate (and, above 5 classes, the top-5 error: the
        true class not among the five likeliest), each class's name (the data's, else its
        number), examples, error rate and the class it is most often taken for, and the
        confusion matrix (rows: the true class, columns: the predicted one)."""
        if split not in SPLITS:
            raise ValueError(f"split must be one of {', '.join(SPLITS)}, got {split!r}")
        x, y = getattr(self.dataset, split)
        probabilities = self.predict(x)
        predicted = probabilities.argmax(axis=1)
        k, names = self.dataset.n_classes, self.dataset.class_names
        top5 = None
        if k > 5:
            # The five likeliest classes, ties to the lower class as argmax takes them.
            five = np.argsort(-probabilities, axis=1, kind="stable")[:, :5]
            top5 = int((five != y[:, None]).all(axis=1).sum())
        confusion = np.zeros((k, k), np.int64)
        np.add.at(confusion, (y, predicted), 1)
        classes = []
        for c in range(k):
            row = confusion[c].copy()
            n = int(row.sum())
            right = int(row[c])
            row[c] = -1
            taken = int(row.argmax()) if n > right else None
            classes.append({"class": c, "name": names[c] if names else str(c), "examples": n,
                            "error": (n - right) / n if n else None, "taken_for": taken,
                            "taken_for_name": None if taken is None else
                            names[taken] if names else str(taken),
                            "taken_for_share": float(row.max()) / n if n > right else 0.0})
        wrong = int((predicted != y).sum())
        return {"split": split, "examples": len(y), "wrong": wrong,
                "error": wrong / len(y) if len(y) else None,
                "top5_wrong": top5,
                "top5_error": top5 / len(y) if top5 is not None and len(y) else None,
                "classes": classes, "confusion": confusion.tolist()}


def _resolve(run, checkpoint):
    """(the run's directory, the checkpoint file) for a run directory or a checkpoint."""
    if os.path.isdir(run):
        path = CHECKPOINTS.get(checkpoint, checkpoint)
        path = path if os.path.isabs(path) else os.path.join(run, path)
        if not os.path.isfile(path):
            if not os.path.isfile(os.path.join(run, CONFIG)):
                raise EvaluateError(f"{run}: not a run directory (no config.json: "
                                    "pympgu.train --out DIR writes one, and the checkpoints)")
            other = [n for n in CHECKPOINTS.values() if os.path.isfile(os.path.join(run, n))]
            raise EvaluateError(f"{path}: no such checkpoint" + (
                f" (the run has {', '.join(other)})" if other else
                " (the run finished no epoch)"))
        return run, path
    if not os.path.isfile(run):
        raise EvaluateError(f"{run}: no such run directory or checkpoint")
    return os.path.dirname(os.path.abspath(run)), run


def load(run, checkpoint="best", data=None, backend="auto", batch_size=500) -> "Trained":
    """The model of ``run`` (a ``pympgu.train --out`` directory, or a checkpoint in one)
    with the values of ``checkpoint`` ('best', 'last', or a file), on the run's data or
    ``data`` (a --data-dir), ready to predict: a :class:`Trained`. Raises EvaluateError (or
    pympgu.data.DataError) naming the file at fault."""
    directory, path = _resolve(run, checkpoint)
    config_path = os.path.join(directory, CONFIG)
    try:
        with open(config_path) as f:
            config = RunConfig.from_json(json.load(f))
    except FileNotFoundError:
        raise EvaluateError(f"{config_path}: no such file (pympgu.train --out writes it "
                            "beside the checkpoints, and the model is built from it)") from None
    except (OSError, ValueError, TypeError, UsageError) as e:
        raise EvaluateError(f"{config_path}: cannot be read ({e})") from None
    if backend == "auto":
        backend = auto_backend(cpu=True)
    # Before PyTensor and JAX are imported: JAX on the CPU, its warnings as a worker's.
    from .training.worker import setup_backend
    setup_backend(types.SimpleNamespace(device=None, nranks=1, rank=0, local_nranks=1,
                                        local_rank=0), backend)
    from . import data as datamod
    dataset = datamod.load(data if data is not None else config.data)
    from .models import ModelError
    try:
        model = build_model(config, dataset)
    except ModelError as e:  # its file moved, say: the message names it, as --model's
        raise EvaluateError(f"{config_path}: its model cannot be built ({e})") from None
    try:
        # The batch norms' population statistics too, which the run estimated before the
        # epoch's evaluation (Model.estimate_statistics).
        variables = model.state + model.statistics
        epoch, _, values = files.read(path, model, use=f"{path}: cannot evaluate it",
                                           variables=variables)
    except ValueError as e:
        raise EvaluateError(str(e)) from None
    for var, value in zip(variables, values):
        var.set_value(value)
    # A run with --ema evaluated (and chose best.npz by) its moving average: so does this.
    for param, average in zip(model.params, model.averages):
        param.set_value(average.get_value())
    return Trained(model, config, dataset, path, epoch, backend, batch_size)


def _products(run):
    """What the report's first line says of the products' dtype: nothing for float32."""
    trained = run.config.compute_dtype
    if run.compute_dtype != "float32":
        return f", {run.compute_dtype} products as trained"
    if trained != "float32":
        return f", float32 products (trained with {trained}'s: --backend jax evaluates so)"
    return ""


def format_report(run, report) -> str:
    """The lines ``python -m pympgu.evaluate`` prints for ``report`` (Trained.evaluate)."""
    ds = run.dataset
    average = " (its moving average)" if run.model.ema else ""
    lines = [f"pympgu: {run.checkpoint}: {run.model.describe()}{average} after epoch "
             f"{run.epoch} | "
             f"{ds.name}, {report['split']} split ({report['examples']:,} examples) | "
             f"backend {run.backend}{_products(run)}",
             f"{report['split']} error {100 * report['error']:.2f}% ({report['wrong']:,} of "
             f"{report['examples']:,})"]
    if ds.n_classes > 10 and report["top5_error"] is not None:  # CIFAR-100's usual second
        lines.append(f"top-5 error {100 * report['top5_error']:.2f}% "
                     f"({report['top5_wrong']:,} of {report['examples']:,})")
    classes = [c for c in report["classes"] if c["examples"]]
    worst = len(classes) > 20  # CIFAR-100: the ten worst classes, not a hundred lines
    if worst:
        classes = sorted(classes, key=lambda c: -c["error"])[:10]
        lines.append("the ten classes of most error:")
    named = ds.class_names is not None
    width = max([len(c["name"]) for c in classes] + [5]) if named else 0

    def label(number, name):
        return f"{number:>3} {name:<{width}}" if named else f"{number:>5}"
    lines.append(f"{label('', 'class') if named else 'class'} {'examples':>9} {'error':>8}  "
                 "most often taken for")
    for c in classes:
        taken = (f"{label(c['taken_for'], c['taken_for_name']).strip()} "
                 f"({100 * c['taken_for_share']:.1f}%)" if c["taken_for"] is not None else "-")
        lines.append(f"{label(c['class'], c['name'])} {c['examples']:>9,} "
                     f"{100 * c['error']:>7.2f}%  {taken}")
    k = ds.n_classes
    if k <= 10:
        lines.append("confusion (rows: true class, columns: predicted):")
        width = max(5, len(str(max(max(r) for r in report["confusion"]))) + 1)
        lines.append(" " * 6 + "".join(f"{c:>{width}}" for c in range(k)))
        lines += [f"{c:>6}" + "".join(f"{n:>{width}}" for n in row)
                  for c, row in enumerate(report["confusion"])]
    return lines


def build_parser():
    p = argparse.ArgumentParser(
        prog="python -m pympgu.evaluate", formatter_class=argparse.RawDescriptionHelpFormatter,
        description=__doc__.split("\n\nA run is")[0])
    p.add_argument("run", help="a pympgu.train --out directory, or a checkpoint (.npz) in one")
    p.add_argument("--checkpoint", default="best",
                   help="'best' (best.npz, the epoch of least validation error), 'last' "
                        "(checkpoint.npz) or a file name in the run (default: best)")
    p.add_argument("--split", choices=SPLITS, default="test",
                   help="the split of the data to evaluate (default: test)")
    p.add_argument("--data-dir", default=None,
                   help="other data of the same shape, as pympgu.train's --data-dir "
                        "(default: the run's own, from its config.json)")
    p.add_argument("--backend", choices=["auto", "c", "jax"], default="auto",
                   help="PyTensor backend, on the CPU (default: 'jax' where JAX is "
                        "installed, else 'c')")
    p.add_argument("--json", default=None, metavar="FILE",
                   help="also write the report (per class, the confusion matrix) here")
    return p


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        run = load(args.run, args.checkpoint, args.data_dir, args.backend)
        report = run.evaluate(args.split)
    except (EvaluateError, DataError) as e:
        parser.error(str(e))
    print("\n".join(format_report(run, report)), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(report, checkpoint=run.checkpoint, epoch=run.epoch,
                           data=run.dataset.name), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
