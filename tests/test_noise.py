"""The training step's noise: --dropout (Model.dropout's masks), --flip and --shift
(pympgu.nnet.augment), each rank's own draws, and runs that resume to the same numbers, on
CPU workers (the GPU's runs are in test_gpu_runtime)."""
import os
import subprocess
import sys

import numpy as np
import pytest

from pympgu import models
from pympgu.training import checkpoint as ckpt
from pympgu.training import cli
from pympgu.training.launcher import run as train
from test_train import config, run_jax_on_cpu

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


# Each rank's noise (Replica.seed_noise), on both backends: from one state and one
# minibatch, a rank's step gives the same cost for the same (rank, epoch), and another
# for another rank or epoch. CPU JAX must be chosen before JAX is imported: a fresh
# interpreter.
NOISE = """
import os, sys; os.environ['JAX_PLATFORMS'] = 'cpu'
import numpy as np; from types import SimpleNamespace
from pympgu.training import replica; from pympgu.training.config import RunConfig
backend, dropout = sys.argv[1], float(sys.argv[2])
cfg = RunConfig(backend=backend, hidden=[64], batch_size=64, dropout=dropout, seed=7)
idx = np.arange(64, dtype=np.int32)

def cost(rank, epoch):
    ctx = SimpleNamespace(device=None, rank=rank, nranks=2, is_cpu=True)
    rep = replica.Replica(ctx, cfg)
    rep.seed_noise(epoch)
    return [float(rep.step(idx)) for _ in range(2)]

a, again, other_rank, other_epoch = cost(0, 0), cost(0, 0), cost(1, 0), cost(0, 1)
assert a == again, (a, again)
if dropout:  # the second step's cost: the first's is log(10), the output layer at zero
    assert a[1] != other_rank[1] and a[1] != other_epoch[1], (a, other_rank, other_epoch)
else:
    assert a == other_rank == other_epoch
print('noise', a, other_rank, other_epoch)
"""


@pytest.mark.parametrize("backend", ["c", "jax"])
@pytest.mark.parametrize("dropout", [0.5, 0.0])
def test_each_rank_and_epoch_draws_its_own_masks(backend, dropout):
    if backend == "jax":
        pytest.importorskip("jax")
    r = subprocess.run([sys.executable, "-c", NOISE, backend, str(dropout)],
                       capture_output=True, text=True, timeout=500)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "noise" in r.stdout


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


def test_jax_step_hands_the_exchange_the_noise_as_a_ranks_own_input():
    """JaxStep on a step that draws: the exchange sees a program of arrays, the key's among
    the rank's own inputs (local), the state at its positions in the state's order; and
    the step computes what PyTensor's own call does, bit for bit."""
    pytest.importorskip("jax")
    code = (
        "import os; os.environ['JAX_PLATFORMS']='cpu'\n"
        "import numpy as np; from pympgu import data, models; from pympgu.xla.step import JaxStep\n"
        "ds = data.load(); seen = []\n"
        "def make():\n"
        "    m = models.build(None, ds.n_in, [32], ds.n_classes, dropout=0.5)\n"
        "    return m, m.compile(ds, 64, 100, 0.05, 0.9, 0, 1e-4, 'JAX')[0]\n"
        "(m1, f1), (m2, f2) = make(), make()\n"
        "def exchange(compute, which, *args, local=()):\n"
        "    outs = compute(*args)\n"
        "    seen.append(([str(args[k].dtype) for k in local],\n"
        "                 [tuple(outs[i].shape) for i in which]))\n"
        "    return outs\n"
        "step = JaxStep(f2, m2.state, exchange)\n"
        "idx = np.arange(64, dtype=np.int32)\n"
        "for k in range(3):\n"
        "    assert float(f1(idx)) == float(step(idx)), k\n"
        "for a, b in zip(m1.state, m2.state):\n"
        "    assert np.array_equal(np.asarray(a.get_value()), np.asarray(b.get_value())), a.name\n"
        "local, shapes = seen[0]\n"
        "assert len(seen) == 1 and local[0] == 'int32' and 'uint32' in local, seen\n"
        "assert shapes == [tuple(s.get_value().shape) for s in m2.state], shapes\n"
        "print('local', local)\n"
    )
    run_jax_on_cpu(code, "local")


AUGMENT = """
import os, sys; os.environ['JAX_PLATFORMS'] = 'cpu'
import numpy as np, pytensor, pytensor.tensor as pt
from pympgu.nnet import augment
x = pt.tensor('x', dtype='float32', shape=(64, 3, 8, 7))
f = pt.tensor('f', dtype='float32', shape=(64,))
o = pt.tensor('o', dtype='float32', shape=(64, 2))
fn = pytensor.function([x, f, o], augment(x, f, 2, o), mode=sys.argv[1])
rng = np.random.default_rng(0)
xv = rng.normal(size=(64, 3, 8, 7)).astype(np.float32)
fv, ov = rng.random(64).astype(np.float32), rng.random((64, 2)).astype(np.float32)
out, moves = np.asarray(fn(xv, fv, ov)), set()
for b in range(64):
    image = xv[b][:, :, ::-1] if fv[b] < 0.5 else xv[b]
    padded = np.pad(image, ((0, 0), (2, 2), (2, 2)))
    dy, dx = np.floor(ov[b] * 5).astype(int)
    assert np.array_equal(out[b], padded[:, dy:dy + 8, dx:dx + 7]), b
    moves.add((dy, dx, fv[b] < 0.5))
assert len(moves) > 30, moves  # of 5 x 5 x 2
print('augmented', len(moves))
"""


@pytest.mark.parametrize("mode", ["FAST_RUN", "JAX"])
def test_augment_flips_and_shifts_each_image_its_own_way(mode):
    """pympgu.nnet.augment on both backends: each image mirrored where its number is under
    1/2, then cut from its copy padded by the shift at its own offsets (what numpy's pad and
    slice give, exactly)."""
    if mode == "JAX":
        pytest.importorskip("jax")
    r = subprocess.run([sys.executable, "-c", AUGMENT, mode], capture_output=True, text=True,
                       timeout=500)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "augmented" in r.stdout


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
