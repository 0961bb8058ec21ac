"""A model of one's own, and the replica that runs it: built, checked, placed on its GPU."""
import json
import os

import numpy as np
import pytest

from pympgu import data
from pympgu.training import checkpoint as ckpt
from pympgu.training import cli, replica
from pympgu.training.config import RunConfig
from pympgu.training.launcher import run as train

pytestmark = pytest.mark.timeout(600)


def config(**over):
    """A run of 2 CPU workers on PyTensor's own backend, with ``over`` changed."""
    return RunConfig(**dict(dict(backend="c", devices=(None, None)), **over))


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
