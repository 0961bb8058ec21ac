"""The model that --model names, loaded and built for the run's data and trained by its
Recipe: the settings of training that the model, its optimizer and its step take."""
import os
import sys

from .._pytensor import import_pytensor
from .mlp import MLP
from .model import Model
from .recipe import Recipe


class ModelError(ValueError):
    """A --model that cannot be loaded or built; the message names it."""


def load(spec) -> type:
    """The Model subclass that ``spec`` names: ``FILE.py:NAME`` (a path) or
    ``MODULE:NAME`` (importable, as ``pympgu.models:MLP``); None gives MLP."""
    import importlib
    import importlib.util
    if spec is None:
        return MLP
    import_pytensor()  # floatX set before the model's own module imports PyTensor
    where, sep, name = str(spec).rpartition(":")
    if not sep or not where or not name.isidentifier():
        raise ModelError(f"--model {spec}: give FILE.py:CLASS or MODULE:CLASS")
    try:
        if where.endswith(".py"):
            path = os.path.abspath(where)
            if not os.path.isfile(path):
                raise ModelError(f"--model {spec}: no such file {where}")
            # One module per file, named after its path, so that every worker and the
            # launcher load the same one once.
            key = "pympgu_user_model_" + "".join(c if c.isalnum() else "_" for c in path)
            module = sys.modules.get(key)
            if module is None:
                loader = importlib.util.spec_from_file_location(key, path)
                module = importlib.util.module_from_spec(loader)
                sys.modules[key] = module
                try:
                    loader.loader.exec_module(module)
                except BaseException:
                    del sys.modules[key]
                    raise
        else:
            module = importlib.import_module(where)
    except ModelError:
        raise
    except Exception as e:
        raise ModelError(f"--model {spec}: loading {where} failed: "
                         f"{type(e).__name__}: {e}") from e
    cls = getattr(module, name, None)
    if cls is None:
        raise ModelError(f"--model {spec}: {where} has no {name!r}")
    if not (isinstance(cls, type) and issubclass(cls, Model)):
        raise ModelError(f"--model {spec}: {name} is not a subclass of pympgu.models.Model "
                         "(docs/MODELS.md says what one defines)")
    return cls


def build(spec, n_in, hidden, n_out, seed=1234, recipe=None, **settings) -> "Model":
    """The model that ``spec`` names (load), built for this data as ``cls(n_in, hidden,
    n_out, seed=seed)`` and trained as ``recipe`` says (a Recipe; or its fields given by
    name), with its parameters and state checked."""
    if recipe is None:
        recipe = Recipe(**settings)
    elif settings:
        raise TypeError("build takes a recipe or its settings, not both")
    cls = load(spec)
    try:
        model = cls(n_in, list(hidden), n_out, seed=seed)
    except Exception as e:
        raise ModelError(f"--model {spec or 'MLP'}: {cls.__name__}(n_in={n_in}, "
                         f"hidden={list(hidden)}, n_out={n_out}, seed={seed}) failed: "
                         f"{type(e).__name__}: {e}") from e
    if "params" not in model.__dict__ or not model.params:
        raise ModelError(f"--model {spec}: {cls.__name__} made no parameters (its __init__ "
                         "must call super().__init__() and then self.parameter(...))")
    model.set_optimizer(recipe.optimizer, beta2=recipe.beta2, weight_decay=recipe.weight_decay,
                        nesterov=recipe.nesterov, clip_norm=recipe.clip_norm, ema=recipe.ema)
    if not 0 <= recipe.label_smoothing < 1:
        raise ValueError(f"label_smoothing must be in [0, 1), got {recipe.label_smoothing}")
    model.recipe = recipe
    model.dropout_rate = float(recipe.dropout)
    model.label_smoothing = float(recipe.label_smoothing)
    model.flip, model.shift = bool(recipe.flip), int(recipe.shift)
    return model
