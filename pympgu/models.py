"""Models in Theano style on PyTensor: shared variables, ``pytensor.grad`` and ``updates``.

``Model`` is what pympgu.train trains: its subclasses make their parameters and define their
logits, and it compiles the step (softmax cross-entropy, L1/L2 terms, SGD with momentum or
Adam).
``MLP`` is the seed's (784-500-10, tanh hidden layers) and its deeper and wider variants;
``load`` and ``build`` give the model that --model names (docs/MODELS.md). The training set and the evaluation sets are shared variables too, so
on a GPU they live in device memory and a minibatch is gathered there from an index vector;
only the indices cross from the host each step. Shapes are static (PyTensor's JAX backend
needs them) and targets are one-hot.
"""
import math
import os
import sys

import numpy as np

from ._pytensor import import_pytensor


# Each optimizer's state per parameter, by the prefix of its arrays' names.
OPTIMIZERS = {"sgd": ("v",), "adam": ("m", "s"), "adamw": ("m", "s")}
# The prefix of the parameters' moving average (Model.set_optimizer's ``ema``).
AVERAGE = "ema"
# Every prefix the state's arrays may take: a parameter's name must not collide with them.
SLOT_KINDS = sorted({kind for kinds in OPTIMIZERS.values() for kind in kinds} | {AVERAGE})

# How many training examples a batch norm's population mean and variance are estimated
# from before each evaluation (Model.estimate_statistics; Wu and Johnson's PreciseBN in
# "Rethinking 'Batch' in BatchNorm", 2021): as many as MMClassification's PreciseBNHook
# takes by default.
STATISTICS_EXAMPLES = 8192


def one_hot(labels, n_classes):
    out = np.zeros((len(labels), n_classes), np.float32)
    out[np.arange(len(labels)), labels] = 1.0
    return out


class Model:
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
        """Train with ``name`` (OPTIMIZERS): 'sgd', SGD with momentum (the default),
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
        if name not in OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {list(OPTIMIZERS)}, got {name!r}")
        if self._slots is not None:
            raise TypeError("set_optimizer: the state was already made; call it first")
        if not 0 <= beta2 < 1 or not eps > 0:
            raise ValueError(f"Adam needs 0 <= beta2 < 1 and eps > 0, got {beta2} and {eps}")
        if not 0 <= weight_decay < 1 or (weight_decay and name != "adamw"):
            raise ValueError(f"weight_decay is AdamW's, in [0, 1): got {weight_decay} for "
                             f"{name!r}")
        if nesterov and name != "sgd":
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
                           for kind in OPTIMIZERS[self.optimizer] for p in self.params]
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
        norm = BatchNorm(self, int(channels), name, gamma)
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
        (Wu and Johnson's 'precise BN'). The mean is the mean of the batches' means, the
        variance the mean of their variances plus the variance of their means: the
        variance over every example. Does nothing for a model without norms."""
        if self.statistics_fn is None:
            return
        # Per batch, every norm's mean and variance in turn (statistics_fn's outputs).
        outs = [[np.asarray(v, np.float64) for v in self.statistics_fn(idx)] for idx in batches]
        if not outs:
            raise ValueError("estimate_statistics: no batches")
        for k, norm in enumerate(self.norms):
            means = np.stack([o[2 * k] for o in outs])
            variances = np.stack([o[2 * k + 1] for o in outs])
            norm.mean.set_value(means.mean(axis=0).astype(np.float32))
            norm.var.set_value((variances.mean(axis=0) + means.var(axis=0)).astype(np.float32))

    @property
    def state(self):
        """Every shared variable the replicas average: the parameters, then the optimizer's
        state (``slots``, the moving average last), each kind in the parameters' order."""
        return self.params + self.slots

    @property
    def affine_update(self):
        """Whether the update is affine in the gradients (SGD's is, Adam's is not, nor a
        clipped one's): then averaging the replicas' updates is updating by their mean
        gradient (pympgu.train.Sync says where that matters)."""
        return self.optimizer == "sgd" and not self.clip_norm

    def step_size(self, lr, t):
        """The learning rate that step ``t`` (counted from 1) applies for a base ``lr``:
        ``lr`` itself for SGD; for Adam, with both moments' bias correction folded in,
        ``lr * sqrt(1 - beta2**t) / (1 - beta1**t)`` (Kingma and Ba's Algorithm 1 in its
        efficient form: ``eps`` is added to the uncorrected square root). Adam's beta1 is
        compile's ``momentum``: call it after compile."""
        if self.optimizer == "sgd":
            return lr
        return lr * math.sqrt(1.0 - self.beta2 ** t) / (1.0 - self.beta1 ** t)

    @property
    def rate_vars(self):
        """compile's shared scalars that the rates of each step set (rates): the step size
        ``lr``, and AdamW's decay ``decay``."""
        return [self.lr] + ([self.decay] if self.optimizer == "adamw" else [])

    def rates(self, lr, t):
        """The values of rate_vars at step ``t`` (from 1) for the schedule's rate ``lr``:
        step_size, and AdamW's ``lr * weight_decay``, which takes no bias correction."""
        size = self.step_size(lr, t)
        return (size, lr * self.weight_decay) if self.optimizer == "adamw" else (size,)

    def dropout(self, x, rate=None):
        """``x`` with each value zeroed with probability ``rate`` in the training step, the
        others scaled by 1 / (1 - rate) (inverted dropout, so that evaluation, which takes
        ``x`` as it is, sees the same expected values). ``rate`` defaults to the run's
        ``--dropout`` (``dropout_rate``); at 0 the graph is ``x`` itself."""
        import pytensor.tensor as pt
        rate = self.dropout_rate if rate is None else float(rate)
        if not 0 <= rate < 1:
            raise ValueError(f"dropout rate must be in [0, 1), got {rate}")
        self._dropped = True
        if not self.training or rate == 0:
            return x
        # The size as constants where the parameters' shapes give it: x.shape would put
        # the graph's shape checks (a bias's width against its weights') into the step.
        static = self._static_shape(x)
        size = tuple(x.shape[i] if d is None else d for i, d in enumerate(static))
        keep = np.float32(1 - rate)
        return pt.switch(self._uniform(size) < keep, x / keep, pt.zeros_like(x))

    def _uniform(self, size):
        """Uniform numbers in [0, 1) of ``size``, drawn in the training step from the
        generator that the previous draw left (training_logits makes the last one the
        step's update of noise_rng)."""
        from pytensor.tensor.random import uniform
        u = uniform(size=size, rng=self._drawn[-1])
        self._drawn.append(u.owner.outputs[0])
        return u

    def _augmented(self, x):
        """The training minibatch x (batch, n_in), static sizes, with each image flipped
        and shifted as --flip and --shift say (pympgu.nnet.augment), flat again."""
        if not (self.flip or self.shift):
            return x
        from .nnet import augment, square_images
        batch, n_in = x.type.shape
        flag = "--flip" if self.flip else "--shift"
        try:
            channels, side = square_images(n_in, flag)
        except ValueError as e:
            raise FlagError(flag, str(e)) from None
        if not 0 <= self.shift < side:
            raise FlagError("--shift", f"--shift {self.shift}: give 0 to {side - 1} pixels for "
                            f"images of {side}x{side}")
        images = augment(x.reshape((batch, channels, side, side)),
                         flip=self._uniform((batch,)) if self.flip else None, shift=self.shift,
                         offsets=self._uniform((batch, 2)) if self.shift else None)
        return images.reshape((batch, n_in))

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

    def training_logits(self, x):
        """``logits(x)`` as the training step computes them: of x's images flipped and
        shifted as ``flip`` and ``shift`` say (x's sizes static then), with ``training``
        set, so that Model.dropout draws its masks. Raises FlagError if the run asks for
        dropout (``dropout_rate``) and logits has none to apply it, or asks to vary images
        that x does not hold."""
        pytensor = import_pytensor()
        if self.noise_rng is None:
            # One generator for the whole step, which pympgu.train seeds for each rank and
            # epoch (seed_noise): ranks draw different masks, and a run resumed at an epoch
            # draws what the run it continues would have.
            self.noise_rng = pytensor.shared(np.random.default_rng(0), name="__noise")
        self._dropped, self.training, self._drawn = False, True, [self.noise_rng]
        try:
            logits = self.logits(self._augmented(x))
        finally:
            self.training = False
        # The update that compile adds to the step's, when the step draws anything.
        self.noise_updates = [(self.noise_rng, self._drawn[-1])] if len(self._drawn) > 1 else []
        if self.dropout_rate and not self._dropped:
            raise FlagError("--dropout", f"--dropout {self.dropout_rate}: {type(self).__name__}"
                            ".logits has no dropout (it calls no self.dropout; docs/MODELS.md)")
        return logits

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

    def compile(self, dataset, batch_size, eval_batch, lr, momentum, l1, l2, mode):
        """Compile (train(idx) -> cost, evaluate(idx) -> per-example errors).

        train takes int32 indices (batch_size,) into the training set; evaluate takes
        indices (eval_batch,) into validation followed by test examples. ``lr`` is the
        first learning rate: ``self.lr``, a shared variable, holds it, and a schedule sets
        it between steps. ``momentum`` is SGD's momentum, or Adam's beta1.
        """
        pytensor = import_pytensor()
        import pytensor.tensor as pt
        from pytensor.tensor.special import log_softmax

        if not self.params:
            raise ValueError(f"{type(self).__name__} has no parameters (Model.parameter)")
        n_classes = dataset.n_classes
        train_x = pytensor.shared(dataset.train[0], name="train_x")
        train_y = pytensor.shared(one_hot(dataset.train[1], n_classes), name="train_y")
        eval_x = pytensor.shared(np.concatenate([dataset.valid[0], dataset.test[0]]), name="eval_x")
        eval_y = pytensor.shared(one_hot(np.concatenate([dataset.valid[1], dataset.test[1]]),
                                         n_classes), name="eval_y")
        self.data_vars = [train_x, train_y, eval_x, eval_y]

        idx = pt.tensor("idx", dtype="int32", shape=(batch_size,))
        x, y = train_x[idx], train_y[idx]
        if self.flip or self.shift:  # images of known sizes, to reshape (_augmented)
            x = pt.specify_shape(x, (batch_size, dataset.n_in))
        logits = self.training_logits(x)
        shape = self._static_shape(logits)
        if len(shape) != 2 or any(d not in (None, want)
                                  for d, want in zip(shape, (batch_size, n_classes))):
            raise ValueError(f"{type(self).__name__}.logits gives shape {shape} for a batch "
                             f"of {batch_size}; it must be ({batch_size}, {n_classes}), one "
                             "score per class")
        if self.norms:
            # The norms' batch statistics as the step computes them, but with no dropout
            # and the images unvaried (estimate_statistics' batches); traced before the
            # gradients, which would fail first, and less plainly, on a norm never used.
            sidx = pt.tensor("sidx", dtype="int32", shape=(batch_size,))
            self._recorded = {}
            try:
                self.logits(train_x[sidx])
                recorded = self._recorded
            finally:
                self._recorded = None
            unused = [n.name for n in self.norms if n.name not in recorded]
            if unused:
                raise ValueError(f"{type(self).__name__}.logits never calls the batch norms "
                                 f"{unused} that __init__ made")
        if self.label_smoothing:  # Szegedy et al. 2016, as torch's cross_entropy computes it
            eps = np.float32(self.label_smoothing)
            y = (np.float32(1) - eps) * y + eps / np.float32(n_classes)
        nll = -pt.mean(pt.sum(y * log_softmax(logits, axis=1), axis=1))
        cost = nll
        if l1:
            cost = cost + np.float32(l1) * sum(pt.sum(abs(W)) for W in self.weights)
        if l2:
            cost = cost + np.float32(l2) * sum(pt.sum(W ** 2) for W in self.weights)
        grads = pytensor.grad(cost, self.params)
        if self.clip_norm:
            # On the gradients' road the norm is that of the ranks' mean gradients, as DDP's
            # clip_grad_norm_ after backward (pympgu.jaxsplit.Tail's statistics).
            norm = pt.sqrt(sum(pt.sum(pt.sqr(g)) for g in grads))
            scale = pt.minimum(np.float32(1),
                               np.float32(self.clip_norm) / (norm + np.float32(1e-6)))
            grads = [g * scale for g in grads]
        # The learning rate (and AdamW's decay) is a shared variable rather than a constant,
        # so that a schedule (and Adam's bias correction, step_size) changes it between
        # steps without compiling again; every rank gives it the same value, so the
        # gradients' road (pympgu.xla.average_gradients) still sees an update that only
        # reads the gradients from before it.
        self.lr = pytensor.shared(np.float32(lr), name="lr")
        self.decay = (pytensor.shared(np.float32(lr * self.weight_decay), name="decay")
                      if self.optimizer == "adamw" else None)
        self.beta1 = float(momentum)
        mu, k = np.float32(momentum), len(self.params)
        updates = []
        if self.optimizer == "sgd":
            for p, v, g in zip(self.params, self.slots[:k], grads):
                v_new = mu * v - self.lr * g
                # Nesterov's step looks ahead along the new velocity; still affine in g.
                step = mu * v_new - self.lr * g if self.nesterov else v_new
                updates += [(v, v_new), (p, p + step)]
        else:
            b2, eps = np.float32(self.beta2), np.float32(self.eps)
            decayed = {id(w) for w in self.weights} if self.optimizer == "adamw" else set()
            for p, m, s, g in zip(self.params, self.slots[:k], self.slots[k:2 * k], grads):
                m_new = mu * m + (np.float32(1) - mu) * g
                s_new = b2 * s + (np.float32(1) - b2) * (g * g)
                # AdamW shrinks the weight before its step, as torch.optim.AdamW does.
                kept = p * (np.float32(1) - self.decay) if id(p) in decayed else p
                updates += [(m, m_new), (s, s_new),
                            (p, kept - self.lr * m_new / (pt.sqrt(s_new) + eps))]
        if self.ema:
            # Elementwise after the step, from its new parameters: on the gradients' road
            # every rank computes it from the mean gradients, as the rest of the state.
            new = dict(updates)
            d = np.float32(self.ema)
            updates += [(a, d * a + (np.float32(1) - d) * new[p])
                        for p, a in zip(self.params, self.averages)]
        updates += self.noise_updates
        train = pytensor.function([idx], cost, updates=updates, mode=mode, name="train")
        # Evaluation, and the norms' statistics it normalises by, read the moving average
        # in place of the parameters. The statistics read no parameter after a norm (its
        # scale and shift): the averages of those are inputs they do not use.
        averaged = dict(givens=list(zip(self.params, self.averages)), on_unused_input="ignore")

        if self.norms:
            self.statistics_fn = pytensor.function(
                [sidx], [v for n in self.norms for v in recorded[n.name]], mode=mode,
                name="statistics", **averaged)
            self.statistics_fn.trust_input = True

        eidx = pt.tensor("eidx", dtype="int32", shape=(eval_batch,))
        wrong = pt.neq(pt.argmax(self.logits(eval_x[eidx]), axis=1),
                       pt.argmax(eval_y[eidx], axis=1))
        evaluate = pytensor.function([eidx], wrong, mode=mode, name="evaluate", **averaged)
        # Callers pass int32 index arrays of exactly these shapes: skipping PyTensor's input
        # checks saves host time on every call (about 50 µs a call on a CPU).
        train.trust_input = evaluate.trust_input = True
        return train, evaluate


class BatchNorm:
    """One batch normalisation layer of a Model (Model.batch_norm makes it): call it on
    x (batch, channels, ...) in ``logits``."""

    EPS = 1e-5  # added to the variance, as cuDNN's and PyTorch's default

    def __init__(self, model, channels, name, gamma):
        pytensor = import_pytensor()
        if channels < 1:
            raise ValueError(f"batch norm {name!r}: give at least 1 channel, got {channels}")
        self.model, self.name, self.channels = model, name, channels
        self.gamma = model.parameter(np.full(channels, gamma), f"gamma_{name}", penalized=False)
        self.beta = model.parameter(np.zeros(channels), f"beta_{name}", penalized=False)
        # "__" names: a parameter cannot take them (Model.parameter), so checkpoints keep
        # them apart.
        self.mean = pytensor.shared(np.zeros(channels, np.float32), name=f"__mean_{name}")
        self.var = pytensor.shared(np.ones(channels, np.float32), name=f"__var_{name}")

    def __call__(self, x):
        import pytensor.tensor as pt
        x = pt.as_tensor_variable(x)
        if x.type.ndim < 2 or x.type.shape[1] not in (None, self.channels):
            raise ValueError(f"batch norm {self.name!r} of {self.channels} channels: x must "
                             f"be (batch, {self.channels}, ...), got shape {x.type.shape}")
        axes = (0, *range(2, x.type.ndim))
        spread = ["x", 0] + ["x"] * (x.type.ndim - 2)  # (channels,) against x's axis 1
        recording = self.model._recorded is not None
        if self.model.training or recording:
            mean = pt.mean(x, axis=axes)
            var = pt.mean(pt.sqr(x - mean.dimshuffle(spread)), axis=axes)
            if recording:
                if self.name in self.model._recorded:
                    raise ValueError(f"batch norm {self.name!r} is called twice in logits: "
                                     "make one for each place (Model.batch_norm)")
                self.model._recorded[self.name] = (mean, var)
        else:
            mean, var = self.mean, self.var
        scale = self.gamma / pt.sqrt(var + np.float32(self.EPS))
        return (x - mean.dimshuffle(spread)) * scale.dimshuffle(spread) + \
            self.beta.dimshuffle(spread)


class MLP(Model):
    """A multilayer perceptron: tanh hidden layers, softmax output.

    Hidden weights start uniform in +-sqrt(6 / (n_in + n_out)), the output layer at zero,
    from numpy's RandomState(seed): every replica starts identical, as in the seed.
    """

    def __init__(self, n_in, hidden, n_out, seed=1234):
        super().__init__()
        rng = np.random.RandomState(seed)
        sizes = [n_in, *hidden, n_out]
        for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
            if i == len(sizes) - 2:
                w = np.zeros((a, b), np.float32)
            else:
                bound = np.sqrt(6.0 / (a + b))
                w = rng.uniform(-bound, bound, (a, b)).astype(np.float32)
            self.parameter(w, f"W{i}")
            self.parameter(np.zeros(b, np.float32), f"b{i}", penalized=False)
        self.sizes = sizes

    def describe(self):
        return f"MLP {'-'.join(map(str, self.sizes))}"

    def logits(self, x):
        import pytensor.tensor as pt
        h = x
        for i in range(0, len(self.params) - 2, 2):
            h = self.dropout(pt.tanh(pt.dot(h, self.params[i]) + self.params[i + 1]))
        return pt.dot(h, self.params[-2]) + self.params[-1]


class ModelError(ValueError):
    """A --model that cannot be loaded or built; the message names it."""


class FlagError(ValueError):
    """A training option that the model or its data cannot take (a --dropout rate for
    logits without dropout, --flip or --shift for data that are not images); ``flag``
    names it."""

    def __init__(self, flag, message):
        super().__init__(message)
        self.flag = flag


def load(spec):
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


def build(spec, n_in, hidden, n_out, seed=1234, optimizer="sgd", beta2=0.999, dropout=0.0,
          flip=False, shift=0, weight_decay=0.0, label_smoothing=0.0, nesterov=False,
          clip_norm=0.0, ema=0.0):
    """The model that ``spec`` names (load), built for this data: ``cls(n_in, hidden,
    n_out, seed=seed)``, trained by ``optimizer`` (Model.set_optimizer, with ``beta2``,
    ``weight_decay``, ``nesterov``, ``clip_norm`` and ``ema``) with its dropout layers at
    ``dropout`` (Model.dropout), its training images flipped and shifted as ``flip`` and
    ``shift`` say (pympgu.nnet.augment) and its targets smoothed by ``label_smoothing``,
    with its parameters and state checked."""
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
    model.set_optimizer(optimizer, beta2=beta2, weight_decay=weight_decay, nesterov=nesterov,
                        clip_norm=clip_norm, ema=ema)
    model.dropout_rate = float(dropout)
    if not 0 <= label_smoothing < 1:
        raise ValueError(f"label_smoothing must be in [0, 1), got {label_smoothing}")
    model.label_smoothing = float(label_smoothing)
    model.flip, model.shift = bool(flip), int(shift)
    return model


def seed_noise(fn, *entropy):
    """Seed the random generators that the compiled function ``fn`` draws from
    (Model.dropout's) from the integers ``entropy`` (pympgu.train gives --seed, the rank
    and the epoch): the same integers, the same draws, on every backend's function alike.
    A generator is seeded in the function itself, since PyTensor's JAX linker gives the
    function a copy of its own: setting the shared variable would not reach it."""
    from pytensor.tensor.random.type import RandomType
    for k, (i, container) in enumerate(zip(fn.maker.inputs, fn.input_storage)):
        if not isinstance(i.variable.type, RandomType):
            continue
        seeds = np.random.SeedSequence([*entropy, k])
        value = container.storage[0]
        if isinstance(value, np.random.Generator):
            container.storage[0] = np.random.default_rng(seeds)
        else:
            # A JAX key, as PyTensor keeps one: its program draws from 'jax_state' (two
            # uint32s) alone; the other entries are the numpy generator's, carried along.
            import jax
            value = dict(value)
            value["jax_state"] = jax.device_put(seeds.generate_state(2, np.uint32))
            container.storage[0] = value


def statistics_batches(n_train, batch_size, examples=STATISTICS_EXAMPLES):
    """The index arrays (int32, batch_size each) that estimate_statistics reads: the first
    ``examples`` training examples (rounded up to whole batches, at most every one, at
    least one batch) of a fixed shuffle, so that every evaluation of a run, and
    pympgu.evaluate's, draws the same ones."""
    order = np.random.default_rng(0).permutation(n_train).astype(np.int32)
    count = max(1, min(math.ceil(examples / batch_size), n_train // batch_size))
    order = np.resize(order, count * batch_size)  # repeats only where n_train < batch_size
    return [order[i * batch_size:(i + 1) * batch_size] for i in range(count)]


def error_rates(evaluate, n_valid, n_test, eval_batch):
    """(validation error, test error) in [0, 1], evaluated in fixed-size batches.

    The last batch is padded with index 0 and its padding is ignored.
    """
    n = n_valid + n_test
    wrong = np.zeros(n, bool)
    for start in range(0, n, eval_batch):
        idx = np.arange(start, start + eval_batch, dtype=np.int32)
        valid = idx < n
        idx[~valid] = 0
        wrong[idx[valid]] = np.asarray(evaluate(idx))[valid].astype(bool)
    return float(wrong[:n_valid].mean()), float(wrong[n_valid:].mean())
