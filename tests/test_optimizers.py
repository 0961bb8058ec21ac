"""The optimizers' arithmetic and state: schedules, AdamW, label smoothing, Nesterov,
clipping, EMA, and Adam resumed."""
import os

import numpy as np
import pytest

from pympgu import data
from pympgu.training import checkpoint as ckpt
from pympgu.training.config import RunConfig
from pympgu.training.launcher import run as train

pytestmark = pytest.mark.timeout(600)


def config(**over):
    """A run of 2 CPU workers on PyTensor's own backend, with ``over`` changed."""
    return RunConfig(**dict(dict(backend="c", devices=(None, None)), **over))


def test_learning_rate_schedules():
    from pympgu.models import MLP
    from pympgu.schedule import Schedule
    cos = Schedule(0.1, 100, "cosine", warmup=10)
    assert [cos(t) for t in (0, 1, 9, 10)] == pytest.approx([0.01, 0.02, 0.1, 0.1])
    assert cos(55) == pytest.approx(0.05) and 0 < cos(99) < 1e-4  # half-way; never zero
    line = Schedule(0.1, 100, "linear")
    assert [line(t) for t in (0, 50, 99)] == pytest.approx([0.1, 0.05, 0.001])
    assert {Schedule(0.1, 100, warmup=2)(t) for t in range(2, 100)} == {0.1}
    assert Schedule(0.1, 10, warmup=20)(9) == pytest.approx(0.05)  # to be resumed for more
    assert str(cos) == "lr 0.1 cosine, 10 warm-up steps"
    for bad in [dict(kind="step"), dict(lr=0), dict(total=0), dict(warmup=-1)]:
        with pytest.raises(ValueError):
            Schedule(**dict(dict(lr=0.1, total=10), **bad))
    # Adam's bias correction, folded into the rate: sqrt(1 - beta2^t) / (1 - beta1^t).
    m = MLP(8, [4], 2)
    m.set_optimizer("adam", beta2=0.999)
    m.beta1 = 0.9  # what compile sets from its momentum
    assert m.step_size(1.0, 1) == pytest.approx(0.001 ** 0.5 / 0.1)
    assert m.step_size(1.0, 10 ** 5) == pytest.approx(1.0)
    assert MLP(8, [4], 2).step_size(0.5, 1) == 0.5  # SGD's is the rate itself
    # AdamW's decay takes the schedule's rate, without the bias correction.
    w = MLP(8, [4], 2)
    w.set_optimizer("adamw", weight_decay=0.1)
    w.beta1 = 0.9
    assert w.rates(0.5, 1) == (w.step_size(0.5, 1), pytest.approx(0.05))
    assert m.rates(0.5, 1) == (m.step_size(0.5, 1),)
    for name, decay in [("sgd", 0.1), ("adamw", 1.0), ("adamw", -0.1)]:
        with pytest.raises(ValueError, match="weight_decay is AdamW's, in"):
            MLP(8, [4], 2).set_optimizer(name, weight_decay=decay)


def test_adamw_first_step_is_adams_with_the_weights_decayed():
    """AdamW's step multiplies each weight by 1 - rate * decay before Adam's step, as
    torch.optim.AdamW does: from the same start and batch its first step leaves the
    moments Adam's, the biases Adam's, and each weight Adam's less rate * decay times its
    start (PyTensor's own backend; JAX's agrees with it, test_jax_graph_agrees_...)."""
    from pympgu import models
    ds = data.load()
    idx = np.arange(64, dtype=np.int32)
    runs = {}
    for name, decay in [("adam", 0.0), ("adamw", 0.1)]:
        m = models.MLP(ds.n_in, [16], 10)
        m.set_optimizer(name, weight_decay=decay)
        tr, _ = m.compile(ds, 64, 100, 0.01, 0.9, 0.0, 0.0, "FAST_RUN")
        start = [np.array(p.get_value()) for p in m.params]
        tr(idx)
        runs[name] = m, start, [np.array(s.get_value()) for s in m.state]
    (adam, start, a), (adamw, _, w) = runs["adam"], runs["adamw"]
    k = len(adam.params)
    assert [s.name for s in adamw.state] == [s.name for s in adam.state]
    assert all(np.array_equal(x, y) for x, y in zip(a[k:], w[k:]))  # the moments
    weights = {p.name for p in adamw.weights}
    assert weights == {"W0", "W1"}
    for p, p0, x, y in zip(adamw.params, start, a, w):
        if p.name in weights:
            np.testing.assert_allclose(y, x - 0.01 * 0.1 * p0, rtol=0, atol=1e-8)
            assert np.array_equal(x, y) == (not p0.any())  # the MLP's last W starts at 0
        else:
            assert np.array_equal(x, y), p.name


def test_label_smoothing_moves_the_targets():
    """--label-smoothing EPS: the step's targets are 1 - EPS on the true class and EPS spread
    over all K. The MLP's last layer starts at zero, so its first logits are all 0 and the
    first SGD step (lr 1, no momentum) moves its bias by the mean of target - 1/K: with EPS,
    (1 - EPS) times the step without, and the loss is log K either way."""
    from pympgu import models
    ds = data.load()
    idx = np.arange(100, dtype=np.int32)
    moved = {}
    for eps in (0.0, 0.2):
        m = models.build(None, ds.n_in, [16], ds.n_classes, label_smoothing=eps)
        tr, _ = m.compile(ds, 100, 100, 1.0, 0.0, 0.0, 0.0, "FAST_RUN")
        assert float(tr(idx)) == pytest.approx(np.log(10), rel=1e-6)
        moved[eps] = np.array(m.params[-1].get_value())
    counts = np.bincount(ds.train[1][:100], minlength=10)
    np.testing.assert_allclose(moved[0.0], counts / 100 - 0.1, atol=1e-6)
    np.testing.assert_allclose(moved[0.2], 0.8 * moved[0.0], atol=1e-6)
    with pytest.raises(ValueError, match="label_smoothing must be in"):
        models.build(None, ds.n_in, [16], ds.n_classes, label_smoothing=1.0)


def test_nesterov_looks_ahead_along_the_velocity():
    """--nesterov: the step moves the parameters by momentum * v_new - lr * g. From zero
    velocity the first step is (1 + momentum) times plain momentum's: the MLP's last
    bias (its layer starts at zero) at lr 1 and momentum 0.5. Nesterov is SGD's alone."""
    from pympgu import models
    ds = data.load()
    idx = np.arange(100, dtype=np.int32)
    moved = {}
    for nesterov in (False, True):
        m = models.build(None, ds.n_in, [16], ds.n_classes, nesterov=nesterov)
        tr, _ = m.compile(ds, 100, 100, 1.0, 0.5, 0.0, 0.0, "FAST_RUN")
        tr(idx)
        moved[nesterov] = np.array(m.params[-1].get_value())
        assert np.array_equal(m.slots[-1].get_value(), moved[False])  # v_new = -g either way
    counts = np.bincount(ds.train[1][:100], minlength=10)
    np.testing.assert_allclose(moved[False], counts / 100 - 0.1, atol=1e-6)
    np.testing.assert_allclose(moved[True], 1.5 * moved[False], atol=1e-6)
    with pytest.raises(ValueError, match="nesterov is SGD's momentum, not 'adam'"):
        models.build(None, ds.n_in, [16], ds.n_classes, optimizer="adam", nesterov=True)


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_clip_norm_scales_the_gradients_to_their_global_norm(optimizer):
    """--clip-norm C: a step's gradients, all together, are scaled to a 2-norm of at most
    C (torch.nn.utils.clip_grad_norm_'s rule). From zero state the first step leaves the
    clipped gradients in the optimizer's state (SGD's velocity, -lr * g at lr 1 and no
    momentum; Adam's first moment, (1 - beta1) * g): with a C far above the gradients'
    norm they are the unclipped ones, and with a C below it the same directions at norm
    C. A negative C is refused."""
    from pympgu import models
    ds = data.load()
    idx = np.arange(100, dtype=np.int32)
    state = {}
    for clip in (0.0, 1e6, 0.01):
        m = models.build(None, ds.n_in, [16], ds.n_classes, optimizer=optimizer,
                         clip_norm=clip)
        tr, _ = m.compile(ds, 100, 100, 1.0, 0.0 if optimizer == "sgd" else 0.9, 0.0, 1e-4,
                          "FAST_RUN")
        tr(idx)
        state[clip] = [np.array(v.get_value()) for v in m.slots[:len(m.params)]]
    scale = 1.0 if optimizer == "sgd" else 0.1

    def norm(arrays):
        return np.sqrt(sum(float(np.sum(np.square(a, dtype=np.float64))) for a in arrays))
    assert norm(state[0.0]) > 10 * 0.01 * scale  # the clip below binds
    for a, b in zip(state[0.0], state[1e6]):
        np.testing.assert_allclose(b, a, rtol=1e-6, atol=1e-9)
    assert norm(state[0.01]) == pytest.approx(0.01 * scale, rel=1e-4)
    for a, b in zip(state[0.0], state[0.01]):
        np.testing.assert_allclose(b, a * (0.01 * scale / norm(state[0.0])), rtol=1e-4,
                                   atol=1e-10)
    with pytest.raises(ValueError, match="clip_norm must be 0"):
        models.build(None, ds.n_in, [16], ds.n_classes, clip_norm=-1.0)


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_ema_averages_the_parameters_and_evaluation_reads_it(optimizer):
    """--ema D: the state holds each parameter's moving average, started at its first value
    and moved after every step by D * average + (1 - D) * parameter (numpy's model of it,
    after three steps), and evaluation (with the batch norms' statistics it normalises
    by) reads the average: its errors are those of a model whose parameters are the
    averages. A D outside [0, 1) is refused, as is a parameter named as an average."""
    from pympgu import models
    ds = data.load()
    lr = 0.5 if optimizer == "sgd" else 0.01
    m = models.build(None, ds.n_in, [16], ds.n_classes, optimizer=optimizer, ema=0.9)
    first = [np.array(p.get_value()) for p in m.params]
    tr, ev = m.compile(ds, 100, 100, lr, 0.9, 0.0, 1e-4, "FAST_RUN")
    assert [a.name for a in m.averages] == [f"ema_{p.name}" for p in m.params]
    assert all(a is b for a, b in zip(m.state[-len(m.params):], m.averages))
    average = first
    for t in range(3):
        tr(np.arange(100 * t, 100 * t + 100, dtype=np.int32))
        average = [np.float32(0.9) * a + np.float32(0.1) * p.get_value()
                   for a, p in zip(average, m.params)]
    for a, b in zip(average, m.averages):
        np.testing.assert_allclose(b.get_value(), a, rtol=1e-6, atol=1e-7)
    eidx = np.arange(100, dtype=np.int32)
    plain = models.build(None, ds.n_in, [16], ds.n_classes, optimizer=optimizer)
    _, plain_ev = plain.compile(ds, 100, 100, lr, 0.9, 0.0, 1e-4, "FAST_RUN")
    for p, a in zip(plain.params, m.averages):
        p.set_value(a.get_value())
    assert np.array_equal(ev(eidx), plain_ev(eidx))
    for p, a in zip(plain.params, m.params):  # the parameters themselves err otherwise
        p.set_value(a.get_value())
    assert not np.array_equal(ev(eidx), plain_ev(eidx))
    with pytest.raises(ValueError, match="ema must be in"):
        models.build(None, ds.n_in, [16], ds.n_classes, ema=1.0)
    named = models.Model()
    named.parameter(np.zeros(3), "W")
    with pytest.raises(ValueError, match="reserved"):
        named.parameter(np.zeros(3), "ema_W")


def test_ema_run_checkpoints_evaluates_and_resumes_its_average(tmp_path, capsys):
    """--ema on 2 CPU workers: the replicas average the moving average with the rest of
    the state and end identical (run() checks), the checkpoint holds it, pympgu.evaluate
    reads it and says so, its errors the run's own; a run without --ema resumed with it
    starts the average at the checkpoint's parameters, and says so."""
    from pympgu import evaluate
    out = str(tmp_path / "run")
    hist = train(config(epochs=1, hidden=[32], ema=0.99, out=out),
                     quiet=True)
    assert "evaluated by its moving average (0.99)" in capsys.readouterr().out
    with np.load(os.path.join(out, ckpt.CHECKPOINT)) as f:
        assert {"ema_W0", "ema_b1"} <= set(f.files)
        assert not np.array_equal(f["ema_W0"], f["W0"])
    run = evaluate.load(out, "last", backend="c")
    report = run.evaluate("test")
    assert report["error"] == pytest.approx(hist[-1]["test_error"], abs=1e-9)
    assert "(its moving average)" in evaluate.format_report(run, report)[0]
    plain = str(tmp_path / "plain")
    train(config(epochs=1, hidden=[32], out=plain), quiet=True)
    capsys.readouterr()
    more = train(config(epochs=2, hidden=[32], ema=0.99,
                            resume=os.path.join(plain, ckpt.CHECKPOINT)),
                     quiet=True)
    assert len(more) == 2
    assert "holds no moving average of the parameters; this run starts one" in \
        capsys.readouterr().err


@pytest.mark.parametrize("optimizer", ["adam", "adamw"])
def test_adam_resumed_goes_on_with_its_schedule_and_bias_correction(tmp_path, optimizer,
                                                                   capsys):
    """Adam (or AdamW), warmed up over one and a half epochs on 2 CPU workers: stopped after
    the first epoch and resumed, it goes on from the run's step (its warm-up, its bias
    correction and AdamW's decay) to the same numbers as a run that never stopped, and
    learns. Resumed by the other of the two, whose state is the same, it says so."""
    opts = dict(optimizer=optimizer, lr=0.003, warmup=1.5, hidden=[32],
                weight_decay=0.05 if optimizer == "adamw" else 0.0)
    whole = train(config(epochs=2, **opts), quiet=True)
    out = str(tmp_path / "run")
    train(config(epochs=1, out=out, **opts), quiet=True)
    resumed = train(config(epochs=2, resume=os.path.join(out, ckpt.CHECKPOINT), **opts), quiet=True)
    keys = ("loss", "valid_error", "test_error", "lr")
    assert [[h[k] for k in keys] for h in resumed] == [[h[k] for k in keys] for h in whole]
    assert whole[0]["lr"] < 0.003 and whole[1]["lr"] == 0.003, whole  # ramped, then held
    assert whole[-1]["test_error"] < 0.2, whole  # chance is 0.9
    with np.load(os.path.join(out, ckpt.CHECKPOINT)) as f:
        assert str(f["__optimizer__"]) == optimizer and {"m_W0", "s_b1"} <= set(f.files)
    other = {"adam": "adamw", "adamw": "adam"}[optimizer]
    capsys.readouterr()
    train(config(epochs=2, optimizer=other, lr=0.003, hidden=[32],
                     resume=os.path.join(out, ckpt.CHECKPOINT)), quiet=True)
    assert (f"its state was trained by {optimizer}; this run goes on by {other}"
            in capsys.readouterr().err)
