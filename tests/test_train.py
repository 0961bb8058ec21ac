"""Training end to end on CPU workers, the data loaders' errors, and the CLI's checks."""
import gzip
import io
import json
import os
import pickle
import shutil
import signal
import subprocess
import sys
import tarfile

import numpy as np
import pytest

from processes import kill_session, session_left, start, wait_until
from pympgu import data
from pympgu.training import checkpoint as ckpt
from pympgu.training import cli, launcher, replica
from pympgu.training.config import RunConfig, UsageError
from pympgu.training.launcher import run as train
from pympgu.training.report import Reporter

pytestmark = pytest.mark.timeout(600)


def config(**over):
    """A run of 2 CPU workers on PyTensor's own backend, with ``over`` changed."""
    return RunConfig(**dict(dict(backend="c", devices=(None, None)), **over))


def test_two_cpu_workers_learn_real_digits(tmp_path):
    out = str(tmp_path / "run")
    hist = train(config(epochs=2, out=out))
    assert len(hist) == 2
    assert hist[-1]["test_error"] < 0.25, hist  # chance is 0.9
    assert hist[-1]["loss"] < hist[0]["loss"]
    for name in ("config.json", "metrics.jsonl", "checkpoint.npz", "curves.png"):
        assert os.path.getsize(os.path.join(out, name)) > 0, name
    lines = [json.loads(x) for x in open(os.path.join(out, "metrics.jsonl"))]
    assert [x["epoch"] for x in lines] == [1, 2]
    # Resume for a third epoch: it starts where the checkpoint ended.
    more = train(config(epochs=3, out=out, resume=os.path.join(out, "checkpoint.npz")))
    assert [h["epoch"] for h in more] == [1, 2, 3]
    assert more[:2] == hist


def test_a_fresh_run_into_an_earlier_runs_out_starts_its_log_over(tmp_path, capsys):
    # Appending would interleave two runs' epochs in metrics.jsonl; a resumed run appends.
    out = str(tmp_path / "run")
    cfg = config(epochs=1, hidden=[16], out=out)
    train(cfg, quiet=True)
    assert "holds an earlier run" not in capsys.readouterr().err
    train(cfg, quiet=True)
    assert f"--out {out} holds an earlier run" in capsys.readouterr().err
    assert [json.loads(x)["epoch"] for x in open(os.path.join(out, "metrics.jsonl"))] == [1]
    train(config(epochs=2, hidden=[16], out=out,
                     resume=os.path.join(out, ckpt.CHECKPOINT)), quiet=True)
    assert "holds an earlier run" not in capsys.readouterr().err
    assert [json.loads(x)["epoch"] for x in open(os.path.join(out, "metrics.jsonl"))] == [1, 2]


def test_a_run_stopped_before_its_first_epoch_leaves_the_earlier_run_whole(tmp_path, capsys):
    """config.json builds the model that pympgu.evaluate loads the checkpoints into: a new
    run over an earlier one replaces it with the checkpoints, after its first epoch, not
    when it starts. A run resumed from elsewhere does not append to the earlier run's log:
    its log is its checkpoint's history, the run it resumed and its own epochs."""
    from pympgu import evaluate
    from pympgu.runtime import WorkerFailed
    out = str(tmp_path / "run")
    read = lambda name: open(os.path.join(out, name)).read()  # noqa: E731
    train(config(epochs=1, hidden=[16], out=out), quiet=True)
    earlier = {name: read(name) for name in ("config.json", "metrics.jsonl")}
    path = tmp_path / "models.py"
    path.write_text(BAD_MODELS)
    with pytest.raises(WorkerFailed):  # its ranks start from different values
        train(config(epochs=1, model=f"{path}:Unseeded", out=out),
                  quiet=True)
    assert {name: read(name) for name in earlier} == earlier
    assert not os.path.exists(os.path.join(out, ckpt.CONFIG_NEXT))
    assert evaluate.load(out).epoch == 1
    # Resumed from elsewhere into it: a fresh log, and this run's flags once its epoch ends.
    other = str(tmp_path / "other")
    train(config(epochs=1, hidden=[8], out=other), quiet=True)
    capsys.readouterr()
    train(config(epochs=2, hidden=[8], out=out, resume=os.path.join(other, ckpt.CHECKPOINT)), quiet=True)
    assert f"--out {out} holds an earlier run" in capsys.readouterr().err
    log = open(os.path.join(out, "metrics.jsonl")).readlines()
    assert [json.loads(x)["epoch"] for x in log] == [1, 2]
    assert log[0] == open(os.path.join(other, "metrics.jsonl")).readline()
    assert json.loads(read("config.json"))["hidden"] == [8]
    assert not os.path.exists(os.path.join(out, ckpt.CONFIG_NEXT))
    assert evaluate.load(out).epoch == 2


def test_a_checkpoint_of_another_shape_is_refused_before_any_worker_starts(tmp_path):
    out = str(tmp_path / "run")
    train(config(epochs=1, hidden=[16], out=out), quiet=True)
    with pytest.raises(UsageError) as info:
        train(config(epochs=2, hidden=[32], resume=os.path.join(out, ckpt.CHECKPOINT)), quiet=True)
    assert info.value.flag == "--resume"
    assert ("cannot resume from it: 'W0' is (784, 16), this model's is (784, 32) (it holds "
            "MLP 784-16-10, trained by sgd; this run builds MLP 784-32-10, trained by sgd)"
            ) in str(info.value), info.value
    # SGD's momentum is not Adam's state.
    with pytest.raises(UsageError) as info:
        train(config(epochs=2, hidden=[16], optimizer="adam",
                         resume=os.path.join(out, ckpt.CHECKPOINT)), quiet=True)
    assert ("cannot resume from it: it has no 'm_W0' (it holds MLP 784-16-10, trained by sgd; "
            "this run builds MLP 784-16-10, trained by adam)") in str(info.value), info.value


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


def test_out_keeps_the_best_epoch_beside_the_last(tmp_path, capsys):
    """--out keeps best.npz, the epoch of least validation error (the first of equals), which
    --resume takes as it takes checkpoint.npz; the run's last line names it, and with a
    schedule every epoch's line shows its rate."""
    out = str(tmp_path / "run")
    hist = train(config(epochs=3, hidden=[16], out=out, schedule="cosine", warmup=0.5), quiet=True)
    best = min(hist, key=lambda h: h["valid_error"])
    assert ckpt.epoch_of(os.path.join(out, ckpt.BEST)) == best["epoch"], hist
    printed = capsys.readouterr().out
    assert f"(epoch {best['epoch']}, its checkpoint {os.path.join(out, ckpt.BEST)})" in printed
    assert f"class by class: python -m pympgu.evaluate {out}" in printed
    assert [line.split("  lr ")[-1] for line in printed.splitlines()
            if line.startswith("epoch")] == [f"{h['lr']:.3g}" for h in hist], printed
    more = train(config(epochs=4, hidden=[16], resume=os.path.join(out, ckpt.BEST),
                            schedule="cosine", warmup=0.5), quiet=True)
    assert [h["epoch"] for h in more] == list(range(1, best["epoch"] + 1)) + [best["epoch"] + 1]
    assert ckpt.epoch_of(os.path.join(out, "missing.npz")) is None


def test_epochs_since_best_counts_from_the_first_of_equals():
    def history(*errors):
        return [{"valid_error": e} for e in errors]
    assert ckpt.epochs_since_best(history(0.3)) == 0
    assert ckpt.epochs_since_best(history(0.3, 0.2, 0.25, 0.2)) == 2
    assert ckpt.epochs_since_best(history(0.3, 0.2, 0.1)) == 0


def test_patience_stops_every_worker_after_the_same_epoch(tmp_path, capsys):
    """--patience 2, resumed from a checkpoint whose epoch 1 no epoch can beat (its
    validation error set to 0): the run counts the epochs before it, so both workers stop
    after epoch 3, identical (run() checks), and say why."""
    import json
    out = str(tmp_path / "run")
    cfg = config(epochs=1, hidden=[16], out=out)
    train(cfg, quiet=True)
    path = os.path.join(out, ckpt.CHECKPOINT)
    with np.load(path) as f:
        arrays = dict(f)
    history = json.loads(str(arrays["__history__"]))
    history[0]["valid_error"] = 0.0
    arrays["__history__"] = json.dumps(history)
    np.savez(path, **arrays)
    capsys.readouterr()
    hist = train(cfg.replace(epochs=6, patience=2, resume=path), quiet=True)
    assert [h["epoch"] for h in hist] == [1, 2, 3]
    assert ("stopped after epoch 3 of 6: no better validation error than epoch 1's in 2 "
            "epochs (--patience 2)") in capsys.readouterr().out
    assert ckpt.epoch_of(path) == 3


def test_cpu_runs_are_reproducible():
    a = train(config(epochs=1, hidden=[64]))
    b = train(config(epochs=1, hidden=[64]))
    keys = ("loss", "valid_error", "test_error")
    assert [[h[k] for k in keys] for h in a] == [[h[k] for k in keys] for h in b]


@pytest.mark.slow
@pytest.mark.skipif(not os.path.isdir(data.FASHION_DIR), reason="dataset-fashion-mnist not installed")
def test_fashion_two_workers_match_one(tmp_path):
    """Two workers of batch 128 averaged every step against one worker of batch 256."""
    one = train(config(data="fashion", epochs=2, batch_size=256, hidden=[256], devices=[None]))
    two = train(config(data="fashion", epochs=2, batch_size=128, hidden=[256]))
    e1, e2 = one[-1]["test_error"], two[-1]["test_error"]
    print(f"fashion-mnist test error: 1 worker {100 * e1:.2f}%, 2 workers {100 * e2:.2f}%")
    assert abs(e1 - e2) <= 0.005
    assert e2 < 0.2


@pytest.mark.slow
@pytest.mark.skipif(not os.path.isdir(data.FASHION_DIR), reason="dataset-fashion-mnist not installed")
def test_fashion_exchange_variants_match_plain_averaging():
    """--overlap, a bfloat16 wire and --sync-every 4 against plain per-step averaging. With
    --sync-every 4 --overlap the whole state crosses during the due step, corrected after
    it: corrected at the next sync point instead, this run reached 31% test error."""
    base = dict(data="fashion", epochs=2, batch_size=128, hidden=[256])
    runs = {"plain": {}, "overlap": dict(overlap=True), "bf16 wire": dict(exchange_dtype="bfloat16"),
            "sync every 4": dict(sync_every=4),
            "overlap + bf16": dict(overlap=True, exchange_dtype="bfloat16"),
            "overlap + sync every 4": dict(overlap=True, sync_every=4)}
    errors = {}
    for name, over in runs.items():
        errors[name] = train(config(**base, **over))[-1]["test_error"]
    print("fashion-mnist test error, 2 workers: " +
          ", ".join(f"{k} {100 * v:.2f}%" for k, v in errors.items()))
    for name, err in errors.items():
        assert abs(err - errors["plain"]) <= 0.005, (name, errors)


def test_overlap_and_wire_dtype_keep_replicas_identical():
    # run() checks every rank's final digest and raises if the replicas differ
    hist = train(config(epochs=1, hidden=[32], overlap=True, exchange_dtype="bfloat16",
                            sync_every=3, devices=[None, None, None]))
    assert hist[-1]["test_error"] < 0.5


@pytest.mark.parametrize("optimizer,lr", [("sgd", 0.1), ("adam", 0.003), ("adamw", 0.003)])
def test_jax_graph_agrees_with_c_backend_on_one_step(jax_process, optimizer, lr):
    pytest.importorskip("jax")
    jax_process("jax_graph_agrees_with_c_backend", optimizer, lr)


def test_shards_are_disjoint_and_even():
    for nranks in (1, 2, 3, 8):
        shards = [data.shard_batches(1000, 16, nranks, r, seed=5, epoch=2) for r in range(nranks)]
        flat = np.concatenate([np.concatenate(s) for s in shards])
        assert len(set(flat.tolist())) == len(flat)
        assert len({len(s) for s in shards}) == 1
    a = data.shard_batches(1000, 16, 2, 0, seed=5, epoch=2)
    b = data.shard_batches(1000, 16, 2, 0, seed=5, epoch=3)
    assert not np.array_equal(a[0], b[0])


def test_embedded_split_is_a_fixed_shuffle_of_every_image():
    # The t10k file's last images come from other writers than its first: split in file
    # order, validation was far easier than test. The split must keep every image once,
    # mix the file's order, and be the same on every load.
    ds = data.load()
    x, y = data.load_idx_pair(data.EMBEDDED_DIR, "t10k")
    parts = [ds.train, ds.valid, ds.test]
    assert [len(p[1]) for p in parts] == [8000, 1000, 1000]

    def pairs(xs, ys):
        return sorted((r.tobytes(), int(label)) for r, label in zip(xs, ys))

    assert pairs(np.concatenate([p[0] for p in parts]),
                 np.concatenate([p[1] for p in parts])) == pairs(x, y)
    assert not np.array_equal(ds.test[1], y[-1000:])  # not the file's last thousand
    again = data.load()
    assert all(np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1])
               for a, b in zip(parts, [again.train, again.valid, again.test]))


def test_data_errors_name_the_file(tmp_path):
    src = data.EMBEDDED_DIR
    # A directory or file holding nothing pympgu reads: what it does read.
    (tmp_path / "notes.txt").write_text("not images")
    for path in (tmp_path, tmp_path / "notes.txt"):
        with pytest.raises(data.DataError, match=f"{path}: (no dataset here|not a dataset): "
                                                 "pympgu reads a directory of MNIST-format"):
            data.load(str(path))
    shutil.copy(os.path.join(src, "t10k-labels-idx1-ubyte.gz"), tmp_path)
    with pytest.raises(data.DataError, match="t10k-images-idx3-ubyte.gz: no such file"):
        data.load(str(tmp_path))
    raw = gzip.open(os.path.join(src, "t10k-images-idx3-ubyte.gz")).read()
    with gzip.open(tmp_path / "t10k-images-idx3-ubyte.gz", "wb") as f:
        f.write(raw[:100000])
    with pytest.raises(data.DataError, match=r"t10k-images-idx3-ubyte.gz: 100000 bytes.*truncated"):
        data.load(str(tmp_path))
    (tmp_path / "t10k-images-idx3-ubyte.gz").write_bytes(b"not gzip at all")
    with pytest.raises(data.DataError, match="t10k-images-idx3-ubyte.gz: cannot be read"):
        data.load(str(tmp_path))
    # A gzip header and corrupt deflate data past it (zlib.error), and a gzip cut short.
    packed = bytearray(gzip.compress(raw[:200000]))
    packed[12:20] = b"\xff" * 8
    (tmp_path / "t10k-images-idx3-ubyte.gz").write_bytes(bytes(packed))
    with pytest.raises(data.DataError, match="t10k-images-idx3-ubyte.gz: cannot be read "
                                             r"\(error: .*invalid code lengths set"):
        data.load(str(tmp_path))
    (tmp_path / "t10k-images-idx3-ubyte.gz").write_bytes(gzip.compress(raw)[:5000])
    with pytest.raises(data.DataError, match="t10k-images-idx3-ubyte.gz: cannot be read "
                                             r"\(EOFError: "):
        data.load(str(tmp_path))
    (tmp_path / "t10k-images-idx3-ubyte.gz").unlink()
    (tmp_path / "t10k-images-idx3-ubyte").write_bytes(raw[:8] + raw[16:])  # header cut
    with pytest.raises(data.DataError, match="magic|bytes"):
        data.load(str(tmp_path))
    (tmp_path / "mnist.pkl.gz").write_bytes(gzip.compress(b"garbage"))
    with pytest.raises(data.DataError, match="mnist.pkl.gz: not a readable"):
        data.load(str(tmp_path / "mnist.pkl.gz"))


def blobs(n, rng, centers):
    """n examples of Gaussian blobs around ``centers`` (classes 0..k-1), as 4x5 'images'
    in float64, the way a user's own arrays may come."""
    y = rng.integers(0, len(centers), n)
    return (centers[y] + rng.normal(0, 1, (n, centers.shape[1]))).reshape(n, 4, 5), y


def test_a_dataset_of_ones_own_trains_from_npz(tmp_path, capsys):
    """--data-dir FILE.npz: the inputs flattened to float32 as they are, the number of
    classes from the labels, a tenth of the training set kept for validation after a fixed
    shuffle (labels sorted by class would otherwise leave it one class), and the model
    sized by the data: it learns far better than chance."""
    rng = np.random.default_rng(0)
    centers = rng.normal(0, 1.5, (3, 20))
    x, y = blobs(3000, rng, centers)
    order = np.argsort(y, kind="stable")  # sorted by class, as data often comes
    xt, yt = blobs(500, rng, centers)
    path = tmp_path / "blobs.npz"
    np.savez(path, x_train=x[order], y_train=y[order], x_test=xt, y_test=yt.astype(np.int16))
    ds = data.load(str(path))
    assert (ds.n_in, ds.n_classes) == (20, 3) and ds.train[0].dtype == np.float32
    assert [len(s[1]) for s in (ds.train, ds.valid, ds.test)] == [2700, 300, 500]
    assert set(np.unique(ds.valid[1])) == {0, 1, 2}
    # The validation split is a shuffled tenth of the training set, the same every time.
    assert np.array_equal(data.load(str(path)).valid[0], ds.valid[0])
    assert np.array_equal(np.sort(np.concatenate([ds.train[1], ds.valid[1]])), y[order])
    assert cli.main(["--cpu", "2", "--data-dir", str(path), "--hidden", "32", "--epochs",
                       "2", "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "blobs.npz (2700/300/500 train/valid/test, 20 inputs) | MLP 20-32-3" in out, out
    test_error = float(out.split("its test error ")[1].split("%")[0])
    assert test_error < 20, out  # chance is 67%
    # Its own validation split is used as given.
    np.savez(path, x_train=x, y_train=y, x_valid=xt[:100], y_valid=yt[:100], x_test=xt,
             y_test=yt)
    assert len(data.load(str(path)).valid[1]) == 100


def fake_cifar(directory, kind="cifar-10", n=40, seed=0):
    """CIFAR's python files, as its authors pickle them (bytes keys, uint8 rows of 3072
    values, plane by plane), of n images a batch whose class sets one colour plane's
    brightness (learnable from the channels alone); returns every batch's (data, labels)."""
    unpacked, train_files, test_file, label_key, n_classes = data.CIFAR[kind]
    rng = np.random.default_rng(seed)
    os.makedirs(directory, exist_ok=True)
    out = {}
    for name in train_files + [test_file]:
        y = rng.integers(0, n_classes, n)
        x = rng.integers(0, 64, (n, 3, 1024))
        x[np.arange(n), y % 3] += (64 + 60 * (y // 3 % 3))[:, None]  # class: plane, level
        batch = {b"data": x.reshape(n, 3072).astype(np.uint8), label_key: list(map(int, y)),
                 b"batch_label": name.encode()}
        with open(os.path.join(directory, name), "wb") as f:
            pickle.dump(batch, f, protocol=2)
        out[name] = batch[b"data"], y
    meta, key = data.CIFAR_META[kind]
    with open(os.path.join(directory, meta), "wb") as f:
        pickle.dump({key: [f"class {c}".encode() for c in range(n_classes)]}, f, protocol=2)
    return out


def test_cifar_loads_from_its_directory_its_archive_or_a_directory_holding_them(tmp_path):
    """CIFAR-10's python version as downloaded: its five training batches in order, the
    last tenth of them kept for validation, the test batch, images scaled to [0, 1] with
    the colour planes first (as conv2d's NCHW reshape reads them); from the unpacked
    directory, the .tar.gz, or the directory either lies in. CIFAR-100 has 100 classes."""
    import tarfile
    batches = fake_cifar(tmp_path / "cifar-10-batches-py")
    ds = data.load(str(tmp_path / "cifar-10-batches-py"))
    assert (ds.name, ds.n_in, ds.n_classes) == ("cifar-10", 3072, 10)
    assert ds.class_names == [f"class {c}" for c in range(10)]  # from batches.meta
    assert [len(s[1]) for s in (ds.train, ds.valid, ds.test)] == [180, 20, 40]
    x = np.concatenate([batches[f"data_batch_{k}"][0] for k in range(1, 6)])
    assert np.array_equal(ds.train[0], x[:180].astype(np.float32) / 255)
    assert np.array_equal(ds.valid[1], batches["data_batch_5"][1][20:])
    assert np.array_equal(ds.test[1], batches["test_batch"][1])
    # Red plane first: the first 1024 values of a red image (class 0) are its brightest.
    red = ds.test[0][ds.test[1] == 0].reshape(-1, 3, 1024).mean(axis=(0, 2))
    assert red[0] > red[1] and red[0] > red[2], red
    with tarfile.open(tmp_path / "cifar-10-python.tar.gz", "w:gz") as t:
        t.add(tmp_path / "cifar-10-batches-py", arcname="cifar-10-batches-py")
    (tmp_path / "elsewhere").mkdir()
    os.rename(tmp_path / "cifar-10-python.tar.gz", tmp_path / "elsewhere" / "cifar-10-python.tar.gz")
    for where in (tmp_path, tmp_path / "elsewhere", tmp_path / "elsewhere" / "cifar-10-python.tar.gz"):
        again = data.load(str(where))
        assert np.array_equal(again.train[0], ds.train[0]) and again.n_classes == 10, where
        assert again.class_names == ds.class_names, where
    fake_cifar(tmp_path / "c100" / "cifar-100-python", "cifar-100", n=50)
    hundred = data.load(str(tmp_path / "c100"))
    assert (hundred.name, hundred.n_classes, len(hundred.train[1])) == ("cifar-100", 100, 45)
    assert hundred.class_names[99] == "class 99"
    os.remove(tmp_path / "c100" / "cifar-100-python" / "meta")  # the names are optional
    assert data.load(str(tmp_path / "c100")).class_names is None


def test_cifar_errors_name_the_file(tmp_path, capsys):
    with pytest.raises(SystemExit):  # a name, not a path: where to get it
        cli.main(["--cpu", "2", "--data-dir", "cifar10"])
    assert "--data-dir cifar10: no such file or directory (pympgu reads CIFAR as its " \
        "authors ship it: download https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz" \
        in capsys.readouterr().err
    fake_cifar(tmp_path / "c")
    (tmp_path / "c" / "data_batch_3").write_bytes(b"garbage")
    with pytest.raises(data.DataError, match=r"c: data_batch_3: not a CIFAR batch"):
        data.load(str(tmp_path / "c"))
    with open(tmp_path / "c" / "data_batch_3", "wb") as f:
        pickle.dump({b"data": np.zeros((4, 784), np.uint8), b"labels": [0] * 4}, f)
    with pytest.raises(data.DataError, match=r"data_batch_3: expected uint8 images of 3072 "
                                             r"values and a label each, got uint8 \(4, 784\)"):
        data.load(str(tmp_path / "c"))
    with open(tmp_path / "c" / "data_batch_3", "wb") as f:
        pickle.dump({b"data": np.zeros((4, 3072), np.uint8), b"labels": [0, 1, 2, 10]}, f)
    with pytest.raises(data.DataError, match="data_batch_3: labels outside 0 to 9"):
        data.load(str(tmp_path / "c"))
    with pytest.raises(data.DataError, match="missing.tar.gz: no such file"):
        data.load(str(tmp_path / "missing.tar.gz"))
    (tmp_path / "bad.tar.gz").write_bytes(b"not an archive")
    with pytest.raises(data.DataError, match="bad.tar.gz: not a readable CIFAR archive"):
        data.load(str(tmp_path / "bad.tar.gz"))
    # An archive whose gzip header reads, and whose deflate data past it does not.
    fake_cifar(tmp_path / "d")
    with tarfile.open(tmp_path / "d.tar.gz", "w:gz") as tar:
        tar.add(tmp_path / "d", arcname="cifar-10-batches-py")
    packed = bytearray((tmp_path / "d.tar.gz").read_bytes())
    cut = len(packed) * 3 // 10  # past the first member's header
    packed[cut:cut + 8] = b"\xff" * 8
    (tmp_path / "d.tar.gz").write_bytes(bytes(packed))
    with pytest.raises(data.DataError, match=r"d.tar.gz: not a readable CIFAR archive "
                                             r"\(error: Error -3 while decompressing"):
        data.load(str(tmp_path / "d.tar.gz"))


def test_a_convnet_trains_on_cifar_shaped_images(tmp_path, capsys):
    """3-channel 32x32 images from CIFAR's files through examples/strided.py on 2 CPU
    workers (CPU JAX, as GPU workers compile it): the model reads them as 3x32x32, and
    learns classes set by colour far better than chance."""
    pytest.importorskip("jax")
    fake_cifar(tmp_path / "cifar-10-batches-py", n=200)
    strided = os.path.join(os.path.dirname(EXAMPLE), "strided.py:StridedConvNet")
    assert cli.main(["--cpu", "2", "--data-dir", str(tmp_path), "--model", strided,
                       "--hidden", "8", "16", "--batch-size", "50", "--epochs", "4",
                       "--optimizer", "adam", "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "cifar-10 (900/100/200 train/valid/test, 3072 inputs) | StridedConvNet 3x32x32" in out
    test_error = float(out.split("its test error ")[1].split("%")[0])
    assert test_error < 50, out  # chance is 90%; two runs here: 20.0%


@pytest.mark.parametrize("arrays,message", [
    (dict(x_train=np.zeros((4, 2)), y_train=np.zeros(4, int)),
     "no array x_test, y_test (it has x_train, y_train; it needs"),
    (dict(x_train=np.zeros((4, 2)), y_train=np.zeros(3, int), x_test=np.zeros((2, 2)),
          y_test=np.zeros(2, int)), "x_train (4, 2) and y_train (3,) must hold as many"),
    (dict(x_train=np.zeros((40, 2)), y_train=np.full(40, 0.5), x_test=np.zeros((2, 2)),
          y_test=np.zeros(2, int)), "y_train integers (got float64 and float64)"),
    (dict(x_train=np.full((40, 2), np.nan), y_train=np.zeros(40, int),
          x_test=np.zeros((2, 2)), y_test=np.zeros(2, int)), "x_train holds NaN"),
    (dict(x_train=np.zeros((40, 2)), y_train=-np.ones(40, int), x_test=np.zeros((2, 2)),
          y_test=np.zeros(2, int)), "y_train holds negative labels (-1)"),
    (dict(x_train=np.zeros((40, 2)), y_train=np.arange(40) % 2, x_test=np.zeros((2, 3)),
          y_test=np.zeros(2, int)), "the splits' inputs differ in size (train 2, test 3"),
    (dict(x_train=np.zeros((5, 2)), y_train=np.arange(5) % 2, x_test=np.zeros((2, 2)),
          y_test=np.zeros(2, int)), "5 training examples are too few"),
    (dict(x_train=np.zeros((40, 2)), y_train=np.zeros(40, int), x_test=np.zeros((2, 2)),
          y_test=np.zeros(2, int)), "every label is 0"),
    (dict(x_train=np.zeros((40, 2)), y_train=np.arange(40) % 2, x_valid=np.zeros((2, 2)),
          x_test=np.zeros((2, 2)), y_test=np.zeros(2, int)), "no array y_valid"),
])
def test_npz_errors_name_the_file_and_the_array(tmp_path, arrays, message):
    path = tmp_path / "mine.npz"
    np.savez(path, **arrays)
    with pytest.raises(data.DataError) as info:
        data.load(str(path))
    assert str(info.value).startswith(f"{path}: ") and message in str(info.value), info.value
    (tmp_path / "junk.npz").write_bytes(b"not a zip")
    with pytest.raises(data.DataError, match="junk.npz: not a readable .npz"):
        data.load(str(tmp_path / "junk.npz"))


def test_digits_without_scikit_learn_says_what_to_install(monkeypatch):
    import sys
    monkeypatch.setitem(sys.modules, "sklearn.datasets", None)  # its import then fails
    with pytest.raises(data.DataError, match="'digits' dataset is scikit-learn's: pip install "
                                             '"pympgu\\[digits\\]"'):
        data.load("digits")
    import tomllib  # the extra it names is there
    with open(os.path.join(os.path.dirname(__file__), "..", "pyproject.toml"), "rb") as f:
        extras = tomllib.load(f)["project"]["optional-dependencies"]
    assert extras["digits"] == ["scikit-learn>=1.0"]


def test_seed_pickle_format(tmp_path):
    import pickle
    rng = np.random.default_rng(0)
    splits = [(rng.random((n, 784), dtype=np.float32), rng.integers(0, 10, n)) for n in (50, 20, 20)]
    path = tmp_path / "mnist.pkl.gz"
    with gzip.open(path, "wb") as f:
        pickle.dump(tuple(splits), f)
    ds = data.load(str(path))
    assert len(ds.train[1]) == 50 and ds.n_in == 784


@pytest.mark.parametrize("argv,message", [
    (["--gpus", "0", "0"], "--gpus"),
    (["--cpu", "0"], "--cpu must be 1 to 8"),
    (["--cpu", "2", "--gpus", "0"], "not both"),
    (["--cpu", "2", "--batch-size", "0"], "--batch-size must be at least 1"),
    (["--cpu", "2", "--data-dir", "/nonexistent/x"], "--data-dir /nonexistent/x"),
    (["--cpu", "2", "--resume", "/nonexistent"], "--resume /nonexistent"),
    (["--cpu", "2", "--exchange-blocks", "0"], "--exchange-blocks must be 1 to 512"),
    (["--cpu", "2", "--beta2", "0.99"], "--beta2 is Adam's; give --optimizer adam"),
    (["--cpu", "2", "--optimizer", "adam", "--beta2", "1"], "must be in [0, 1)"),
    (["--cpu", "2", "--optimizer", "adam", "--weight-decay", "0.1"],
     "--weight-decay is AdamW's decoupled decay; give --optimizer adamw"),
    (["--cpu", "2", "--optimizer", "adamw", "--weight-decay", "1"],
     "--weight-decay must be in [0, 1), got 1.0"),
    (["--cpu", "2", "--label-smoothing", "-0.1"], "--label-smoothing must be in [0, 1)"),
    (["--cpu", "2", "--nesterov", "--optimizer", "adam"], "--nesterov is SGD's momentum"),
    (["--cpu", "2", "--nesterov", "--preset", "dual_mlp"],
     "--nesterov needs a --momentum above 0, got 0.0"),
    (["--cpu", "2", "--clip-norm", "-1"], "--clip-norm must be 0 (off) or above, got -1.0"),
    (["--cpu", "2", "--ema", "1"], "--ema must be in [0, 1) (0: off), got 1.0"),
    (["--cpu", "2", "--patience", "-1"], "--patience must be 0 (off) or more epochs, got -1"),
    (["--cpu", "2", "--lr", "0"], "--lr must be positive"),
    (["--cpu", "2", "--epochs", "2", "--warmup", "3"], "--warmup must be 0 to --epochs (2)"),
    (["--cpu", "2", "--epochs", "-1"], "--epochs must be at least 1, got -1"),
    (["--cpu", "2", "--schedule", "step"], "invalid choice: 'step'"),
])
def test_cli_rejects_bad_flags(argv, message, capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(argv)
    assert info.value.code == 2
    assert message in capsys.readouterr().err


def test_cli_refusal_leaves_an_earlier_run_in_out_as_it_was(tmp_path, capsys):
    """A setting refused before any worker starts (a batch the data cannot fill) is a flag
    error in one line, and a run over an earlier one in --out leaves it as it was."""
    out = tmp_path / "run"
    out.mkdir()
    (out / ckpt.CHECKPOINT).write_bytes(b"an earlier run's")
    with pytest.raises(SystemExit) as info:
        cli.main(["--cpu", "2", "--batch-size", "6000", "--out", str(out)])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "error: --batch-size 6000 with 2 workers" in err, err
    assert "Traceback" not in err and len(err.splitlines()) == 1
    assert sorted(os.listdir(out)) == [ckpt.CHECKPOINT]


def test_cli_gives_adam_its_own_learning_rate():
    """Adam's and AdamW's default rate is 1e-3, SGD's 0.05 (a preset's is SGD's too); --lr
    overrides either. Neither Adam takes the L2 penalty unless --l2 is given, and AdamW
    decays by 0.01 (torch.optim.AdamW's default)."""
    parser = cli.build_parser()
    for argv, lr, l2, decay in [
            ([], 0.05, 1e-4, 0.0), (["--optimizer", "adam"], 1e-3, 0.0, 0.0),
            (["--optimizer", "adam", "--preset", "dual_mlp"], 1e-3, 0.0, 0.0),
            (["--optimizer", "adam", "--lr", "0.01", "--l2", "1e-4"], 0.01, 1e-4, 0.0),
            (["--optimizer", "adamw"], 1e-3, 0.0, 0.01),
            (["--optimizer", "adamw", "--preset", "dual_mlp"], 1e-3, 0.0, 0.01),
            (["--optimizer", "adamw", "--weight-decay", "0.1", "--l2", "1e-5"], 1e-3, 1e-5,
             0.1)]:
        cfg = cli.resolve(parser.parse_args(["--cpu", "2", *argv]), parser).cfg
        assert (cfg.lr, cfg.l2, cfg.weight_decay) == (lr, l2, decay), (argv, cfg)


def test_cli_backend_auto_is_jax_wherever_jax_is_installed(monkeypatch):
    """CPU workers compile with CPU JAX when it is installed (quicker than PyTensor's own
    backend for every model measured), else with PyTensor's; --backend says otherwise."""
    import importlib.util
    parser = cli.build_parser()

    def backend(*argv):
        return cli.resolve(parser.parse_args(["--cpu", "2", *argv]), parser).cfg.backend
    assert backend("--backend", "c") == "c" and backend("--backend", "jax") == "jax"
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "jax" else find_spec(name, *a))
    assert backend() == "c"
    monkeypatch.undo()
    if find_spec("jax") is not None:
        assert backend() == "jax"


def test_cli_refuses_a_batch_the_dataset_cannot_fill(capsys):
    """A batch larger than the training set allows, for the workers given, is a flag
    error before any worker starts, naming the flag and the largest batch that fits."""
    with pytest.raises(SystemExit) as info:
        cli.main(["--cpu", "2", "--batch-size", "5000", "--epochs", "1"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "--batch-size 5000 with 2 workers" in err and "give at most 4000" in err, err
    assert "Traceback" not in err
    # The seed's batch of 5000 is the preset's: fitted to the data, and said.
    assert cli.main(["--cpu", "2", "--preset", "dual_mlp", "--epochs", "1", "--quiet"]) == 0
    assert ("--preset dual_mlp: its batch of 5000 a worker needs 10,000 training examples a "
            "step and embedded MNIST (t10k, shuffled 8:1:1) has 8,000: batch 4000 a worker "
            "instead (--batch-size sets it)") in capsys.readouterr().err


def test_cli_names_an_out_dir_it_cannot_write(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(SystemExit) as info:
        cli.main(["--cpu", "2", "--epochs", "1", "--out", str(blocker / "run")])
    assert info.value.code == 2
    assert f"--out {blocker / 'run'}: " in capsys.readouterr().err
    with pytest.raises(SystemExit):  # a preset's batch, which fits one worker, is not blamed
        cli.main(["--cpu", "1", "--preset", "dual_mlp", "--out", str(blocker / "run")])
    err = capsys.readouterr().err
    assert f"--out {blocker / 'run'}: " in err and "its batch of" not in err, err


def test_cli_says_what_a_stopped_run_left_to_resume(tmp_path, monkeypatch, capsys):
    from pympgu.runtime import WorkerFailed
    out = tmp_path / "run"

    def stopped(error, epochs_done):
        def fake_run(cfg, port=None, quiet=False, **where):
            out.mkdir(exist_ok=True)  # run() makes --out before any worker starts
            if epochs_done:  # what the worker writes after each epoch
                np.savez(out / ckpt.CHECKPOINT, __epoch__=epochs_done, __history__="[]")
            raise error
        return fake_run

    argv = ["--cpu", "2", "--out", str(out)]
    monkeypatch.setattr(launcher, "run", stopped(KeyboardInterrupt(), 2))
    assert cli.main(argv) == 130
    err = capsys.readouterr().err
    assert "interrupted" in err and f"epoch 2's checkpoint is in {out}" in err, err
    assert f"continue with --resume {out}" in err
    # The next run fails before its first epoch ends: the checkpoint is the earlier run's.
    monkeypatch.setattr(launcher, "run", stopped(WorkerFailed(1, "exited with status 1"), 0))
    assert cli.main(argv) == 1
    err = capsys.readouterr().err
    assert "rank 1" in err and "no epoch of this run finished" in err and "(epoch 2)" in err, err
    (out / ckpt.CHECKPOINT).write_text("not a checkpoint")
    assert cli.main(argv) == 1
    assert "checkpoint.npz cannot be read as a checkpoint" in capsys.readouterr().err
    (out / ckpt.CHECKPOINT).unlink()
    assert cli.main(argv) == 1
    assert f"no epoch finished, so {out} holds no checkpoint" in capsys.readouterr().err
    monkeypatch.setattr(launcher, "run", stopped(KeyboardInterrupt(), 0))
    assert cli.main(["--cpu", "2"]) == 130
    assert "nothing was saved (--out DIR" in capsys.readouterr().err


def test_epoch_lines_name_the_exchange_road_once(tmp_path, capsys):
    """The road of the step's exchange (worker._road) is printed after the first
    epoch that reports it, again only when it changes, and kept in metrics.jsonl."""
    from pympgu.training.outdir import OutDir
    rep = Reporter(OutDir(str(tmp_path)), epochs=3, stream=io.StringIO())
    epoch = dict(kind="epoch", loss=0.5, valid_error=0.1, test_error=0.1,
                 samples_per_s=1000.0, exchange_share=None)
    for k, road in enumerate(["the update of the mean gradients"] * 2 + ["averaged after"]):
        rep(0, dict(epoch, epoch=k + 1, road=road))
    rep.close()
    out = capsys.readouterr().out.splitlines()
    assert [line.strip() for line in out if "exchange:" in line] == [
        "exchange: the update of the mean gradients", "exchange: averaged after"]
    assert out[1].strip().startswith("exchange:") and out[-1].strip().startswith("exchange:")
    lines = [json.loads(x) for x in open(tmp_path / "metrics.jsonl")]
    assert [x["road"] for x in lines] == ["the update of the mean gradients"] * 2 + [
        "averaged after"]


def test_help_explains_every_flag():
    r = subprocess.run([sys.executable, "-m", "pympgu.train", "--help"], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0
    for flag in ("--gpus", "--cpu", "--sync-every", "--preset", "--out", "--resume",
                 "--data-dir", "--hidden", "--method", "--overlap", "--exchange-dtype",
                 "--exchange-blocks", "--model", "--optimizer", "--schedule", "--warmup",
                 "--beta2", "--dropout", "--flip", "--shift", "--bn-examples"):
        assert flag in r.stdout


def test_direct_jax_step_matches_pytensor_call(jax_process):
    """pympgu.xla.step calls PyTensor's JAX program itself: the same costs and state, bit for
    bit, and an exchange given to it sees the new state in the model's state order, and
    which arguments are the rank's own (the minibatch). An
    overlapped exchange ('during') sees the state the step starts from and the step's own
    program, and its averages correct the step's result: new + (average - old)."""
    pytest.importorskip("jax")
    jax_process("direct_jax_step_matches_pytensor_call")


def test_replica_corrects_the_part_it_averages(jax_process):
    """Replica.jax_step with an overlapped exchange of one part of the state: the exchange
    gets the values that part starts the step from, and only that part's new values take
    the correction (here a stand-in average: old + 1). The model's other values are the
    plain step's, bit for bit."""
    pytest.importorskip("jax")
    jax_process("replica_corrects_the_part_it_averages")


def test_replica_refuses_a_model_on_another_gpu(monkeypatch):
    # What Replica does when JAX put the model elsewhere: it names the rank and both GPUs.
    from pympgu import cuda
    monkeypatch.setattr(cuda, "pointer_device", lambda ptr: 0, raising=False)
    rep = replica.Replica.__new__(replica.Replica)
    rep.ctx = type("Ctx", (), {"rank": 1, "device": 1})()
    array = type("A", (), {"unsafe_buffer_pointer": lambda self: 4096})()
    with pytest.raises(RuntimeError, match=r"rank 1: JAX put the model on GPU 0, not on this "
                                           r"rank.s GPU 1"):
        rep._check_device(array)
    rep.ctx.device = 0
    rep._check_device(array)


@pytest.mark.parametrize("seen, device, picked", [
    ([0, 1], 1, 1),        # JAX sees every GPU: the one with this rank's CUDA ordinal
    ([0, 1, 2, 3], 2, 2),
    ([0], 3, 0),           # JAX sees this GPU alone, numbered 0 by its own count
    ([0, 1], 5, None),     # not there: an error naming the rank and the GPU
])
def test_jax_device_is_the_rank_gpu(seen, device, picked):
    dev = type("Dev", (), {"platform": "gpu"})
    devices = [dev() for _ in seen]
    for d, hw in zip(devices, seen):
        d.local_hardware_id = hw
    fake_jax = type("J", (), {"devices": staticmethod(lambda: devices)})
    ctx = type("Ctx", (), {"rank": 2, "device": device})()
    if picked is None:
        with pytest.raises(RuntimeError, match="rank 2: JAX has no device for GPU 5"):
            replica.jax_device(fake_jax, ctx)
    else:
        assert replica.jax_device(fake_jax, ctx).local_hardware_id == picked


def test_jax_without_cuda_is_named_with_its_remedy():
    cpu = type("Dev", (), {"platform": "cpu", "__repr__": lambda self: "CpuDevice(id=0)"})()
    fake_jax = type("J", (), {"devices": staticmethod(lambda: [cpu])})
    ctx = type("Ctx", (), {"rank": 1, "device": 0})()
    with pytest.raises(RuntimeError, match=r"rank 1: JAX sees no GPU \(its devices: "
                                           r"\[CpuDevice\(id=0\)\]\); install JAX for CUDA"):
        replica.jax_device(fake_jax, ctx)


# ---------------------------------------------------------------- your own model (--model)

EXAMPLE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                       "examples", "residual_mlp.py")


def test_your_own_model_trains_as_the_mlp_does(tmp_path, capsys):
    """examples/residual_mlp.py, given by --model, trains on 2 CPU workers: the run names
    it, learns, keeps the replicas identical (run() checks) and resumes from its checkpoint
    by its parameters' names."""
    out = str(tmp_path / "run")
    spec = f"{EXAMPLE}:ResidualMLP"
    argv = ["--cpu", "2", "--model", spec, "--hidden", "64", "64", "--quiet"]
    assert cli.main(argv + ["--epochs", "2", "--out", out]) == 0
    printed = capsys.readouterr().out
    assert "ResidualMLP (55,050 parameters)" in printed, printed
    lines = [json.loads(x) for x in open(os.path.join(out, "metrics.jsonl"))]
    assert lines[-1]["test_error"] < 0.3, lines  # chance is 0.9
    assert json.load(open(os.path.join(out, "config.json")))["model"] == spec
    with np.load(os.path.join(out, ckpt.CHECKPOINT)) as f:
        assert {"W_in", "W_block0", "v_W_out"} <= set(f.files), f.files
    assert cli.main(argv + ["--epochs", "3", "--resume", out]) == 0
    assert "epoch   3" in capsys.readouterr().out
    # The MLP's checkpoint is not this model's: refused before any worker starts, naming
    # the array it lacks and the model that made it.
    mlp = str(tmp_path / "mlp")
    train(config(epochs=1, hidden=[16], out=mlp), quiet=True)
    with pytest.raises(SystemExit) as info:
        cli.main(argv + ["--epochs", "2", "--resume", mlp])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert (f"--resume {os.path.join(mlp, ckpt.CHECKPOINT)}: cannot resume from it: it has "
            "no 'W_in' (it holds MLP 784-16-10, trained by sgd; this run builds ResidualMLP "
            "(55,050 parameters), trained by sgd)") in err, err


@pytest.mark.parametrize("example,hidden,described", [
    ("lenet.py:LeNet", ["--hidden", "8", "16", "64"],
     "LeNet 1x28x28, filters 8-16, 64 units (20,522 parameters)"),
    # No --hidden: the class's default_hidden, two stages of 32 and 64 channels.
    ("strided.py:StridedConvNet", [],
     "StridedConvNet 1x28x28, channels 32-64, 7x7 maps (96,362 parameters)")])
def test_a_convnet_trains_on_cpu_jax(tmp_path, capfd, example, hidden, described):
    """examples/lenet.py (pympgu.nnet's conv2d and max_pool_2d) and examples/strided.py
    (conv2d's padding and stride 2) on 2 CPU workers under the JAX backend, the programs
    GPU workers compile: the run names the model and learns, and run() checks that the
    replicas end identical; the workers do not repeat JAX's warning about PyTensor's
    float64 accumulators. (tests/test_nnet.py checks the layers against numpy, which the C
    backend runs.)"""
    pytest.importorskip("jax")
    path = os.path.join(os.path.dirname(EXAMPLE), example)
    argv = ["--cpu", "2", "--backend", "jax", "--model", path, *hidden, "--epochs", "1",
            "--out", str(tmp_path), "--quiet"]
    assert cli.main(argv) == 0
    out, err = capfd.readouterr()
    assert described in out, out
    assert "Explicitly requested dtype" not in err, err[-2000:]
    lines = [json.loads(x) for x in open(tmp_path / "metrics.jsonl")]
    assert lines[-1]["test_error"] < 0.3, lines  # chance is 0.9


def test_config_keeps_the_models_file_and_the_data_by_absolute_path(tmp_path, monkeypatch):
    """config.json's --model file and --data-dir are absolute, so that pympgu.evaluate and
    --resume find them from any directory; names ('fashion') and modules stay as given."""
    parser = cli.build_parser()
    (tmp_path / "d.npz").write_bytes(b"")
    monkeypatch.chdir(tmp_path)
    relative = os.path.relpath(EXAMPLE)
    cfg = cli.resolve(parser.parse_args(["--cpu", "2", "--model", f"{relative}:ResidualMLP",
                                           "--data-dir", "d.npz"]), parser).cfg
    assert cfg.model == f"{EXAMPLE}:ResidualMLP" and cfg.data == str(tmp_path / "d.npz")
    cfg = cli.resolve(parser.parse_args(["--cpu", "2", "--model", "pympgu.models:MLP",
                                           "--data-dir", "digits"]), parser).cfg
    assert (cfg.model, cfg.data) == ("pympgu.models:MLP", "digits")


def test_hidden_defaults_to_the_models_own():
    """Without --hidden a model of one's own gets its class's default_hidden (a convnet's
    channels are not the MLP's 500 units); --hidden and a preset's widths still win, and a
    --model that cannot be loaded is named by the parser."""
    parser = cli.build_parser()
    strided = os.path.join(os.path.dirname(EXAMPLE), "strided.py:StridedConvNet")

    def hidden(*argv):
        return list(cli.resolve(parser.parse_args(["--cpu", "2", *argv]), parser).cfg.hidden)
    assert hidden() == [500] and hidden("--model", f"{EXAMPLE}:ResidualMLP") == [500]
    assert hidden("--model", strided) == [32, 64]
    assert hidden("--model", strided, "--hidden", "8") == [8]
    assert hidden("--model", strided, "--preset", "dual_mlp") == [500]
    with pytest.raises(SystemExit):
        hidden("--model", "nowhere.py:Net")


BAD_MODELS = '''
import numpy as np
from pympgu.models import Model


class Unseeded(Model):  # each worker draws its own values
    def __init__(self, n_in, hidden, n_out, seed=0):
        super().__init__()
        self.w = self.parameter(np.random.default_rng().normal(size=(n_in, n_out)), "W")
        self.b = self.parameter(np.zeros(n_out), "b", penalized=False)

    def logits(self, x):
        return x.dot(self.w) + self.b


class NotAModel:
    pass


class NoSuper(Model):
    def __init__(self, n_in, hidden, n_out, seed=0):
        self.parameter(np.zeros(3), "w")


class Broken(Model):
    def __init__(self, n_in, hidden, n_out, seed=0):
        super().__init__()
        raise RuntimeError("boom")


class WrongScores(Model):
    def __init__(self, n_in, hidden, n_out, seed=0):
        super().__init__()
        self.w = self.parameter(np.zeros((n_in, n_out + 1)), "W")

    def logits(self, x):
        return x.dot(self.w)

'''


@pytest.mark.parametrize("name,message", [
    ("NotAModel", "NotAModel is not a subclass of pympgu.models.Model"),
    ("NoSuper", "must call Model.__init__ (super().__init__())"),
    ("Broken", "Broken(n_in=784, hidden=[500], n_out=10, seed=1234) failed: RuntimeError: boom"),
    ("Missing", "has no 'Missing'"),
])
def test_a_model_that_cannot_be_built_is_a_flag_error(tmp_path, capsys, name, message):
    path = tmp_path / "models.py"
    path.write_text(BAD_MODELS)
    with pytest.raises(SystemExit) as info:
        cli.main(["--cpu", "2", "--epochs", "1", "--model", f"{path}:{name}"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert f"--model {path}:{name}: " in err and message in err, err
    assert "Traceback" not in err


@pytest.mark.parametrize("spec,message", [
    ("nocolon", "give FILE.py:CLASS or MODULE:CLASS"),
    ("/nonexistent/m.py:Net", "no such file /nonexistent/m.py"),
    ("pympgu_no_such_module:Net", "loading pympgu_no_such_module failed: ModuleNotFoundError"),
])
def test_cli_rejects_a_model_it_cannot_find(spec, message, capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["--cpu", "2", "--model", spec])
    assert info.value.code == 2
    assert f"--model {spec}: {message}" in capsys.readouterr().err


def test_a_model_whose_module_fails_to_import_is_named(tmp_path, capsys):
    path = tmp_path / "broken.py"
    path.write_text("import numpy\nraise ImportError('needs a package this machine lacks')\n")
    with pytest.raises(SystemExit):
        cli.main(["--cpu", "2", "--model", f"{path}:Net"])
    assert (f"loading {path} failed: ImportError: needs a package this machine lacks"
            in capsys.readouterr().err)


def test_replicas_that_start_differently_are_refused(tmp_path):
    """A model drawing its values elsewhere than from its seed would start each worker from
    another point; the first exchange would average them into a model none of them is. The
    run fails before any step, naming the rank and the arrays that differ."""
    from pympgu.runtime import WorkerFailed
    path = tmp_path / "models.py"
    path.write_text(BAD_MODELS)
    with pytest.raises(WorkerFailed, match="rank 1 differs from rank 0 in its initial values") \
            as info:
        train(config(epochs=1, model=f"{path}:Unseeded"), quiet=True)
    rank0, rank1 = info.value.details.splitlines()
    assert rank0.startswith("rank 0: W ") and rank1.startswith("rank 1: W ")
    # Only W was drawn: b and the momentum start at zero on both ranks.
    assert rank0.split(", ")[1:] == rank1.split(", ")[1:], (rank0, rank1)


def test_logits_of_the_wrong_shape_are_named(tmp_path):
    from pympgu import models
    path = tmp_path / "models.py"
    path.write_text(BAD_MODELS)
    ds = data.load()
    m = models.build(f"{path}:WrongScores", ds.n_in, [8], ds.n_classes)
    with pytest.raises(ValueError, match=r"WrongScores.logits gives shape \(64, 11\) for a "
                                         r"batch of 64; it must be \(64, 10\)"):
        m.compile(ds, 64, 100, 0.1, 0.9, 0.0, 0.0, "FAST_RUN")


def test_model_parameters_are_checked():
    from pympgu import models
    m = models.Model()
    m.parameter(np.ones((2, 3), np.float64), "W")
    assert m.params[0].get_value().dtype == np.float32 and m.weights == m.params
    m.parameter(np.zeros(3), "b", penalized=False)
    # Names that an optimizer's state takes, either way round, are refused at once.
    for value, name, message in [(np.zeros(2), "W", "taken"), (np.zeros(2), "v_W", "taken"),
                                 (np.zeros(2), "s_b", "taken"), (np.zeros(2), "W_", None),
                                 (np.zeros(2), "m", None), (np.zeros(2), "q_", None),
                                 (np.zeros(2), "s_q_", "taken"),
                                 (np.zeros(2), "__epoch__", "reserved"),
                                 (np.zeros(2, np.int32), "i", "give a float array"),
                                 (np.float32(1), "x", "at least one dimension")]:
        if message is None:
            m.parameter(value, name)
        else:
            with pytest.raises(ValueError, match=message):
                m.parameter(value, name)
    m.set_optimizer("adam")
    assert [s.name for s in m.state] == ["W", "b", "W_", "m", "q_", "m_W", "m_b", "m_W_", "m_m",
                                         "m_q_", "s_W", "s_b", "s_W_", "s_m", "s_q_"]
    assert len(m.weights) == 4 and not m.affine_update
    with pytest.raises(TypeError, match="before the model's state is used"):
        m.parameter(np.zeros(2), "late")
    with pytest.raises(TypeError, match="call it first"):
        m.set_optimizer("sgd")
    with pytest.raises(NotImplementedError, match="must define logits"):
        m.logits(None)
    # The MLP's state, names and order are what its checkpoints hold.
    mlp = models.MLP(784, [32], 10)
    assert [s.name for s in mlp.state] == ["W0", "b0", "W1", "b1", "v_W0", "v_b0", "v_W1",
                                           "v_b1"]
    assert mlp.weights == [mlp.params[0], mlp.params[2]] and mlp.describe() == "MLP 784-32-10"


def test_gpus_without_a_cuda_jax_is_a_flag_error_before_any_worker(monkeypatch, capsys):
    """Where CUDA works but JAX has no CUDA backend installed, --gpus is refused with the
    command that fixes it, before any worker starts (each would fail on its own); found
    without importing JAX, which would take a context on every GPU."""
    import importlib.util

    from pympgu import cuda
    monkeypatch.setattr(cuda, "availability", lambda: (True, 2))
    find_spec = importlib.util.find_spec

    def hidden(name, *a):
        if "cuda" in name:
            return None
        return find_spec(name, *a)
    monkeypatch.setattr(importlib.util, "find_spec", hidden)
    with pytest.raises(SystemExit) as info:
        cli.main(["--gpus", "0", "1"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert 'JAX is installed without CUDA; pip install "jax[cuda13]"' in err, err
    assert "--cpu N" in err
    parser = cli.build_parser()
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: object() if name in ("jax", "jax_cuda13_plugin") else None)
    resolved = cli.resolve(parser.parse_args(["--gpus", "0", "1"]), parser)
    cfg, note = resolved.cfg, resolved.note
    assert cfg.devices == (0, 1) and cfg.backend == "jax" and note is None


# ---------------------------------------------------------------- stops, damage, resumes

def test_resume_dir_writes_into_it_and_its_log_goes_on_from_the_epoch_resumed(tmp_path,
                                                                               capsys):
    """--resume DIR without --out writes into DIR: its checkpoint and metrics.jsonl go on
    (from best.npz, the log's later epochs are replaced, not repeated)."""
    out = str(tmp_path / "run")
    argv = ["--cpu", "2", "--hidden", "16", "--backend", "c"]
    assert cli.main(argv + ["--epochs", "2", "--out", out]) == 0
    epochs = lambda: [json.loads(x)["epoch"] for x in open(os.path.join(out, ckpt.METRICS))]  # noqa: E731
    assert cli.main(argv + ["--epochs", "4", "--resume", out]) == 0
    assert f"goes on writing into {out}" in capsys.readouterr().err
    assert epochs() == [1, 2, 3, 4] and ckpt.epoch_of(os.path.join(out, ckpt.CHECKPOINT)) == 4
    best = ckpt.epoch_of(os.path.join(out, ckpt.BEST))
    assert cli.main(argv + ["--epochs", "5", "--resume", os.path.join(out, ckpt.BEST)]) == 0
    assert epochs() == list(range(1, best + 1)) + list(range(best + 1, 6))


@pytest.mark.parametrize("damage", ["truncated", "empty", "bit flipped"])
def test_a_damaged_checkpoint_is_named_with_its_intact_sibling(tmp_path, capsys, damage):
    out = tmp_path / "run"
    train(config(epochs=2, hidden=[16], out=str(out)), quiet=True)
    path = out / ckpt.CHECKPOINT
    raw = bytearray(path.read_bytes())
    if damage == "truncated":
        raw = raw[:len(raw) // 2]
    elif damage == "empty":
        raw = b""
    else:
        raw[len(raw) // 2] ^= 0x10
    path.write_bytes(bytes(raw))
    best = ckpt.epoch_of(str(out / ckpt.BEST))
    with pytest.raises(SystemExit) as info:
        cli.main(["--cpu", "2", "--hidden", "16", "--epochs", "3", "--resume", str(out)])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert f"--resume {path}: cannot resume from it: it is damaged (" in err, err
    assert f"{out / ckpt.BEST} is intact (epoch {best}): --resume {out / ckpt.BEST}" in err
    assert "Traceback" not in err
    (out / ckpt.BEST).write_bytes(b"")  # both damaged: nothing to suggest
    with pytest.raises(SystemExit):
        cli.main(["--cpu", "2", "--hidden", "16", "--epochs", "3", "--resume", str(out)])
    err = capsys.readouterr().err
    assert "it is damaged" in err and "intact" not in err, err


def test_a_diverging_run_stops_at_its_first_non_finite_loss(tmp_path, capsys):
    out = tmp_path / "run"
    argv = ["--cpu", "2", "--hidden", "16", "--quiet", "--out", str(out)]
    assert cli.main(argv + ["--epochs", "1"]) == 0
    kept = (out / ckpt.CHECKPOINT).read_bytes()
    capsys.readouterr()
    assert cli.main(argv + ["--epochs", "4", "--lr", "1e30", "--resume", str(out)]) == 1
    captured = capsys.readouterr()
    assert "the training loss was nan in epoch 2: the run diverged and stopped there" \
        in captured.err, captured.err
    assert "epoch   2" not in captured.out and "done in" not in captured.out
    assert (out / ckpt.CHECKPOINT).read_bytes() == kept  # epoch 1's, the last good one
    assert f"{out / ckpt.CHECKPOINT} keeps epoch 1, the last good one" in captured.err
    assert [json.loads(x)["epoch"] for x in open(out / ckpt.METRICS)] == [1]


def test_a_run_says_what_it_does_before_its_first_epoch(capsys):
    assert cli.main(["--cpu", "2", "--hidden", "16", "--epochs", "1"]) == 0
    err = capsys.readouterr().err
    stages = [line for line in err.splitlines() if line.startswith("pympgu: ") and " s: " in line]
    assert [line.split(" s: ", 1)[1] for line in stages] == [
        "building the model and compiling its step", "connecting the workers' exchange",
        "training from epoch 1 (its first steps compile)"], err


def test_without_jax_the_run_says_which_backend_runs_and_why(monkeypatch):
    import importlib.util
    find = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "jax" else find(name, *a))
    parser = cli.build_parser()
    resolved = cli.resolve(parser.parse_args(["--cpu", "2"]), parser)
    cfg, note = resolved.cfg, resolved.note
    assert cfg.backend == "c"
    assert "JAX is not installed, so the CPU workers run PyTensor's C backend" in note
    assert "pip install jax" in note


def test_sigterm_stops_a_run_as_ctrl_c_does(tmp_path):
    """A scheduler's SIGTERM (Slurm's, at a job's end): every worker stopped, the status a
    SIGTERM gives (143), and the line that says how to resume."""
    out = tmp_path / "run"
    proc = start([sys.executable, "-m", "pympgu.train", "--cpu", "2", "--epochs", "500",
                  "--hidden", "16", "--quiet", "--out", str(out)])
    try:
        wait_until(lambda: ckpt.epoch_of(str(out / ckpt.CHECKPOINT)) is not None, 120, every=0.2)
        os.kill(proc.pid, signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        kill_session(proc)
    assert proc.returncode == 143, err
    assert "stopped by SIGTERM; every worker was stopped" in err
    assert f"continue with --resume {out}" in err
    assert "Traceback" not in err
    assert wait_until(lambda: not session_left(proc.pid), 10, every=0.2), \
        f"outlived the run: {session_left(proc.pid)}"
