"""Batch normalisation layers of a Model (Model.batch_norm makes them), and their population
statistics, estimated before each evaluation (docs/MODELS.md, "Batch normalisation")."""
import numpy as np

from .._pytensor import import_pytensor


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


def estimate(norms, statistics_fn, batches):
    """Set every norm's population mean and variance to those of its input over the
    training examples of ``batches``, as ``statistics_fn`` (compile's) computes them:
    the mean of the batches' means, and the mean of their variances plus the variance of
    their means, the variance over every example."""
    # Per batch, every norm's mean and variance in turn (statistics_fn's outputs).
    outs = [[np.asarray(v, np.float64) for v in statistics_fn(idx)] for idx in batches]
    if not outs:
        raise ValueError("estimate_statistics: no batches")
    for k, norm in enumerate(norms):
        means = np.stack([o[2 * k] for o in outs])
        variances = np.stack([o[2 * k + 1] for o in outs])
        norm.mean.set_value(means.mean(axis=0).astype(np.float32))
        norm.var.set_value((variances.mean(axis=0) + means.var(axis=0)).astype(np.float32))
