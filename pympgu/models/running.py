"""What runs a compiled model: its draws seeded, the batches that estimate its norms'
statistics, its error rates, and one-hot targets."""
import math

import numpy as np

# How many training examples a batch norm's population mean and variance are estimated
# from before each evaluation (Model.estimate_statistics; Wu and Johnson's PreciseBN in
# "Rethinking 'Batch' in BatchNorm", 2021): as many as MMClassification's PreciseBNHook
# takes by default.
STATISTICS_EXAMPLES = 8192


def one_hot(labels, n_classes):
    out = np.zeros((len(labels), n_classes), np.float32)
    out[np.arange(len(labels)), labels] = 1.0
    return out



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
