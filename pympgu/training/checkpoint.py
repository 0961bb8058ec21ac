"""A run's files under --out: the checkpoints and their reading, and what a stopped run left.

checkpoint.npz holds the last finished epoch, best.npz the epoch of least validation error,
config.json the run's RunConfig (from which pympgu.evaluate builds the model). Each is
replaced atomically, so that a crash leaves the previous one whole.
"""
import json
import os

CHECKPOINT = "checkpoint.npz"
BEST = "best.npz"  # the checkpoint of the epoch of least validation error
CONFIG = "config.json"  # the run's flags, from which pympgu.evaluate builds its model
# A fresh run's config.json while the directory still holds an earlier run's checkpoints:
# rank 0 moves it into place beside its own first checkpoint.
CONFIG_NEXT = "config.json.next"
METRICS = "metrics.jsonl"
CURVES = "curves.png"
FILES = (CONFIG, CONFIG_NEXT, METRICS, CHECKPOINT, BEST, CURVES)  # what a run writes


def save(out, model, values, epoch, history, name=CHECKPOINT, extra=None):
    """Write ``model``'s state (``values``, numpy or JAX arrays in its state's order) and its
    batch norms' statistics as the checkpoint of ``epoch`` into ``out`` (an OutDir),
    atomically; ``extra``: more arrays by name (read_extra's), such as DiLoCo's outer
    momentum."""
    import numpy as np
    arrays = {s.name: np.asarray(v) for s, v in zip(model.state, values)}
    # The norms' population statistics that the epoch's errors were evaluated with.
    arrays.update({s.name: s.get_value() for s in model.statistics})
    arrays.update({f"__{key}__": np.asarray(v) for key, v in (extra or {}).items()})
    out.write(name, lambda f: np.savez(f, __epoch__=epoch, __history__=json.dumps(history),
                                       __model__=model.describe(),
                                       __optimizer__=model.optimizer, **arrays))


def read_extra(path, key):
    """The array ``key`` that save's ``extra`` put into the checkpoint at ``path``, or None."""
    import numpy as np
    with np.load(path) as f:
        name = f"__{key}__"
        return f[name].astype(np.float32) if name in f.files else None


def keep_best(out):
    """Keep --out's checkpoint as best.npz too (a copy, replaced atomically)."""
    out.copy(CHECKPOINT, BEST)


def read(path, model, use="--resume {path}: cannot resume from it", variables=None, note=None):
    """(epoch, history, values of ``variables``: ``model``'s state by default) from a
    checkpoint that save wrote, or a ValueError, ``use`` (formatted with the path) and what
    does not fit this model. ``note`` is called with a line when the checkpoint fits but
    another optimizer trained it (Adam's moments serve AdamW as they are, and back), which
    nothing else would tell."""
    try:
        return _read(path, model, variables, note)
    except _Mismatch as e:
        made, e = e.args[1], e.args[0]
        builds = f"{model.describe()}, trained by {model.optimizer}"
        other = f" (it holds {made}; this run builds {builds})" if made and made != builds else ""
        raise ValueError(f"{use.format(path=path)}: {e}{other}") from None
    except FileNotFoundError:
        raise ValueError(f"{use.format(path=path)}: no such file") from None
    except Exception as e:  # truncated, emptied, bits flipped: zipfile, zlib, numpy, json
        raise ValueError(f"{use.format(path=path)}: it is damaged "
                         f"({type(e).__name__}: {e}){_intact_beside(path)}") from None


class _Mismatch(Exception):
    """A checkpoint that reads, of another model: (what, what it holds)."""


def _intact_beside(path):
    """Where a damaged checkpoint has an intact sibling (checkpoint.npz and best.npz keep
    each other's company): how to resume from it, in words."""
    for name in (CHECKPOINT, BEST):
        other = os.path.join(os.path.dirname(os.path.abspath(path)), name)
        if os.path.abspath(path) != other and (epoch := _intact(other)) is not None:
            return f"; {other} is intact (epoch {epoch}): --resume {other}"
    return ""


def _intact(path):
    """The epoch of the checkpoint at ``path`` if every array of it reads (each one's CRC
    checked), else None."""
    try:
        import numpy as np
        with np.load(path) as f:
            for name in f.files:
                f[name]
            return int(f["__epoch__"])
    except Exception:
        return None


def _read(path, model, variables, note):
    import numpy as np
    made = None
    try:
        with np.load(path) as f:
            epoch = int(f["__epoch__"])
            history = json.loads(str(f["__history__"]))
            # Checkpoints of SGD runs may lack the optimizer's name.
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
                    raise _Mismatch(f"it has no {name!r}", made)
                v = f[name]
                if v.shape != s.get_value(borrow=True).shape:
                    raise _Mismatch(f"{s.name!r} is {v.shape}, this model's is "
                                    f"{s.get_value(borrow=True).shape}", made)
                values.append(v.astype(np.float32))
    except KeyError as e:  # a checkpoint of pympgu's, but not one save wrote
        raise _Mismatch(f"it has no {e}", made) from None
    if note and saved != model.optimizer:
        note(f"{path}: its state was trained by {saved}; this run goes on by {model.optimizer}")
    if note and started:
        note(f"{path}: it holds no moving average of the parameters; this run starts one at "
             "them (--ema)")
    return epoch, history, values


def sync_metrics(out):
    """Make --out's metrics.jsonl (``out``, an OutDir) the log of the epochs its checkpoint
    holds: a later epoch's line goes (a run resumed there replaces it, not repeats it),
    and a line the checkpoint has and the log lacks is restored from the checkpoint's
    history (a run stopped between its checkpoint and its line)."""
    import numpy as np
    try:
        with out.open_read(CHECKPOINT) as f, np.load(f) as z:
            epoch = int(z["__epoch__"])
            history = json.loads(str(z["__history__"]))
    except Exception:  # no checkpoint, or none readable: the log is all there is
        return
    try:
        with out.open_read(METRICS, "r") as f:
            lines = f.readlines()
    except FileNotFoundError:
        lines = []
    logged, kept, events = set(), [], []
    for line in lines:
        try:
            record = json.loads(line)
            e = record["epoch"]
        except (ValueError, KeyError, TypeError):
            continue  # a line cut by a crash
        line = line if line.endswith("\n") else line + "\n"
        if "event" in record:  # what happened during the epoch (a lost worker): kept
            events.append((e, line))
        elif e <= epoch and e not in logged:
            logged.add(e)
            kept.append((e, line))
    restored = [h for h in history if h.get("epoch") not in logged and h["epoch"] <= epoch]
    byepoch = dict(kept)
    byepoch.update({h["epoch"]: json.dumps(h) + "\n" for h in restored})
    # An event before the line of its epoch (sorted is stable: in their order).
    rows = sorted([(e, 0, x) for e, x in events] + [(e, 1, x) for e, x in byepoch.items()],
                  key=lambda r: r[:2])
    text = "".join(x for _, _, x in rows)
    if text != "".join(lines):
        out.write_text(METRICS, text)


def epoch_of(path):
    """The epoch after which the checkpoint at ``path`` was written, or None where there is
    none (or it cannot be read: this runs on the error path too, and never fails)."""
    try:
        import numpy as np
        with np.load(path) as f:  # lazy: reads this one entry
            return int(f["__epoch__"])
    except Exception:
        return None


def stamp(out):
    """When --out's checkpoint was last written (ns), or None: rank 0 replaces the file
    after each epoch, so a new stamp means a new checkpoint."""
    try:
        return os.stat(os.path.join(out, CHECKPOINT)).st_mtime_ns if out else None
    except OSError:
        return None


def replaces_a_run(out, resume):
    """Whether a run writing into ``out`` replaces another run's checkpoints there: one it
    does not resume from (a --resume from elsewhere appends to no log but its own)."""
    if not out or not os.path.exists(os.path.join(out, CHECKPOINT)):
        return False
    return not resume or (os.path.realpath(os.path.dirname(os.path.abspath(resume)))
                          != os.path.realpath(out))


def left(out, before):
    """What a run stopped early (interrupted, or a worker failed) leaves to resume from, in
    words: the training itself is lost, but each finished epoch was checkpointed under
    --out. ``before``: stamp(out) when the run started, to tell its checkpoint from one an
    earlier run left in the same directory."""
    if not out:
        return "nothing was saved (--out DIR keeps a checkpoint after every epoch)"
    path = os.path.join(out, CHECKPOINT)
    epoch = epoch_of(path)
    if epoch is None:
        if os.path.exists(path):
            return f"{path} cannot be read as a checkpoint"
        return f"no epoch finished, so {out} holds no checkpoint"
    if stamp(out) == before:
        return f"no epoch of this run finished; {path} is an earlier run's (epoch {epoch})"
    return f"epoch {epoch}'s checkpoint is in {path}: continue with --resume {out}"


def epochs_since_best(history):
    """Epochs since the one of least validation error in ``history`` (the first of equals,
    the one best.npz keeps): 0 when the last epoch is the best."""
    errors = [h["valid_error"] for h in history]
    return len(errors) - 1 - errors.index(min(errors))
