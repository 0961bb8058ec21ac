"""A resumed run's settings: those of the run it continues (the config.json beside its
checkpoint), the flags given on the resume in their place; what changed is said in one
line and kept in config.json's "changes", epoch by epoch."""
import dataclasses
import json
import os

from .checkpoint import CONFIG
from .config import RunConfig, UsageError

# What names the run's files, not what it trains: never carried over, never a change.
_PLACE = ("out", "resume")


def saved(checkpoint_path):
    """(RunConfig, its earlier changes) of the run that wrote ``checkpoint_path``, from
    the config.json beside it; (None, []) where there is none."""
    path = os.path.join(os.path.dirname(checkpoint_path), CONFIG)
    try:
        with open(path) as f:
            values = json.load(f)
        return RunConfig.from_json(values), list(values.get("changes", []))
    except FileNotFoundError:
        return None, []
    except (OSError, ValueError, TypeError) as e:
        raise UsageError("--resume", f"--resume: {path} cannot be read ({e}); give the "
                                     "run's flags again with --resume and --out elsewhere, "
                                     "or mend it") from None


def carried(cfg):
    """The settings of ``cfg`` that a resumed run starts from."""
    values = dataclasses.asdict(cfg)
    for key in _PLACE:
        values.pop(key)
    return values


def changes(before, after):
    """{setting: [before, after]} where the RunConfig ``after`` differs from ``before``."""
    b, a = before.to_json(), after.to_json()
    return {k: [b[k], a[k]] for k in b if k not in _PLACE and b[k] != a[k]}


def describe(changed, given):
    """The changes in words: 'lr 0.13 -> 0.05 (given), nnodes 1 -> 2'."""
    return ", ".join(f"{k} {_show(k, old)} -> {_show(k, new)}" +
                     (" (given)" if k in given else "") for k, (old, new) in changed.items())


def _show(key, value):
    if key == "devices":
        return (f"{len(value)} CPU worker{'s' * (len(value) > 1)}" if value[0] == "cpu"
                else "GPU" + "s" * (len(value) > 1) + " " + ",".join(map(str, value)))
    return " ".join(map(str, value)) if isinstance(value, list) else str(value)


def history(resume, epoch, changed):
    """config.json's "changes" for a run resumed at ``epoch`` from ``resume``: the resumed
    run's own, and this resume's where it changes anything."""
    earlier = saved(resume)[1] if resume else []
    return earlier + ([{"epoch": epoch, "changed": changed}] if changed else [])
