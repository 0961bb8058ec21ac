"""pympgu.bench train on models of one's own: their PyTorch twins are the same networks,
laid out as asked, and timed at the batch and dtype given."""
import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(300)
EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")


def model_config(name, hidden=None):
    """The RunConfig of a model that bench train times (pympgu.bench.train.model_config)."""
    from pympgu.bench.train import model_config as fields
    from pympgu.training.config import RunConfig
    return RunConfig(**fields(name, hidden))


def test_train_bench_times_a_model_of_ones_own(tmp_path):
    """--model (as pympgu.train's) times a model of one's own, sized by --hidden, beside no
    MLP unless --models names one; it has no DDP or plain JAX twin, and the table names it
    by its class, its columns aligned."""
    out = tmp_path / "rows.json"
    example = os.path.join(EXAMPLES, "residual_mlp.py")
    r = subprocess.run([sys.executable, "-m", "pympgu.bench", "train", "--cpu", "2", "--model",
                        f"{example}:ResidualMLP", "--hidden", "32", "32", "--steps", "2",
                        "--warmup", "1", "--variants", "sync1", "--json", str(out)],
                       capture_output=True, text=True, timeout=280)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [(x["model"], len(x["gpus"]), x["variant"]) for x in rows] == [
        ("ResidualMLP", 1, "-"), ("ResidualMLP", 2, "sync1")], rows
    assert "plain_jax_ms" not in rows[0]
    lines = r.stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("model "))
    table = lines[start:start + 4]
    assert len({line.index("1024") for line in table[2:]}) == 1, table
    assert table[0].index("system") == table[2].index("pympgu"), table
    # --hidden alone sizes nothing; a --model that cannot be built is named.
    from pympgu.bench import train as bench_train
    with pytest.raises(SystemExit):
        bench_train.main(["--cpu", "2", "--hidden", "64"])
    r = subprocess.run([sys.executable, "-m", "pympgu.bench", "train", "--cpu", "2", "--model",
                        "nocolon"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "--model nocolon: give FILE.py:CLASS" in r.stderr, r.stderr


def test_train_bench_times_a_convnet_at_the_batch_given(tmp_path):
    """examples/lenet.py (pympgu.nnet's layers, XLA's convolution) at --batch-size 32 per
    rank on 2 CPU workers: every row at that batch, the table's too."""
    out = tmp_path / "rows.json"
    example = os.path.join(EXAMPLES, "lenet.py")
    r = subprocess.run([sys.executable, "-m", "pympgu.bench", "train", "--cpu", "2", "--model",
                        f"{example}:LeNet", "--hidden", "4", "8", "32", "--batch-size", "32",
                        "--steps", "2", "--warmup", "1", "--variants", "sync1", "overlap",
                        "--json", str(out)], capture_output=True, text=True, timeout=280)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [(x["model"], len(x["gpus"]), x["variant"], x["batch"]) for x in rows] == [
        ("LeNet", 1, "-", 32), ("LeNet", 2, "sync1", 32), ("LeNet", 2, "overlap", 32)], rows
    assert all(x["samples_per_s"] > 0 for x in rows), rows


def test_a_model_of_ones_own_has_a_torch_twin_if_its_class_gives_one():
    """Which models bench train gives DDP rows: the MLPs, and LeNet, whose class has
    torch_twin; not the residual MLP, which has none."""
    from pympgu.bench.torch_ddp import has_torch_twin
    lenet = model_config(f"{EXAMPLES}/lenet.py:LeNet")
    residual = model_config(f"{EXAMPLES}/residual_mlp.py:ResidualMLP", [64, 64])
    assert has_torch_twin(model_config("wide"))
    assert has_torch_twin(lenet) and not has_torch_twin(residual)


@pytest.mark.parametrize("example,hidden", [
    ("lenet.py:LeNet", None), ("lenet.py:LeNet", [8, 16, 64]),
    ("strided.py:StridedConvNet", None), ("strided.py:StridedConvNet", [8, 16, 16])])
def test_a_convnets_torch_twin_is_the_same_network(example, hidden):
    """The twin that DDP trains has pympgu's convnet's parameters (at the model's own
    default_hidden when none is given) and gives one score per class from flat inputs."""
    torch = pytest.importorskip("torch")
    from pympgu import models
    from pympgu.bench.torch_ddp import torch_twin
    cfg = model_config(f"{EXAMPLES}/{example}", hidden)
    twin = torch_twin(cfg, 784, 10)
    ours = models.build(cfg.model, 784, cfg.hidden, 10)
    # Shape for shape, but for the order of a dense layer's dimensions (PyTorch's Linear
    # keeps its weight as (out, in)).
    assert sorted(tuple(sorted(p.shape)) for p in twin.parameters()) == sorted(
        tuple(sorted(p.get_value(borrow=True).shape)) for p in ours.params)
    assert tuple(twin(torch.zeros(3, 784)).shape) == (3, 10)


def test_the_mlps_torch_twin_is_the_same_network():
    """DDP's MLP (bench train's own twin, no --model): pympgu's MLP's parameters, tanh
    layers, one score per class."""
    torch = pytest.importorskip("torch")
    from pympgu import models
    from pympgu.bench.torch_ddp import torch_twin
    cfg = model_config("wide")
    twin = torch_twin(cfg, 784, 10)
    ours = models.MLP(784, cfg.hidden, 10)
    assert [tuple(p.shape) for p in twin.parameters()] == [
        tuple(reversed(p.get_value(borrow=True).shape)) for p in ours.params]
    assert sum(isinstance(m, torch.nn.Tanh) for m in twin) == len(cfg.hidden)
    assert tuple(twin(torch.zeros(3, 784)).shape) == (3, 10)


@pytest.mark.parametrize("layout", ["channels-last", "nchw"])
def test_ddp_lays_out_a_convnets_twin_as_asked(layout):
    """--ddp-layout: channels-last stores the twin's filters so and makes every
    convolution's input so, nchw leaves PyTorch's default; either gives the same scores.
    A twin without convolutions (the MLP's) has no layout to set."""
    torch = pytest.importorskip("torch")
    from pympgu.bench.torch_ddp import lay_out, torch_twin
    cfg = model_config(f"{EXAMPLES}/resnet.py:ResNet", [4, 8])
    torch.manual_seed(0)
    twin = torch_twin(cfg, 784, 10).eval()
    x = torch.randn(3, 784)
    before = twin(x)
    seen = []
    convs = [m for m in twin.modules() if isinstance(m, torch.nn.Conv2d)]
    for conv in convs:
        # One channel is laid out alike both ways: the images' own convolution says nothing.
        conv.register_forward_hook(lambda m, args, out: seen.append(
            args[0].is_contiguous(memory_format=torch.channels_last)) if m.in_channels > 1
            else None)
    assert lay_out(twin, layout) == layout
    after = twin(x)
    fast = layout == "channels-last"
    assert len(seen) == len(convs) - 1 and all(s == fast for s in seen), seen
    assert all(c.weight.is_contiguous(memory_format=torch.channels_last) == fast for c in convs
               if c.in_channels > 1 and c.kernel_size != (1, 1))  # others are alike both ways
    torch.testing.assert_close(after, before)
    assert lay_out(torch_twin(model_config("wide"), 784, 10), layout) is None


def test_train_bench_times_bfloat16_products(tmp_path):
    """--compute-dtype bfloat16 on CPU workers: pympgu's rows and the plain JAX twin
    multiply in bfloat16 (the rows say so); the table's DDP lines name the layout."""
    from pympgu.bench.train import table
    out = tmp_path / "rows.json"
    r = subprocess.run([sys.executable, "-m", "pympgu.bench", "train", "--cpu", "2", "--models",
                        "seed", "--steps", "2", "--warmup", "1", "--variants", "sync1",
                        "--compute-dtype", "bfloat16", "--batch-size", "64",
                        "--json", str(out)], capture_output=True, text=True, timeout=280)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [x["compute_dtype"] for x in rows] == ["bfloat16", "bfloat16"]
    assert "sgd, bfloat16 products" in r.stdout and "plain JAX step" in r.stdout, r.stdout
    row = dict(model="ResNet", system="DDP-graph", gpus=[0], variant="-", batch=1024,
               samples_per_s=1e5, ms_per_step=6.3, host_ms=5.7, tf32=True, layout="nchw")
    assert "(TF32 matmuls on, convolutions nchw)" in table([row])
