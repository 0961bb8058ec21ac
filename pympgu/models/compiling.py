"""A Model's functions compiled: the training step (softmax cross-entropy, L1 and L2 terms,
clipping, the optimizer's update, the moving average), the norms' statistics, and the
evaluation, over the dataset as shared variables indexed by minibatch."""
import numpy as np

from .._pytensor import import_pytensor
from .optimizers import OPTIMIZERS
from .running import one_hot


def compile_model(model, dataset, batch_size, eval_batch, lr, momentum, l1, l2, mode):
    """(train(idx) -> cost, evaluate(idx) -> per-example errors): Model.compile's."""
    pytensor = import_pytensor()
    import pytensor.tensor as pt

    if not model.params:
        raise ValueError(f"{type(model).__name__} has no parameters (Model.parameter)")
    train_x, train_y, eval_x, eval_y = _data(model, dataset)
    idx = pt.tensor("idx", dtype="int32", shape=(batch_size,))
    x, y = train_x[idx], train_y[idx]
    if model.flip or model.shift:  # images of known sizes, to reshape (Noise._augmented)
        x = pt.specify_shape(x, (batch_size, dataset.n_in))
    logits = model.training_logits(x)
    shape = model._static_shape(logits)
    if len(shape) != 2 or any(d not in (None, want)
                              for d, want in zip(shape, (batch_size, dataset.n_classes))):
        raise ValueError(f"{type(model).__name__}.logits gives shape {shape} for a batch of "
                         f"{batch_size}; it must be ({batch_size}, {dataset.n_classes}), one "
                         "score per class")
    sidx = pt.tensor("sidx", dtype="int32", shape=(batch_size,))
    recorded = _norm_statistics(model, train_x[sidx])
    cost = _cost(model, logits, y, dataset.n_classes, l1, l2)
    train = pytensor.function([idx], cost, updates=_updates(model, cost, lr, momentum),
                              mode=mode, name="train")
    # Evaluation, and the norms' statistics it normalises by, read the moving average in
    # place of the parameters. The statistics read no parameter after a norm (its scale and
    # shift): the averages of those are inputs they do not use.
    averaged = dict(givens=list(zip(model.params, model.averages)), on_unused_input="ignore")
    if model.norms:
        model.statistics_fn = pytensor.function(
            [sidx], [v for n in model.norms for v in recorded[n.name]], mode=mode,
            name="statistics", **averaged)
        model.statistics_fn.trust_input = True
    eidx = pt.tensor("eidx", dtype="int32", shape=(eval_batch,))
    wrong = pt.neq(pt.argmax(model.logits(eval_x[eidx]), axis=1),
                   pt.argmax(eval_y[eidx], axis=1))
    evaluate = pytensor.function([eidx], wrong, mode=mode, name="evaluate", **averaged)
    # Callers pass int32 index arrays of exactly these shapes: skipping PyTensor's input
    # checks saves host time on every call (about 50 µs a call on a CPU).
    train.trust_input = evaluate.trust_input = True
    return train, evaluate


def _data(model, dataset):
    """The dataset as shared variables (on a GPU, in device memory): the training inputs
    and one-hot targets, then the validation and test sets' together."""
    pytensor = import_pytensor()
    n_classes = dataset.n_classes
    train_x = pytensor.shared(dataset.train[0], name="train_x")
    train_y = pytensor.shared(one_hot(dataset.train[1], n_classes), name="train_y")
    eval_x = pytensor.shared(np.concatenate([dataset.valid[0], dataset.test[0]]), name="eval_x")
    eval_y = pytensor.shared(one_hot(np.concatenate([dataset.valid[1], dataset.test[1]]),
                                     n_classes), name="eval_y")
    model.data_vars = [train_x, train_y, eval_x, eval_y]
    return model.data_vars


def _norm_statistics(model, x):
    """Every norm's batch mean and variance of ``x`` by name, as the step computes them but
    with no dropout and the images unvaried (estimate_statistics' batches); traced before
    the gradients, which would fail first, and less plainly, on a norm never used."""
    if not model.norms:
        return None
    model._recorded = {}
    try:
        model.logits(x)
        recorded = model._recorded
    finally:
        model._recorded = None
    unused = [n.name for n in model.norms if n.name not in recorded]
    if unused:
        raise ValueError(f"{type(model).__name__}.logits never calls the batch norms {unused} "
                         "that __init__ made")
    return recorded


def _cost(model, logits, y, n_classes, l1, l2):
    """The mean softmax cross-entropy against ``y`` (smoothed by label_smoothing, Szegedy et
    al. 2016, as torch's cross_entropy computes it), with the L1 and L2 terms."""
    import pytensor.tensor as pt
    from pytensor.tensor.special import log_softmax
    if model.label_smoothing:
        eps = np.float32(model.label_smoothing)
        y = (np.float32(1) - eps) * y + eps / np.float32(n_classes)
    cost = -pt.mean(pt.sum(y * log_softmax(logits, axis=1), axis=1))
    if l1:
        cost = cost + np.float32(l1) * sum(pt.sum(abs(w)) for w in model.weights)
    if l2:
        cost = cost + np.float32(l2) * sum(pt.sum(w ** 2) for w in model.weights)
    return cost


def _updates(model, cost, lr, momentum):
    """The step's updates: the gradients, clipped (clip_norm), the optimizer's update, the
    moving average (ema) and the noise's generator."""
    pytensor = import_pytensor()
    import pytensor.tensor as pt
    grads = pytensor.grad(cost, model.params)
    if model.clip_norm:
        # On the gradients' road the norm is that of the ranks' mean gradients, as DDP's
        # clip_grad_norm_ after backward (pympgu.xla.split.Tail's statistics).
        norm = pt.sqrt(sum(pt.sum(pt.sqr(g)) for g in grads))
        scale = pt.minimum(np.float32(1), np.float32(model.clip_norm) / (norm + np.float32(1e-6)))
        grads = [g * scale for g in grads]
    # The learning rate (and AdamW's decay) is a shared variable rather than a constant, so
    # that a schedule (and Adam's bias correction, step_size) changes it between steps
    # without compiling again; every rank gives it the same value, so the gradients' road
    # (pympgu.xla.average_gradients) still sees an update that only reads the gradients
    # from before it.
    optimizer = OPTIMIZERS[model.optimizer]
    model.lr = pytensor.shared(np.float32(lr), name="lr")
    model.decay = (pytensor.shared(np.float32(lr * model.weight_decay), name="decay")
                   if optimizer.decays else None)
    model.beta1 = float(momentum)
    updates = optimizer.updates(model, grads, np.float32(momentum))
    if model.ema:
        # Elementwise after the step, from its new parameters: on the gradients' road
        # every rank computes it from the mean gradients, as the rest of the state.
        new = dict(updates)
        d = np.float32(model.ema)
        updates += [(a, d * a + (np.float32(1) - d) * new[p])
                    for p, a in zip(model.params, model.averages)]
    return updates + model.noise_updates
