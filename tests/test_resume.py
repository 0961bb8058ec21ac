"""A resumed run: the settings of the run it continues, the flags given in their place and
said; its log whole whatever stopped the run; the starting weights' own seed."""
import json
import os

import pytest

from pympgu.training import checkpoint as ckpt
from pympgu.training import cli
from pympgu.training.outdir import OutDir

pytestmark = pytest.mark.timeout(600)

# The 2014 seed's run, made quick: one step an epoch.
SEED_RUN = ["--cpu", "2", "--preset", "dual_mlp", "--batch-size", "4000", "--hidden", "32",
            "--quiet"]


def _lines(out):
    return [json.loads(x) for x in open(os.path.join(out, ckpt.METRICS))]


def _learning(out):
    """What the run learnt, epoch by epoch (not how fast)."""
    return [(x["epoch"], x["lr"], x["loss"], x["valid_error"]) for x in _lines(out)]


def _config(out):
    return json.load(open(os.path.join(out, ckpt.CONFIG)))


def test_a_resumed_run_takes_its_runs_settings_and_says_what_flags_change(tmp_path, capsys):
    whole, out = str(tmp_path / "whole"), str(tmp_path / "run")
    assert cli.main(SEED_RUN + ["--epochs", "4", "--out", whole]) == 0
    assert cli.main(SEED_RUN + ["--epochs", "2", "--out", out]) == 0
    capsys.readouterr()
    # No flag but --epochs: lr 0.13, batch 4000 and 32 units go on, as the losses show.
    assert cli.main(["--resume", out, "--epochs", "3"]) == 0
    err = capsys.readouterr().err
    assert (f"--resume {out}: the run goes on with the settings of its config.json; epochs "
            "2 -> 3 (given)") in err, err
    config = _config(out)
    assert (config["lr"], config["batch_size"], config["hidden"]) == (0.13, 4000, [32])
    assert config["changes"] == [{"epoch": 2, "changed": {"epochs": [2, 3]}}]
    assert _learning(out) == _learning(whole)[:3]
    # A flag given changes its setting, and says so; config.json keeps every change.
    assert cli.main(["--resume", out, "--epochs", "4", "--lr", "0.05"]) == 0
    assert "epochs 3 -> 4 (given), lr 0.13 -> 0.05 (given)" in capsys.readouterr().err
    config = _config(out)
    assert config["lr"] == 0.05
    assert config["changes"][1] == {"epoch": 3, "changed": {"epochs": [3, 4], "lr": [0.13, 0.05]}}
    assert [x["epoch"] for x in _lines(out)] == [1, 2, 3, 4]
    assert _learning(out)[3] != _learning(whole)[3]
    # A run that has trained its epochs is told how to train on.
    with pytest.raises(SystemExit) as info:
        cli.main(["--resume", out])
    assert info.value.code == 2
    assert "the run has trained its 4 epochs; give --epochs N (above 4)" in \
        capsys.readouterr().err


def test_an_epochs_line_lost_to_a_stop_comes_back_from_its_checkpoint(tmp_path, capsys):
    """A stop between an epoch's checkpoint and its line in metrics.jsonl (the launcher
    stopped before it read the line): the run's end, or its resume, writes the line from
    the checkpoint, exactly as it was; a line past the checkpoint goes."""
    out = str(tmp_path / "run")
    assert cli.main(SEED_RUN + ["--epochs", "3", "--out", out]) == 0
    path = os.path.join(out, ckpt.METRICS)
    lines = open(path).readlines()
    open(path, "w").writelines(lines[:2] + ['{"epoch": 3, "loss": 0.1, "cut by a cr'])
    with OutDir(out, create=False) as d:
        ckpt.sync_metrics(d)
    assert open(path).readlines() == lines
    open(path, "w").writelines(lines[:1])
    assert cli.main(["--resume", out, "--epochs", "4", "--quiet"]) == 0
    assert open(path).readlines()[:3] == lines
    assert [x["epoch"] for x in _lines(out)] == [1, 2, 3, 4]


def test_init_seed_draws_other_starting_weights_and_seed_another_order(tmp_path):
    """--init-seed (1234 by default, the 2014 demo's) draws the starting weights, --seed the
    minibatches: each changes the run, and each alone."""
    def first_epoch(*flags):
        out = str(tmp_path / "-".join(flags or ("default",)))
        assert cli.main(SEED_RUN + ["--batch-size", "500", "--epochs", "1", "--out", out,
                                    *flags]) == 0
        line = _lines(out)[0]
        return (line["loss"], line["valid_error"]), _config(out)["init_seed"]
    default, seed = first_epoch()
    assert seed == 1234 and first_epoch("--init-seed", "1234") == (default, 1234)
    other, seed = first_epoch("--init-seed", "7")
    assert seed == 7 and other != default
    assert first_epoch("--seed", "7")[0] not in (default, other)


def test_a_lost_workers_record_stays_in_the_log_before_its_epochs_line(tmp_path):
    """metrics.jsonl's events (a worker lost, the others going on) are what happened: the
    log's mending keeps them, before the line of the epoch they came in."""
    out = str(tmp_path / "run")
    assert cli.main(SEED_RUN + ["--epochs", "2", "--out", out]) == 0
    path = os.path.join(out, ckpt.METRICS)
    lines = open(path).readlines()
    event = json.dumps({"event": "membership", "epoch": 2, "lost": [1]}) + "\n"
    open(path, "w").writelines([lines[0], event, lines[1], '{"epoch": 3, "loss": 0.1}\n'])
    with OutDir(out, create=False) as d:
        ckpt.sync_metrics(d)
    assert open(path).readlines() == [lines[0], event, lines[1]]
