"""``python -m pympgu.train``: train one network on several GPUs or CPU workers.

The command lives in pympgu.training (its --help says everything); this module keeps its
name, and forwards the names it used to hold there with a DeprecationWarning.
"""
import sys
import warnings

from .training.cli import main

# Names this module held, and where they live now.
_MOVED = {
    "run": "pympgu.training.launcher", "Reporter": "pympgu.training.report",
    "plot": "pympgu.training.report", "build_parser": "pympgu.training.cli",
    "resolve": "pympgu.training.cli", "worker": "pympgu.training.worker",
    "make_exchanger": "pympgu.training.worker", "make_schedule": "pympgu.training.worker",
    "Replica": "pympgu.training.replica", "build_model": "pympgu.training.replica",
    "state_layout": "pympgu.training.replica", "Sync": "pympgu.training.sync",
    "same_start": "pympgu.training.sync", "UsageError": "pympgu.training.config",
    "RunConfig": "pympgu.training.config", "PRESETS": "pympgu.training.config",
    "optimizer_defaults": "pympgu.training.config", "auto_backend": "pympgu.training.config",
    "ADAM_LR": "pympgu.training.config", "ADAMW_DECAY": "pympgu.training.config",
    "MODEL_SEED": "pympgu.training.config", "CHECKPOINT": "pympgu.training.checkpoint",
    "BEST": "pympgu.training.checkpoint", "CONFIG": "pympgu.training.checkpoint",
    "CONFIG_NEXT": "pympgu.training.checkpoint",
}


def __getattr__(name):
    where = _MOVED.get(name)
    if where is None:
        raise AttributeError(f"module 'pympgu.train' has no attribute {name!r}")
    warnings.warn(f"pympgu.train.{name} is deprecated: it is {where}.{name}",
                  DeprecationWarning, stacklevel=2)
    import importlib
    return getattr(importlib.import_module(where), name)


if __name__ == "__main__":
    sys.exit(main())
