"""The training step's noise: --dropout (Model.dropout's masks), --flip and --shift
(pympgu.nnet.augment), each rank's own draws, and runs that resume to the same numbers, on
CPU workers (the GPU's runs are in test_gpu_runtime)."""
import os

import numpy as np
import pytest

from pympgu import models
from pympgu.training import checkpoint as ckpt
from pympgu.training import cli
from pympgu.training.launcher import run as train
from test_train import config

pytestmark = pytest.mark.timeout(600)


class Dropped(models.Model):
    """Logits that are the input dropped: what Model.dropout does, alone."""

    def __init__(self, n_in, hidden, n_out, seed=1234):
        super().__init__()
        self.parameter(np.zeros(1), "unused")

    def logits(self, x):
        return self.dropout(x)


def draws(rate, calls):
    """Model.dropout on a batch of ones in the training graph, ``calls`` times, and the
    evaluation graph's output."""
    import pytensor
    import pytensor.tensor as pt
    m = Dropped(0, [], 0)
    m.dropout_rate = rate
    x = pt.tensor("x", dtype="float32", shape=(200, 300))
    train_fn = pytensor.function([x], m.training_logits(x), updates=m.noise_updates)
    ones = np.ones((200, 300), np.float32)
    out = [np.asarray(train_fn(ones)) for _ in range(calls)]
    return out, np.asarray(pytensor.function([x], m.logits(x))(ones)), m


def test_dropout_zeroes_at_its_rate_and_scales_the_rest_only_in_training():
    out, evaluated, m = draws(0.25, 2)
    for o in out:
        assert set(np.unique(o)) == {0.0, np.float32(1 / 0.75)}
        assert abs((o == 0).mean() - 0.25) < 0.01, (o == 0).mean()  # 60,000 draws
    assert not np.array_equal(out[0], out[1])  # the generator moves on at every step
    assert np.array_equal(evaluated, np.ones((200, 300)))  # evaluation drops nothing
    assert len(m.noise_updates) == 1


def test_no_dropout_draws_nothing():
    out, _, m = draws(0.0, 1)
    assert np.array_equal(out[0], np.ones((200, 300))) and m.noise_updates == []
    with pytest.raises(ValueError, match=r"dropout rate must be in \[0, 1\), got 1.0"):
        Dropped(0, [], 0).dropout(None, 1.0)


class Linear(models.Model):
    def __init__(self, n_in, hidden, n_out, seed=1234):
        super().__init__()
        self.w = self.parameter(np.zeros((n_in, n_out)), "w")

    def logits(self, x):
        return x.dot(self.w)


def test_a_model_without_dropout_refuses_a_rate(capsys):
    import pytensor.tensor as pt
    m = models.build(f"{__name__}:Linear", 4, [1], 3, dropout=0.5)
    with pytest.raises(models.FlagError, match=r"--dropout 0.5: Linear.logits has no dropout"):
        m.training_logits(pt.tensor("x", dtype="float32", shape=(2, 4)))
    # From the command line it is a flag error, before any worker starts.
    with pytest.raises(SystemExit) as info:
        cli.main(["--cpu", "2", "--dropout", "0.5", "--model", f"{__file__}:Linear"])
    assert info.value.code == 2
    assert "--dropout 0.5: Linear.logits has no dropout" in capsys.readouterr().err


def test_cli_rejects_a_rate_out_of_range(capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["--cpu", "2", "--dropout", "1"])
    assert info.value.code == 2
    assert "--dropout must be in [0, 1), got 1.0" in capsys.readouterr().err


@pytest.mark.parametrize("backend", ["c", "jax"])
@pytest.mark.parametrize("dropout", [0.5, 0.0])
def test_each_rank_and_epoch_draws_its_own_masks(jax_process, backend, dropout):
    if backend == "jax":
        pytest.importorskip("jax")
    jax_process("noise_costs", backend, dropout)


@pytest.mark.parametrize("backend", ["c", "jax"])
@pytest.mark.parametrize("noise, says", [(dict(dropout=0.5), "dropout 0.5"),
                                         (dict(flip=True, shift=2), "flipped, shifted by 2")])
def test_a_run_with_noise_resumes_to_the_same_numbers(tmp_path, backend, noise, says, capsys):
    """2 CPU workers with --dropout 0.5, or --flip --shift 2: stopped after the first epoch
    and resumed, the run draws what the run that never stopped drew, to the same numbers;
    the replicas end identical (run() checks); the noise changed the run, and its first
    line says so."""
    if backend == "jax":
        pytest.importorskip("jax")
    opts = dict(noise, backend=backend, hidden=[64])
    whole = train(config(epochs=2, **opts), quiet=True)
    assert f"sgd, lr 0.05 constant, {says} |" in capsys.readouterr().out
    out = str(tmp_path / "run")
    train(config(epochs=1, out=out, **opts), quiet=True)
    resumed = train(config(epochs=2, resume=os.path.join(out, ckpt.CHECKPOINT), **opts), quiet=True)
    keys = ("loss", "valid_error", "test_error")
    assert [[h[k] for k in keys] for h in resumed] == [[h[k] for k in keys] for h in whole]
    plain = train(config(epochs=1, backend=backend, hidden=[64]), quiet=True)
    assert plain[0]["loss"] != whole[0]["loss"]
    # It learns (chance is 0.9; mirrored digits make MNIST harder: 27% after 2 epochs).
    assert whole[-1]["test_error"] < 0.4, whole


def test_jax_step_hands_the_exchange_the_noise_as_a_ranks_own_input(jax_process):
    """JaxStep on a step that draws: the exchange sees a program of arrays, the key's among
    the rank's own inputs (local), the state at its positions in the state's order; and
    the step computes what PyTensor's own call does, bit for bit."""
    pytest.importorskip("jax")
    jax_process("noise_is_a_ranks_own_input")


@pytest.mark.parametrize("mode", ["FAST_RUN", "JAX"])
def test_augment_flips_and_shifts_each_image_its_own_way(jax_process, mode):
    """pympgu.nnet.augment on both backends: each image mirrored where its number is under
    1/2, then cut from its copy padded by the shift at its own offsets (what numpy's pad and
    slice give, exactly)."""
    if mode == "JAX":
        pytest.importorskip("jax")
    jax_process("augment_flips_and_shifts", mode)


def test_augment_refuses_what_it_cannot_vary(capsys):
    import pytensor.tensor as pt
    from pympgu.nnet import augment
    with pytest.raises(ValueError, match="4-d with static sizes"):
        augment(pt.tensor("x", dtype="float32", shape=(4, None, 8, 8)), shift=1)
    with pytest.raises(ValueError, match="a shift of 1 to 7 pixels with its offsets, got 8"):
        augment(pt.tensor("x", dtype="float32", shape=(4, 1, 8, 8)), shift=8,
                offsets=pt.matrix("o"))
    # Data that are not images, and a shift as wide as the image, name the flag.
    m = models.build(None, 5, [4], 3, flip=True)
    with pytest.raises(models.FlagError, match="--flip takes square images") as info:
        m.training_logits(pt.tensor("x", dtype="float32", shape=(2, 5)))
    assert info.value.flag == "--flip"
    for argv, message in ((["--shift", "28"], "--shift 28: give 0 to 27 pixels for images of "
                                                "28x28"),
                          (["--shift", "-1"], "--shift must be 0 or more pixels, got -1")):
        with pytest.raises(SystemExit) as info:
            cli.main(["--cpu", "2", *argv])
        assert info.value.code == 2
        assert message in capsys.readouterr().err
