"""Batch normalisation (Model.batch_norm): each minibatch's statistics in training, the
population's, estimated before each evaluation, in evaluation; saved in checkpoints that
pympgu.evaluate reads; and examples/resnet.py, trained on CPU workers (the GPU's run is in
test_gpu_runtime)."""
import json
import os
import types

import numpy as np
import pytest

from pympgu import evaluate, models
from pympgu.training import checkpoint as ckpt
from pympgu.training import cli

pytestmark = pytest.mark.timeout(600)

RESNET = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples",
                      "resnet.py")


class Normed(models.Model):
    """Logits that are the input, reshaped to (batch, 2, 2, n_in // 4) maps and normalised:
    what BatchNorm does, alone."""

    def __init__(self, n_in, hidden, n_out, seed=1234):
        super().__init__()
        self.norm = self.batch_norm(2, "maps")

    def logits(self, x):
        return self.norm(x.reshape((x.shape[0], 2, 2, -1))).reshape((x.shape[0], -1))


def dataset(x, n_classes=8):
    y = np.arange(len(x)) % n_classes
    return types.SimpleNamespace(train=(x, y), valid=(x[:4], y[:4]), test=(x[:4], y[:4]),
                                 n_classes=n_classes, n_in=x.shape[1])


def test_training_normalises_by_the_batch_and_evaluation_by_the_population():
    import pytensor
    import pytensor.tensor as pt
    m = Normed(8, [], 8)
    m.norm.gamma.set_value(np.float32([2, 3]))
    m.norm.beta.set_value(np.float32([1, -1]))
    m.norm.mean.set_value(np.float32([0.5, -2]))
    m.norm.var.set_value(np.float32([4, 0.25]))
    x = pt.tensor("x", dtype="float32", shape=(5, 8))
    trained, evaluated = (pytensor.function([x], m.training_logits(x)),
                          pytensor.function([x], m.logits(x)))
    rng = np.random.default_rng(0)
    xs = rng.normal(3, 2, (5, 8)).astype(np.float32)
    maps = xs.reshape(5, 2, 4).astype(np.float64)
    gamma, beta = np.array([2, 3])[None, :, None], np.array([1, -1])[None, :, None]
    # Each channel over the batch and its other axes, the biased variance, eps 1e-5.
    mean, var = maps.mean(axis=(0, 2), keepdims=True), maps.var(axis=(0, 2), keepdims=True)
    want = (maps - mean) / np.sqrt(var + 1e-5) * gamma + beta
    np.testing.assert_allclose(trained(xs).reshape(5, 2, 4), want, rtol=1e-5, atol=1e-5)
    mean, var = np.array([0.5, -2])[None, :, None], np.array([4, 0.25])[None, :, None]
    want = (maps - mean) / np.sqrt(var + 1e-5) * gamma + beta
    np.testing.assert_allclose(evaluated(xs).reshape(5, 2, 4), want, rtol=1e-5, atol=1e-5)


def test_estimated_statistics_are_the_mean_and_variance_over_every_example():
    """A norm on the input: after estimate_statistics its population mean and variance are
    numpy's over exactly the examples of statistics_batches, though each batch's mean
    differs (the data's halves are far apart, and the batches draw them unevenly)."""
    rng = np.random.default_rng(1)
    x = np.concatenate([rng.normal(0, 1, (60, 8)), rng.normal(5, 2, (40, 8))]).astype(np.float32)
    m = Normed(8, [], 8)
    m.compile(dataset(x), batch_size=16, eval_batch=4, lr=0.1, momentum=0.9, l1=0, l2=0,
              mode="FAST_RUN")
    batches = models.statistics_batches(len(x), 16, examples=40)
    assert [len(b) for b in batches] == [16, 16, 16]  # 40 examples: three whole batches
    m.estimate_statistics(batches)
    seen = x[np.concatenate(batches)].reshape(48, 2, 4).astype(np.float64)
    np.testing.assert_allclose(m.norm.mean.get_value(), seen.mean(axis=(0, 2)), rtol=1e-5)
    np.testing.assert_allclose(m.norm.var.get_value(), seen.var(axis=(0, 2)), rtol=1e-4)
    assert len({float(x[b].mean()) for b in batches}) == 3


class Projected(models.Model):
    """A norm on a learned projection: its statistics depend on the parameters."""

    def __init__(self, n_in, hidden, n_out, seed=1234):
        super().__init__()
        rng = np.random.default_rng(seed)
        self.W = self.parameter(rng.normal(0, 0.3, (n_in, n_out)), "W")
        self.norm = self.batch_norm(n_out, "out")

    def logits(self, x):
        return self.norm(x @ self.W)


def test_with_ema_the_statistics_are_those_of_the_moving_average():
    """--ema: evaluation reads the parameters' moving average, so the population statistics
    it normalises by are estimated with it too: after a few steps they are numpy's over
    x @ average, not over x @ W."""
    rng = np.random.default_rng(1)
    x = rng.normal(0, 1, (48, 8)).astype(np.float32)
    m = Projected(8, [], 8)
    m.set_optimizer("sgd", ema=0.5)
    train_fn, _ = m.compile(dataset(x), batch_size=16, eval_batch=4, lr=0.5, momentum=0.0,
                            l1=0, l2=0, mode="FAST_RUN")
    batches = [np.arange(16 * t, 16 * t + 16, dtype=np.int32) for t in range(3)]
    for b in batches:
        train_fn(b)
    average = m.averages[0].get_value().astype(np.float64)
    assert not np.allclose(average, m.W.get_value(), atol=1e-3)
    m.estimate_statistics(batches)
    seen = x.astype(np.float64) @ average
    np.testing.assert_allclose(m.norm.mean.get_value(), seen.mean(axis=0), rtol=1e-4,
                               atol=1e-6)
    np.testing.assert_allclose(m.norm.var.get_value(), seen.var(axis=0), rtol=1e-4)


def test_statistics_batches_are_fixed_and_fit_the_data():
    a, b = models.statistics_batches(1000, 100), models.statistics_batches(1000, 100)
    assert len(a) == 10 and all(np.array_equal(u, v) for u, v in zip(a, b))
    assert len(np.unique(np.concatenate(a))) == 1000  # every example once, as no more fit
    assert len(models.statistics_batches(100_000, 128)) == 64  # 8,192 examples
    small = models.statistics_batches(5, 8)  # fewer examples than a batch: they repeat
    assert len(small) == 1 and sorted(set(small[0])) == [0, 1, 2, 3, 4]
    assert all(b.dtype == np.int32 for b in a + small)


class Twice(Normed):
    def logits(self, x):
        return self.norm(self.norm(x.reshape((x.shape[0], 2, -1)))).reshape((x.shape[0], -1))


class Unused(Normed):
    def logits(self, x):
        return x


def test_a_norm_used_twice_or_never_or_on_other_channels_is_refused():
    data = dataset(np.zeros((32, 8), np.float32))
    for cls, message in ((Twice, r"batch norm 'maps' is called twice in logits"),
                         (Unused, r"Unused.logits never calls the batch norms \['maps'\]")):
        with pytest.raises(ValueError, match=message):
            cls(8, [], 8).compile(data, 16, 4, 0.1, 0.9, 0, 0, "FAST_RUN")
    import pytensor.tensor as pt
    with pytest.raises(ValueError, match=r"batch norm 'maps' of 2 channels: x must be "
                                         r"\(batch, 2, ...\), got shape \(4, 3\)"):
        Normed(8, [], 8).norm(pt.tensor("x", dtype="float32", shape=(4, 3)))
    with pytest.raises(ValueError, match="parameter name 'gamma_maps' is empty, reserved"):
        m = Normed(8, [], 8)
        m.batch_norm(4, "maps")


def test_a_model_without_norms_compiles_no_statistics():
    m = models.MLP(8, [4], 8)
    m.compile(dataset(np.zeros((32, 8), np.float32)), 16, 4, 0.1, 0.9, 0, 0, "FAST_RUN")
    assert m.statistics_fn is None and m.statistics == []
    m.estimate_statistics([])  # nothing to estimate, no batches needed


@pytest.fixture(scope="module")
def resnet_run(tmp_path_factory):
    """examples/resnet.py trained for 2 epochs on 2 CPU workers under JAX (the programs GPU
    workers compile), with dropout, which the statistics must not see, and its statistics
    estimated from 2,048 examples (--bn-examples), as pympgu.evaluate then reads them."""
    pytest.importorskip("jax")
    out = str(tmp_path_factory.mktemp("resnet"))
    assert cli.main(["--cpu", "2", "--backend", "jax", "--model", f"{RESNET}:ResNet",
                       "--hidden", "4", "8", "--batch-size", "32", "--lr", "0.1", "--epochs",
                       "2", "--dropout", "0.1", "--bn-examples", "2048", "--out", out,
                       "--quiet"]) == 0
    return out


def test_a_resnet_learns_and_evaluate_gives_back_its_errors(resnet_run, capsys):
    """The run learns (run() checks that the replicas end identical), its checkpoints hold
    every norm's statistics beside the state, and pympgu.evaluate, reading them, gives the
    test error training printed for the best epoch."""
    lines = [json.loads(x) for x in open(os.path.join(resnet_run, "metrics.jsonl"))]
    assert lines[-1]["test_error"] < 0.75 and lines[-1]["loss"] < lines[0]["loss"], lines
    with np.load(os.path.join(resnet_run, ckpt.BEST)) as f:
        names = set(f.files)
    for norm in ("stem", "block0_1", "block0_2", "block1_1", "block1_2", "block1_shortcut"):
        assert {f"__mean_{norm}", f"__var_{norm}", f"gamma_{norm}", f"v_beta_{norm}"} <= names
    best = min(lines, key=lambda h: h["valid_error"])
    report = evaluate.load(resnet_run).evaluate("test")
    assert report["error"] == pytest.approx(best["test_error"]), (report["error"], best)


def test_a_resumed_resnet_goes_on_as_the_run_it_continues(resnet_run, tmp_path):
    """One epoch, then --resume for the second: the same losses and errors as the 2-epoch
    run, since the statistics are estimated afresh from the parameters at every evaluation
    and nothing else of them is carried."""
    out = str(tmp_path / "resumed")
    argv = ["--cpu", "2", "--backend", "jax", "--model", f"{RESNET}:ResNet", "--hidden", "4",
            "8", "--batch-size", "32", "--lr", "0.1", "--dropout", "0.1", "--bn-examples",
            "2048", "--out", out, "--quiet"]
    assert cli.main(argv + ["--epochs", "1"]) == 0
    assert cli.main(argv + ["--epochs", "2", "--resume", out]) == 0

    def read(run):
        return [{k: h[k] for k in ("epoch", "loss", "valid_error", "test_error")}
                for h in map(json.loads, open(os.path.join(run, "metrics.jsonl")))]
    assert read(out) == read(resnet_run)


def test_evaluation_uses_the_estimated_statistics(resnet_run):
    """The population statistics matter: the network evaluated with the initial ones (mean
    0, variance 1) errs far more than with the checkpoint's."""
    trained = evaluate.load(resnet_run)
    error = trained.evaluate("test")["error"]
    for norm in trained.model.norms:
        norm.mean.set_value(np.zeros(norm.channels, np.float32))
        norm.var.set_value(np.ones(norm.channels, np.float32))
    trained._fn = None
    assert evaluate.load(resnet_run).evaluate("test")["error"] == error
    assert trained.evaluate("test")["error"] > error + 0.1


def test_bn_examples_is_refused_out_of_range_or_for_a_model_without_norms(capsys):
    for argv, message in ((["--bn-examples", "0"], "--bn-examples must be at least 1, got 0"),
                          (["--bn-examples", "64"], "--bn-examples 64: MLP has no batch "
                                                    "norms (Model.batch_norm)")):
        with pytest.raises(SystemExit) as info:
            cli.main(["--cpu", "2", *argv])
        assert info.value.code == 2
        assert message in capsys.readouterr().err


def test_a_checkpoint_without_statistics_is_named(resnet_run, tmp_path):
    path = str(tmp_path / "old.npz")
    with np.load(os.path.join(resnet_run, ckpt.BEST)) as f:
        np.savez(path, **{k: f[k] for k in f.files if not k.startswith("__mean_stem")})
    for name in ("config.json",):
        with open(os.path.join(resnet_run, name)) as src, open(tmp_path / name, "w") as dst:
            dst.write(src.read())
    with pytest.raises(evaluate.EvaluateError,
                       match=rf"{path}: cannot evaluate it: it has no '__mean_stem'"):
        evaluate.load(path)
