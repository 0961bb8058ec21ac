"""Models in Theano style on PyTensor, and how pympgu trains them.

``Model`` (model) is what pympgu.train trains: its subclasses make their parameters and
define their logits; it compiles the step (compiling: softmax cross-entropy, L1/L2 terms,
the optimizer of optimizers' registry). ``MLP`` (mlp) is the 2014 demo's; ``load`` and
``build`` (loading) give the model that --model names, trained as a ``Recipe`` says
(docs/MODELS.md). Batch norms (norms), noise (noise) and what runs a compiled model
(running) have modules of their own.
"""
from ..errors import FlagError
from .loading import ModelError, build, load
from .mlp import MLP
from .model import AVERAGE, SLOT_KINDS, Model
from .norms import BatchNorm
from .optimizers import OPTIMIZERS
from .recipe import Recipe
from .running import (STATISTICS_EXAMPLES, error_rates, one_hot, seed_noise,
                      statistics_batches)

__all__ = ["AVERAGE", "BatchNorm", "FlagError", "MLP", "Model", "ModelError", "OPTIMIZERS",
           "Recipe", "SLOT_KINDS", "STATISTICS_EXAMPLES", "build", "error_rates", "load",
           "one_hot", "seed_noise", "statistics_batches"]
