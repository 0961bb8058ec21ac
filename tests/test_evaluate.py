"""python -m pympgu.evaluate: a finished run's checkpoints give back the errors training
printed, class by class; predict gives probabilities; a bad run or checkpoint is named."""
import json
import os
import shutil

import numpy as np
import pytest

from pympgu import data, evaluate
from pympgu.training import checkpoint as ckpt
from pympgu.training import cli

pytestmark = pytest.mark.timeout(300)

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """An MLP trained for 2 epochs on 2 CPU workers, its --out directory. Trained with
    dropout, which evaluation, here as in training, must not apply."""
    out = str(tmp_path_factory.mktemp("run"))
    assert cli.main(["--cpu", "2", "--hidden", "32", "--epochs", "2", "--dropout", "0.2",
                       "--out", out, "--quiet"]) == 0
    return out


def metrics(out):
    return [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]


def test_the_best_checkpoint_gives_the_test_error_training_printed(run_dir, capsys):
    """best.npz on the test split: the test error of the epoch of least validation error,
    exactly (the test images fall into the same batches of 500 as in training, whose
    evaluation batches run through the validation split's 1,000 first); the per-class
    counts add up, and the confusion matrix's diagonal is what is right."""
    lines = metrics(run_dir)
    best = min(lines, key=lambda h: h["valid_error"])
    assert evaluate.main([run_dir, "--json", os.path.join(run_dir, "eval.json")]) == 0
    out = capsys.readouterr().out
    report = json.load(open(os.path.join(run_dir, "eval.json")))
    assert report["epoch"] == best["epoch"] and report["error"] == pytest.approx(best["test_error"])
    assert f"test error {100 * best['test_error']:.2f}% ({report['wrong']} of 1,000)" in out, out
    assert "MLP 784-32-10 after epoch" in out and "confusion (rows: true class" in out
    confusion = np.array(report["confusion"])
    assert confusion.sum() == 1000 and confusion.trace() == 1000 - report["wrong"]
    assert [c["examples"] for c in report["classes"]] == list(confusion.sum(axis=1))
    assert report["top5_wrong"] <= report["wrong"] and "top-5" not in out  # ten classes


def test_many_classes_get_their_top5_error_and_their_worst_ten(tmp_path, capsys):
    """A dataset of 30 classes (an .npz of Gaussian blobs): the report gives the top-5
    error, the true class not among the five likeliest, counted here from predict's
    probabilities, and lists the ten classes of most error rather than all 30."""
    rng = np.random.default_rng(1)
    centers = rng.normal(0, 1.0, (30, 16))
    y, yt = rng.integers(0, 30, 3000), rng.integers(0, 30, 600)
    x, xt = (centers[v] + rng.normal(0, 1, (len(v), 16)) for v in (y, yt))
    path, out = tmp_path / "blobs.npz", str(tmp_path / "run")
    np.savez(path, x_train=x, y_train=y, x_test=xt, y_test=yt)
    assert cli.main(["--cpu", "2", "--data-dir", str(path), "--hidden", "32", "--epochs",
                       "1", "--out", out, "--quiet"]) == 0
    capsys.readouterr()
    run = evaluate.load(out, backend="c")
    report = run.evaluate("test")
    five = np.argsort(-run.predict(xt), axis=1, kind="stable")[:, :5]
    wrong5 = int(sum(t not in row for t, row in zip(yt, five)))
    assert report["top5_wrong"] == wrong5 < report["wrong"]
    assert evaluate.main([out]) == 0
    text = capsys.readouterr().out
    assert f"top-5 error {100 * wrong5 / 600:.2f}% ({wrong5} of 600)" in text, text
    assert "the ten classes of most error:" in text


def test_a_report_names_the_classes_where_the_data_does(run_dir, capsys):
    """Fashion-MNIST's classes by name (its IDX files hold numbers only), in the table and
    in what each is taken for; the MNIST model evaluated on other data of its shape."""
    if not os.path.isdir(data.FASHION_DIR):
        pytest.skip(f"{data.FASHION_DIR}: apt-get install dataset-fashion-mnist")
    assert evaluate.main([run_dir, "--data-dir", "fashion"]) == 0
    out = capsys.readouterr().out
    assert "fashion-mnist, test split (10,000 examples)" in out
    rows = [line.split() for line in out.splitlines() if line.startswith("  9 Ankle boot")]
    assert len(rows) == 1 and rows[0][3] == "1,000", out


def test_last_checkpoint_and_the_validation_split(run_dir):
    """checkpoint.npz on either split, by PyTensor's own backend (what runs without JAX):
    the errors training printed for the last epoch."""
    last = metrics(run_dir)[-1]
    run = evaluate.load(run_dir, checkpoint="last", backend="c")
    assert run.epoch == last["epoch"]
    assert run.evaluate("valid")["error"] == pytest.approx(last["valid_error"])
    assert run.evaluate("test")["error"] == pytest.approx(last["test_error"])


def test_predict_gives_each_examples_class_probabilities(run_dir):
    run = evaluate.load(run_dir)
    x, y = run.dataset.test
    p = run.predict(x[:7].reshape(7, 28, 28))  # any shape that flattens to the inputs
    assert p.shape == (7, 10) and np.allclose(p.sum(axis=1), 1, atol=1e-5)
    assert np.array_equal(run.predict(x)[:7].argmax(axis=1), p.argmax(axis=1))
    assert run.predict(x[:0]).shape == (0, 10)
    with pytest.raises(ValueError, match="the model takes 784 values an example"):
        run.predict(np.zeros((2, 64)))


def test_a_convnet_run_is_evaluated_in_padded_batches(tmp_path):
    """A convnet's graph needs a static batch under JAX: the last, short batch is padded,
    and the error is training's (the same to the example here, in batches of another
    size)."""
    pytest.importorskip("jax")
    out = str(tmp_path)
    assert cli.main(["--cpu", "2", "--backend", "jax", "--model",
                       f"{EXAMPLES}/strided.py:StridedConvNet", "--hidden", "4", "8",
                       "--epochs", "1", "--out", out, "--quiet"]) == 0
    run = evaluate.load(out, backend="jax", batch_size=300)  # 1,000 = 3 x 300 + 100
    assert run.evaluate("test")["error"] == pytest.approx(metrics(out)[-1]["test_error"])


def test_bad_runs_are_named(run_dir, tmp_path, capsys):
    with pytest.raises(evaluate.EvaluateError, match="nowhere: no such run directory"):
        evaluate.load(str(tmp_path / "nowhere"))
    bare = tmp_path / "bare"
    bare.mkdir()
    with pytest.raises(evaluate.EvaluateError, match="bare: not a run directory "
                                                     r"\(no config.json"):
        evaluate.load(str(bare))
    shutil.copy(os.path.join(run_dir, ckpt.CHECKPOINT), bare)
    with pytest.raises(evaluate.EvaluateError, match="config.json: no such file"):
        evaluate.load(str(bare / ckpt.CHECKPOINT))
    config = json.load(open(os.path.join(run_dir, "config.json")))
    json.dump(config, open(bare / "config.json", "w"))
    with pytest.raises(evaluate.EvaluateError, match=r"\(the run has checkpoint.npz\)"):
        evaluate.load(str(bare))
    started = tmp_path / "started"  # a run that wrote its config.json, then stopped
    started.mkdir()
    json.dump(config, open(started / "config.json", "w"))
    with pytest.raises(evaluate.EvaluateError, match="best.npz: no such checkpoint "
                                                     r"\(the run finished no epoch\)"):
        evaluate.load(str(started))
    # Another model's widths in config.json: the checkpoint does not fit, and says so.
    json.dump(dict(config, hidden=[16]), open(bare / "config.json", "w"))
    with pytest.raises(evaluate.EvaluateError, match=r"checkpoint.npz: cannot evaluate it: "
                                                     r".* is \(784, 32\), this model's is"):
        evaluate.load(str(bare), checkpoint="last")
    json.dump(dict(config, model="/moved/net.py:Net"), open(bare / "config.json", "w"))
    with pytest.raises(evaluate.EvaluateError, match=r"config.json: its model cannot be built "
                                                     r"\(--model /moved/net.py:Net: no such file"):
        evaluate.load(str(bare), checkpoint="last")
    with pytest.raises(SystemExit):  # the CLI: a parser error naming it
        evaluate.main([str(bare), "--checkpoint", "last", "--data-dir",
                       str(tmp_path / "missing.npz")])
    assert "missing.npz: no such file" in capsys.readouterr().err
