"""pympgu.train's flags: refusals in one line naming the flag, defaults, --help."""
import io
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from pympgu.training import checkpoint as ckpt
from pympgu.training import cli, launcher
from pympgu.training.report import Reporter

pytestmark = pytest.mark.timeout(600)


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
    (["--cpu", "3", "--min-workers", "4"], "--min-workers must be 1 to the 3 workers, got 4"),
    (["--cpu", "3", "--min-workers", "0"], "--min-workers must be 1 to the 3 workers, got 0"),
    (["--cpu", "3", "--min-workers", "2", "--overlap"],
     "--min-workers needs replicas identical after each exchange"),
    (["--cpu", "3", "--restart-workers", "2"], "give --min-workers below the 3 workers too"),
    (["--cpu", "3", "--min-workers", "2", "--restart-workers", "-1"],
     "--restart-workers must be 0 or more, got -1"),
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
    """The road of the step's exchange (pympgu.training.loop.road) is printed after the first
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
