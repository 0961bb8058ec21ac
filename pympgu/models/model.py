"""The Model that pympgu trains, in Theano style on PyTensor: shared variables,
``pytensor.grad`` and ``updates``. Its subclasses make their parameters and define their
logits; it holds the state the replicas average (the parameters, the optimizer's slots,
their moving average) and compiles the step (pympgu.models.compiling)."""
import numpy as np

from .._pytensor import import_pytensor
from . import norms
from .noise import Noise
from .optimizers import OPTIMIZERS
from .optimizers import get as get_optimizer
from .recipe import Recipe

# The prefix of the parameters' moving average (Model.set_optimizer's ``ema``).
AVERAGE = "ema"
# Every prefix the state's arrays may take: a parameter's name must not collide with them.
SLOT_KINDS = sorted({kind for o in OPTIMIZERS.values() for kind in o.slots} | {AVERAGE})


class Model(Noise):
    """A classifier that pympgu trains: subclass it, create its parameters with
    ``self.parameter(...)`` in ``__init__``, and define ``logits(x)``.

    pympgu builds it as ``Model(n_in, hidden, n_out, seed=seed)`` (``hidden``: the
    ``--hidden`` widths, which a model may ignore) in every worker, and trains it by
    minibatch SGD with momentum (or Adam, or AdamW: set_optimizer) on the mean softmax
    cross-entropy (against targets smoothed by ``label_smoothing``), with the L1 and L2
    terms of ``--l1`` and ``--l2`` on the parameters made with ``penalized=True``, and
    ``--dropout`` where ``logits`` calls ``self.dropout``. Every worker must build the
    same initial values: draw them from ``seed`` (the training loop checks that the
    replicas start identical).
    ``python -m pympgu.train --model FILE.py:NAME`` trains one (docs/MODELS.md).
    ``default_hidden`` is what ``hidden`` is when ``--hidden`` is not given.
    """

    default_hidden = (500,)  # the seed's one layer of 500 units
    # True while compile builds the training step's graph, so that logits can tell it from
    # evaluation's (Model.dropout does).
    training = False

    def __init__(self):
        self.params, self.weights = [], []
        self.optimizer, self.beta2, self.eps, self.weight_decay = "sgd", 0.999, 1e-8, 0.0
        self.nesterov, self.clip_norm, self.ema = False, 0.0, 0.0
        self._slots = None
        self.lr = self.decay = None  # compile's shared rates (rate_vars)
        self.dropout_rate, self._dropped = 0.0, False
        # --label-smoothing: the training targets' share spread evenly over every class.
        self.label_smoothing = 0.0
        self.flip, self.shift = False, 0  # --flip, --shift: training images varied
        self.noise_rng, self.noise_updates = None, []
        self.norms = []  # BatchNorm layers, in the order batch_norm made them
        self._recorded = None  # name: (mean, var) while compile traces the statistics
        self.statistics_fn = None  # compile's, where the model has norms
        self.recipe = Recipe()  # what compile takes where not given (build sets it)

    def parameter(self, value, name, penalized=True):
        """A new float32 parameter (a PyTensor shared variable) holding ``value``. ``name``
        keys it in checkpoints and must be unique; ``penalized``: the L1 and L2 terms apply
        to it (weights are, biases are not)."""
        pytensor = import_pytensor()
        if "params" not in self.__dict__:
            raise TypeError(f"{type(self).__name__}.__init__ must call Model.__init__ "
                            "(super().__init__()) before creating parameters")
        if self._slots is not None:
            raise TypeError(f"parameter {name!r}: create every parameter in __init__, before "
                            "the model's state is used")
        value = np.asarray(value)
        if not np.issubdtype(value.dtype, np.floating) or value.ndim == 0:
            raise ValueError(f"parameter {name!r}: give a float array with at least one "
                             f"dimension, got {value.dtype} of shape {value.shape}")
        # Each optimizer's state takes the names <kind>_<parameter> (slots).
        taken = {p.name for p in self.params}
        taken |= {f"{kind}_{t}" for kind in SLOT_KINDS for t in taken}
        if (not isinstance(name, str) or not name or name.startswith("__") or name in taken
                or any(f"{kind}_{name}" in taken for kind in SLOT_KINDS)):
            raise ValueError(f"parameter name {name!r} is empty, reserved (__...) or taken "
                             f"(this model has {sorted(taken)})")
        p = pytensor.shared(value.astype(np.float32), name=name)
        self.params.append(p)
        if penalized:
            self.weights.append(p)
        return p


    def set_optimizer(self, name, beta2=0.999, eps=1e-8, weight_decay=0.0, nesterov=False,
                      clip_norm=0.0, ema=0.0):
        """Train with ``name`` (pympgu.models.optimizers): 'sgd', SGD with momentum (the default),
        'adam', or 'adamw', Adam with decoupled weight decay (Loshchilov and Hutter,
        "Decoupled Weight Decay Regularization", 2019): each step multiplies the penalized
        parameters by ``1 - rate * weight_decay``, the schedule's rate without Adam's bias
        correction, as torch.optim.AdamW does, rather than adding a penalty's gradient that
        Adam would divide by its second moment. ``beta2`` and ``eps`` are Adam's (its beta1
        is compile's ``momentum``). ``nesterov``: SGD's step takes Nesterov's momentum
        (Sutskever et al. 2013, as torch.optim.SGD's ``nesterov``), the parameters moved by
        ``momentum * v_new - lr * g`` rather than ``v_new``. ``clip_norm``, when above 0:
        every step scales its gradients by ``min(1, clip_norm / (norm + 1e-6))``, ``norm``
        the 2-norm of them all together, as torch.nn.utils.clip_grad_norm_ does (the L1
        and L2 terms' gradients included; AdamW's decay is not a gradient). ``ema``, when
        above 0: the state also holds an exponential moving average of the parameters,
        ``ema_<name>`` (``averages``), started at their first values and moved after every
        step by ``ema * average + (1 - ema) * parameter``, as timm's ModelEmaV2 does;
        evaluation reads it in place of the parameters. Call it before the state is used:
        it decides what the state holds."""
        optimizer = get_optimizer(name)
        if self._slots is not None:
            raise TypeError("set_optimizer: the state was already made; call it first")
        if not 0 <= beta2 < 1 or not eps > 0:
            raise ValueError(f"Adam needs 0 <= beta2 < 1 and eps > 0, got {beta2} and {eps}")
        if not 0 <= weight_decay < 1 or (weight_decay and not optimizer.decays):
            raise ValueError(f"weight_decay is AdamW's, in [0, 1): got {weight_decay} for "
                             f"{name!r}")
        if nesterov and not optimizer.nesterov:
            raise ValueError(f"nesterov is SGD's momentum, not {name!r}'s")
        if not clip_norm >= 0:
            raise ValueError(f"clip_norm must be 0 (no clipping) or above, got {clip_norm}")
        if not 0 <= ema < 1:
            raise ValueError(f"ema must be in [0, 1) (0: no moving average), got {ema}")
        self.clip_norm, self.ema = float(clip_norm), float(ema)
        self.optimizer, self.beta2, self.eps = name, float(beta2), float(eps)
        self.weight_decay, self.nesterov = float(weight_decay), bool(nesterov)


    @property
    def slots(self):
        """The optimizer's state, one array per parameter and kind, zeros at first: SGD's
        momentum ``v_<name>``; Adam's first and second moments ``m_<name>``, then
        ``s_<name>``; then, with ``ema``, the parameters' moving average ``ema_<name>``,
        the parameters' values at first. Made on first use, when every parameter exists."""
        if self._slots is None:
            pytensor = import_pytensor()
            self._slots = [pytensor.shared(np.zeros(p.get_value(borrow=True).shape, np.float32),
                                           name=f"{kind}_{p.name}")
                           for kind in OPTIMIZERS[self.optimizer].slots for p in self.params]
            if self.ema:
                self._slots += [pytensor.shared(p.get_value().astype(np.float32),
                                                name=f"{AVERAGE}_{p.name}")
                                for p in self.params]
        return self._slots

    @property
    def averages(self):
        """The parameters' moving averages (``ema``), in the parameters' order; [] without."""
        return self.slots[len(self.slots) - len(self.params):] if self.ema else []

    def batch_norm(self, channels, name, gamma=1.0):
        """A batch normalisation layer (Ioffe and Szegedy 2015) of ``channels``: call it
        in ``logits`` on x (batch, channels, ...) to normalise each channel (a dense
        layer's unit, a convolution's map) over the batch and every other axis, then scale
        by a parameter ``gamma_<name>`` and shift by ``beta_<name>`` (neither penalized).
        ``gamma`` is the scale's first value (0 starts a residual branch at nothing).

        The training step normalises by each minibatch's own mean and variance, as each
        rank sees it. Evaluation normalises by the population's, which are not trained
        state: before each evaluation they are estimated from STATISTICS_EXAMPLES training
        examples with the parameters as they are (estimate_statistics), so the replicas
        stay identical and nothing but the parameters and the optimizer's state is averaged
        (docs/MODELS.md, "Batch normalisation")."""
        norm = norms.BatchNorm(self, int(channels), name, gamma)
        self.norms.append(norm)
        return norm

    @property
    def statistics(self):
        """Every norm's population mean and variance (shared variables ``__mean_<name>``
        and ``__var_<name>``): saved in checkpoints, neither trained nor averaged."""
        return [v for norm in self.norms for v in (norm.mean, norm.var)]


    def estimate_statistics(self, batches):
        """Set every norm's population mean and variance to those of its input over the
        training examples of ``batches`` (index arrays of compile's batch size), computed
        as training computes them, each minibatch normalised by its own statistics at
        every norm, but with no dropout and the images unvaried, as evaluation sees them
        (Wu and Johnson's 'precise BN'; norms.estimate). Does nothing for a model without
        norms."""
        if self.statistics_fn is not None:
            norms.estimate(self.norms, self.statistics_fn, batches)


    @property
    def state(self):
        """Every shared variable the replicas average: the parameters, then the optimizer's
        state (``slots``, the moving average last), each kind in the parameters' order."""
        return self.params + self.slots

    @property
    def affine_update(self):
        """Whether the update is affine in the gradients (SGD's is, Adam's is not, nor a
        clipped one's): then averaging the replicas' updates is updating by their mean
        gradient (pympgu.training.sync.Sync says where that matters)."""
        return OPTIMIZERS[self.optimizer].affine and not self.clip_norm

    def step_size(self, lr, t):
        """The learning rate that step ``t`` (counted from 1) applies for a base ``lr``:
        ``lr`` itself for SGD; for Adam, with both moments' bias correction folded in,
        ``lr * sqrt(1 - beta2**t) / (1 - beta1**t)``. Adam's beta1 is compile's
        ``momentum``: call it after compile."""
        return OPTIMIZERS[self.optimizer].step_size(lr, t, getattr(self, "beta1", 0.0),
                                                    self.beta2)

    @property
    def rate_vars(self):
        """compile's shared scalars that the rates of each step set (rates): the step size
        ``lr``, and a decaying optimizer's (AdamW's) decay ``decay``."""
        return [self.lr] + ([self.decay] if OPTIMIZERS[self.optimizer].decays else [])

    def rates(self, lr, t):
        """The values of rate_vars at step ``t`` (from 1) for the schedule's rate ``lr``:
        step_size, and AdamW's ``lr * weight_decay``, which takes no bias correction."""
        size = self.step_size(lr, t)
        return (size, lr * self.weight_decay) if OPTIMIZERS[self.optimizer].decays else (size,)

    @property
    def parameter_count(self):
        """How many numbers the parameters hold."""
        return sum(int(np.prod(p.get_value(borrow=True).shape)) for p in self.params)

    def describe(self):
        """The model in a few words, for the run's first line."""
        return f"{type(self).__name__} ({self.parameter_count:,} parameters)"

    def logits(self, x):
        """The unnormalised class scores (batch, n_out) of x (batch, n_in), in PyTensor."""
        raise NotImplementedError(f"{type(self).__name__} must define logits(x)")

    def _static_shape(self, out):
        """``out``'s shape as far as PyTensor can tell before running it. Shared variables
        have no static shape, so the graph is rebuilt once with the parameters' shapes
        given (cheap: no compilation); where that fails, its own static shape."""
        import pytensor.tensor as pt
        from pytensor.graph.replace import clone_replace
        given = {p: pt.tensor(p.name, dtype=p.dtype, shape=p.get_value(borrow=True).shape)
                 for p in self.params}
        try:
            out = clone_replace(out, given, rebuild_strict=False)
        except Exception:  # an Op that cannot be rebuilt so: the check is a courtesy
            pass
        return tuple(out.type.shape)

    def compile(self, dataset, batch_size, eval_batch, lr=None, momentum=None, l1=None,
                l2=None, mode="FAST_RUN"):
        """Compile (train(idx) -> cost, evaluate(idx) -> per-example errors).

        train takes int32 indices (batch_size,) into the training set; evaluate takes
        indices (eval_batch,) into validation followed by test examples. ``lr`` is the
        first learning rate: ``self.lr``, a shared variable, holds it, and a schedule sets
        it between steps. ``momentum`` is SGD's momentum, or Adam's beta1. Each of ``lr``,
        ``momentum``, ``l1`` and ``l2`` not given is the model's Recipe's (build's).
        """
        from .compiling import compile_model
        recipe = self.recipe
        given = dict(lr=lr, momentum=momentum, l1=l1, l2=l2)
        given = {k: getattr(recipe, k) if v is None else v for k, v in given.items()}
        return compile_model(self, dataset, batch_size, eval_batch, mode=mode, **given)
