"""Models in Theano style on PyTensor: shared variables, ``pytensor.grad`` and ``updates``.

The seed's MLP (784-500-10, tanh hidden layers, softmax output, L1/L2 terms) and its deeper
and wider variants. The training set and the evaluation sets are shared variables too, so
on a GPU they live in device memory and a minibatch is gathered there from an index vector;
only the indices cross from the host each step. Shapes are static (PyTensor's JAX backend
needs them) and targets are one-hot.
"""
import os

import numpy as np


def import_pytensor():
    """PyTensor with float32 as floatX; the flag must be set before the first import."""
    flags = os.environ.get("PYTENSOR_FLAGS", "")
    if "floatX" not in flags:
        os.environ["PYTENSOR_FLAGS"] = ",".join(f for f in (flags, "floatX=float32") if f)
    import pytensor
    return pytensor


def one_hot(labels, n_classes):
    out = np.zeros((len(labels), n_classes), np.float32)
    out[np.arange(len(labels)), labels] = 1.0
    return out


class MLP:
    """A multilayer perceptron: tanh hidden layers, softmax output.

    Hidden weights start uniform in +-sqrt(6 / (n_in + n_out)), the output layer at zero,
    from numpy's RandomState(seed): every replica starts identical, as in the seed.
    """

    def __init__(self, n_in, hidden, n_out, seed=1234):
        pytensor = import_pytensor()
        rng = np.random.RandomState(seed)
        sizes = [n_in, *hidden, n_out]
        self.params, self.weights = [], []
        for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
            if i == len(sizes) - 2:
                w = np.zeros((a, b), np.float32)
            else:
                bound = np.sqrt(6.0 / (a + b))
                w = rng.uniform(-bound, bound, (a, b)).astype(np.float32)
            W = pytensor.shared(w, name=f"W{i}")
            self.params += [W, pytensor.shared(np.zeros(b, np.float32), name=f"b{i}")]
            self.weights.append(W)
        self.velocities = [pytensor.shared(np.zeros(p.get_value().shape, np.float32),
                                           name=f"v_{p.name}") for p in self.params]
        self.sizes = sizes

    @property
    def state(self):
        """Every shared variable the replicas average: parameters, then momentum."""
        return self.params + self.velocities

    def logits(self, x):
        import pytensor.tensor as pt
        h = x
        for i in range(0, len(self.params) - 2, 2):
            h = pt.tanh(pt.dot(h, self.params[i]) + self.params[i + 1])
        return pt.dot(h, self.params[-2]) + self.params[-1]

    def compile(self, dataset, batch_size, eval_batch, lr, momentum, l1, l2, mode):
        """Compile (train(idx) -> cost, evaluate(idx) -> per-example errors).

        train takes int32 indices (batch_size,) into the training set; evaluate takes
        indices (eval_batch,) into validation followed by test examples.
        """
        pytensor = import_pytensor()
        import pytensor.tensor as pt
        from pytensor.tensor.special import log_softmax

        n_classes = dataset.n_classes
        train_x = pytensor.shared(dataset.train[0], name="train_x")
        train_y = pytensor.shared(one_hot(dataset.train[1], n_classes), name="train_y")
        eval_x = pytensor.shared(np.concatenate([dataset.valid[0], dataset.test[0]]), name="eval_x")
        eval_y = pytensor.shared(one_hot(np.concatenate([dataset.valid[1], dataset.test[1]]),
                                         n_classes), name="eval_y")
        self.data_vars = [train_x, train_y, eval_x, eval_y]

        idx = pt.tensor("idx", dtype="int32", shape=(batch_size,))
        x, y = train_x[idx], train_y[idx]
        nll = -pt.mean(pt.sum(y * log_softmax(self.logits(x), axis=1), axis=1))
        cost = nll
        if l1:
            cost = cost + np.float32(l1) * sum(pt.sum(abs(W)) for W in self.weights)
        if l2:
            cost = cost + np.float32(l2) * sum(pt.sum(W ** 2) for W in self.weights)
        grads = pytensor.grad(cost, self.params)
        updates = []
        for p, v, g in zip(self.params, self.velocities, grads):
            v_new = np.float32(momentum) * v - np.float32(lr) * g
            updates += [(v, v_new), (p, p + v_new)]
        train = pytensor.function([idx], cost, updates=updates, mode=mode, name="train")

        eidx = pt.tensor("eidx", dtype="int32", shape=(eval_batch,))
        wrong = pt.neq(pt.argmax(self.logits(eval_x[eidx]), axis=1),
                       pt.argmax(eval_y[eidx], axis=1))
        evaluate = pytensor.function([eidx], wrong, mode=mode, name="evaluate")
        # Callers pass int32 index arrays of exactly these shapes: skipping PyTensor's input
        # checks saves host time on every call (about 50 µs a call on a CPU).
        train.trust_input = evaluate.trust_input = True
        return train, evaluate


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
