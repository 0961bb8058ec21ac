"""The training benchmark's own logic, on CPU workers (its GPU numbers come from the device)."""
import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(300)


def model_config(name, hidden=None):
    """The RunConfig of a model that bench train times (pympgu.bench.train.model_config)."""
    from pympgu.bench.train import model_config as fields
    from pympgu.training.config import RunConfig
    return RunConfig(**fields(name, hidden))


def bench_on_cpu(tmp_path, *argv):
    """``python -m pympgu.bench train`` on 2 CPU workers, the seed's MLP, 2 steps after 1
    of warm-up, with ``argv``: the finished process and its rows."""
    out = tmp_path / "rows.json"
    r = subprocess.run([sys.executable, "-m", "pympgu.bench", "train", "--cpu", "2", "--models",
                        "seed", "--steps", "2", "--warmup", "1", *argv, "--json", str(out)],
                       capture_output=True, text=True, timeout=280)
    assert r.returncode == 0, r.stderr[-3000:]
    return r, json.loads(out.read_text())["rows"]


def refused(*argv):
    """What ``python -m pympgu.bench train`` says to stderr, refusing ``argv``."""
    r = subprocess.run([sys.executable, "-m", "pympgu.bench", "train", *argv],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, (r.returncode, r.stderr[-3000:])
    return r.stderr


def test_train_bench_smoke_on_cpu_workers(tmp_path):
    r, rows = bench_on_cpu(tmp_path, "--variants", "sync4", "overlap", "bf16-py")
    assert [(len(x["gpus"]), x["variant"]) for x in rows] == [
        (1, "-"), (2, "sync4"), (2, "overlap"), (2, "bf16-py")]
    assert all(x["samples_per_s"] > 0 for x in rows)
    # the bf16 wire carries half the bytes of the float32 one
    wire = {x["variant"]: x["wire_bytes"] for x in rows if "wire_bytes" in x}
    assert wire["bf16-py"] * 2 == wire["overlap"]
    assert "plain JAX step" in r.stdout and "scaling" in r.stdout


def test_train_bench_repeats_rows_in_rounds(tmp_path):
    """--repeats 3: every row three times, in rounds; the row is its median run, and each
    round's scaling is against the 1-GPU run of the same round."""
    r, (one, two) = bench_on_cpu(tmp_path, "--variants", "sync4", "--repeats", "3")
    for row in (one, two):
        assert len(row["runs_ms"]) == 3 and row["ms_per_step"] == sorted(row["runs_ms"])[1]
    assert [round(x, 9) for x in two["run_scalings"]] == [
        round(a / (2 * b), 9) for a, b in zip(two["runs_samples"], one["runs_samples"])]
    # The rounds interleave the rows: 1 GPU, 2, 1, 2, 1, 2.
    order = [line for line in r.stderr.splitlines() + r.stdout.splitlines()
             if "run " in line and " of 3" in line and "ms/step" not in line]
    assert [("sync4" in line) for line in order] == [False, True] * 3, order
    assert "3 of 3 runs" in r.stdout and "scaling run by run" in r.stdout


@pytest.mark.parametrize("optimizer", ["adam", "adamw"])
def test_train_bench_times_adam_with_a_schedule(tmp_path, optimizer):
    """--optimizer adam (or adamw) --schedule cosine on CPU workers: every row trains by it
    (the exchanges move its whole state, three arrays a parameter), the plain JAX twin
    too, and pympgu's rows set the rate every step; a schedule with DDP rows is
    refused."""
    r, (one, two) = bench_on_cpu(tmp_path, "--variants", "sync4", "--optimizer", optimizer,
                                 "--schedule", "cosine")
    assert {x["optimizer"] for x in (one, two)} == {optimizer} and two["schedule"] == "cosine"
    n = 3 * 4 * (784 * 500 + 500 + 500 * 10 + 10)  # with each array's alignment padding
    assert n <= two["wire_bytes"] < 1.001 * n, two["wire_bytes"]
    assert f"{optimizer}, cosine schedule" in r.stdout and "plain JAX step" in r.stdout
    assert "add --no-ddp" in refused("--schedule", "linear")


def test_train_bench_times_dropout_in_pympgus_rows(tmp_path):
    """--dropout 0.5 on CPU workers: pympgu's rows train with it, with no plain JAX twin
    (which has no dropout) to set beside them; with DDP rows, or out of range, refused."""
    r, rows = bench_on_cpu(tmp_path, "--variants", "sync4", "--dropout", "0.5")
    assert [x["dropout"] for x in rows] == [0.5, 0.5]
    assert "sgd, dropout 0.5" in r.stdout and "plain JAX step" not in r.stdout, r.stdout
    assert "add --no-ddp" in refused("--dropout", "0.5")
    assert "--dropout must be in [0, 1)" in refused("--cpu", "2", "--dropout", "1")


def test_train_bench_times_clipped_gradients(tmp_path):
    """--clip-norm 1 on CPU workers: every row clips, the plain JAX twin too (as DDP's
    twin calls clip_grad_norm_), and the rows say so; a negative norm is refused."""
    r, rows = bench_on_cpu(tmp_path, "--variants", "sync1", "--clip-norm", "1")
    assert [x["clip_norm"] for x in rows] == [1.0, 1.0]
    assert "sgd, clipped to norm 1" in r.stdout and "plain JAX step" in r.stdout, r.stdout
    assert "--clip-norm must be 0 (off) or above" in refused("--cpu", "2", "--clip-norm", "-1")


def test_train_bench_times_the_moving_average(tmp_path):
    """--ema 0.9 on CPU workers: every row keeps the parameters' moving average, the plain
    JAX twin too (as DDP's twin lerps it), and the whole state that --sync-every 4 sends
    holds it (three arrays a parameter with SGD's momentum); out of range, refused."""
    r, (one, two) = bench_on_cpu(tmp_path, "--variants", "sync4", "--ema", "0.9")
    assert [x["ema"] for x in (one, two)] == [0.9, 0.9]
    n = 3 * 4 * (784 * 500 + 500 + 500 * 10 + 10)  # with each array's alignment padding
    assert n <= two["wire_bytes"] < 1.001 * n, two["wire_bytes"]
    assert "sgd, moving average 0.9" in r.stdout and "plain JAX step" in r.stdout, r.stdout
    assert "--ema must be in [0, 1)" in refused("--cpu", "2", "--ema", "1")


def test_train_bench_rejects_bad_flags():
    assert "--cpu takes 1 to 8" in refused("--cpu", "9")
    assert "--repeats must be at least 1" in refused("--cpu", "2", "--repeats", "0")
    assert "--batch-size must be at least 1, got 0" in refused("--cpu", "2", "--batch-size", "0")


@pytest.mark.parametrize("argv,message", [
    (["--sizes", "4X"], "--sizes: '4X' is not a size such as 4K, 64M or 1G"),
    (["--sizes", "64K", "2"], "--sizes: '2': a buffer of at least 4 bytes"),
    (["--blocks", "0"], "--blocks: 1 to 512"),
])
def test_exchange_bench_names_a_bad_flag_before_it_looks_for_gpus(argv, message, capsys):
    from pympgu import bench
    from pympgu.bench.timing import parse_size
    assert parse_size("64MiB") == 64 << 20 and parse_size("1.5k") == 1536
    with pytest.raises(SystemExit) as info:
        bench.main(argv)
    assert info.value.code == 2
    assert message in capsys.readouterr().err


def test_train_bench_names_a_bad_data_dir(capsys):
    from pympgu.bench import train as bench_train
    with pytest.raises(SystemExit) as info:
        bench_train.main(["--cpu", "2", "--data-dir", "/no/such/dir"])
    assert info.value.code == 2
    assert "--data-dir: /no/such/dir: no such directory" in capsys.readouterr().err


def test_train_bench_table_says_whether_ddp_is_host_bound():
    from pympgu.bench.train import table
    row = dict(model="wide", system="DDP", gpus=[0], variant="-", batch=1024,
               samples_per_s=4.5e5, ms_per_step=2.262, scaling=1.0, host_ms=2.1, tf32=True,
               gpu_ms=0.932)
    # A row whose 1-GPU run failed has no scaling.
    graph = dict(row, system="DDP-graph", gpus=[0, 1], host_ms=0.06, tf32=False)
    del graph["scaling"], graph["gpu_ms"]
    text = table([row, graph])
    assert "wide: DDP on GPUs [0]: the host issues a step in 2.100 ms of its 2.262 ms; queued " \
           "behind a held GPU, a step takes 0.932 ms (TF32 matmuls on)" in text
    assert "wide: DDP-graph on GPUs [0, 1]: the host issues a step in 0.060 ms of its 2.262 ms " \
           "(TF32 matmuls off)" in text
    assert "DDP-graph 0,1" in text


def test_ddp_run_that_fails_raises_at_once_naming_its_rank():
    # Without torch (CI), every DDP rank fails on import: the run must say which rank failed
    # and why, promptly, and leave no process behind.
    try:
        import torch  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("torch is importable here: the ranks would not fail")
    import multiprocessing as mp
    import time

    from pympgu.bench.train import MODELS
    from pympgu.bench.torch_ddp import run_ddp
    from pympgu.training.config import RunConfig
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"DDP rank [01] failed:[\s\S]*torch"):
        run_ddp([0, 1], RunConfig(**MODELS["seed"]), 784, 10, steps=1, warmup=1, timeout=60)
    assert time.monotonic() - t0 < 50
    assert not mp.active_children()


def test_train_bench_table_shows_the_slowest_ranks_clock():
    from pympgu.bench.train import table
    row = dict(model="wide", system="pympgu", gpus=[0, 1], variant="overlap4", batch=1024,
               samples_per_s=3.3e6, ms_per_step=0.619, sm_mhz=[1951.4, 1922.6],
               clock_capped=[0.5, 0.875])
    line = table([row]).splitlines()[2]
    assert line.endswith("1923 (88%)"), line
    # Several runs: their spread, and each round's scaling.
    runs = dict(row, runs_ms=[0.62, None, 0.619], run_scalings=[0.9496, None, 0.94])
    assert ("wide: pympgu overlap4 on GPUs [0, 1]: 2 of 3 runs, 0.619 to 0.620 ms/step (the "
            "row: the median run); scaling run by run 0.9496, -, 0.9400") in table([runs])
    # The road an exact exchange inside XLA took, when one was asked for.
    road = "the new values averaged after the update: 1000 bytes of gradients, under PYMPGU_SPLIT_MIN_BYTES=16777216"
    assert f"wide: pympgu overlap4 on GPUs [0, 1]: {road}" in table([dict(row, road=road)])
    assert "pympgu overlap4 on GPUs" not in table([dict(row, road=None)])
    # CPU workers, DDP rows and machines without NVML have no clock.
    for unknown in (dict(row, sm_mhz=[None, None], clock_capped=[None, None]),
                    {k: v for k, v in row.items() if k not in ("sm_mhz", "clock_capped")}):
        assert table([unknown]).splitlines()[2].endswith(" -")


def test_train_bench_scaling_against_each_gpus_own_rate():
    """A pair runs at its slower GPU's pace: beside the scaling against the first GPU alone,
    the rows of distinct GPUs get one against the sum of each GPU's own rate, given every
    GPU's 1-GPU row; none for ranks that share a GPU, a GPU without its row, or another
    system's 1-GPU row."""
    from pympgu.bench.train import scaling_alone, table

    def row(gpus, rate, system="pympgu", variant="-"):
        return dict(model="wide", system=system, gpus=gpus, variant=variant, batch=1024,
                    samples_per_s=rate, ms_per_step=1024 * len(gpus) * 1e3 / rate)

    zero, one = row([0], 1.76e6), row([1], 1.72e6)
    pair = dict(row([0, 1], 3.30e6, variant="overlap4"), scaling=3.30 / 3.52)
    assert scaling_alone(pair, [zero, one, pair]) == pytest.approx(3.30 / 3.48)
    assert scaling_alone(pair, [zero, pair]) is None  # GPU 1 alone was not timed
    assert scaling_alone(pair, [zero, row([1], 1.7e6, system="DDP"), pair]) is None
    assert scaling_alone(row([0, 0], 3.0e6), [zero, one]) is None  # one GPU, two ranks
    assert scaling_alone(zero, [zero, one]) is None
    text = table([zero, one, dict(pair, scaling_alone=3.30 / 3.48)])
    assert ("wide: pympgu overlap4 on GPUs [0, 1]: scaling 0.948 against each GPU's own "
            "rate alone (0.938 against GPU 0's)") in text
    assert "own rate" not in table([zero, one, pair])


def test_train_bench_times_each_gpu_alone(monkeypatch):
    """measure() on GPUs 0 and 1 (their runs faked: no GPU here) times each GPU alone, every
    round, and gives the pair's row both scalings; the 1-GPU row of GPU 1 shows its rate
    against GPU 0's and adds no exchange time."""
    from pympgu.bench import train as bench_train
    seen = []

    def fake(devices, cfg, steps, warmup, plain_jax=False, inside=True):
        seen.append(list(devices))
        # The pair 0.620 ms a step in the first round, 0.610 in the second.
        ms = {(0,): 0.580, (1,): 0.590}.get(tuple(devices), 0.630 - 0.010 * seen.count([0, 1]))
        return {"ms_per_step": ms, "samples_per_s": 1024 * len(devices) * 1e3 / ms}

    monkeypatch.setattr(bench_train, "run_pympgu", fake)
    rows = bench_train.measure([0, 1], ["wide"], ["overlap4"], 10, 2, None, ddp=(),
                               log=lambda *a, **k: None, repeats=2)
    assert seen == [[0], [1], [0, 1]] * 2, seen
    by = {tuple(r["gpus"]): r for r in rows}
    assert by[(1,)]["scaling"] == pytest.approx(0.580 / 0.590)
    assert "added_ms_per_step" not in by[(1,)]
    # The row is the median run: of two, the faster (a run that happened).
    assert by[(0, 1)]["scaling"] == pytest.approx(0.580 / 0.610)
    own = [2 / ms / (1 / 0.580 + 1 / 0.590) for ms in (0.620, 0.610)]
    assert by[(0, 1)]["scaling_alone"] == pytest.approx(own[1])
    assert by[(0, 1)]["run_scalings_alone"] == pytest.approx(own)
    assert by[(0, 1)]["added_ms_per_step"] == pytest.approx(0.030)
    assert (f"against GPU 0's); run by run {own[0]:.4f}, {own[1]:.4f}"
            in bench_train.table(rows)), bench_train.table(rows)


def test_train_bench_runs_ddp_with_its_hooks(monkeypatch):
    """'sync1-bf16' sends pympgu's gradients in bfloat16 inside the step; its DDP
    counterpart, 'DDP-bf16', is eager DDP with PyTorch's bf16_compress_hook; 'DDP-pympgu'
    eager DDP with pympgu.ddp's hook, and 'DDP-pympgu-graph' the same captured in a CUDA
    graph (runs faked: no GPU here)."""
    from pympgu.bench import train as bench_train
    seen = []

    def fake_pympgu(devices, cfg, steps, warmup, plain_jax=False, inside=True):
        seen.append(("pympgu", len(devices), cfg.exchange_dtype, inside))
        return {"ms_per_step": 1.0, "samples_per_s": 1024 * len(devices) * 1e3}

    def fake_ddp(devices, cfg, n_in, n_classes, steps, warmup, graph=False, layout=None,
                 hook=None):
        seen.append(("DDP", len(devices), hook, graph))
        return {"ms_per_step": 1.0, "samples_per_s": 1024 * len(devices) * 1e3}

    monkeypatch.setattr(bench_train, "run_pympgu", fake_pympgu)
    monkeypatch.setattr(bench_train, "run_ddp", fake_ddp)
    rows = bench_train.measure([0, 1], ["wide"], ["sync1-bf16"], 10, 2, None,
                               ddp=("DDP", "DDP-bf16", "DDP-pympgu", "DDP-pympgu-graph"),
                               log=lambda *a, **k: None)
    assert seen == [("pympgu", 1, "float32", True)] * 2 + [("pympgu", 2, "bfloat16", True),
                    ("DDP", 1, None, False), ("DDP", 2, None, False),
                    ("DDP", 1, "bf16_compress", False), ("DDP", 2, "bf16_compress", False),
                    ("DDP", 1, "pympgu", False), ("DDP", 2, "pympgu", False),
                    ("DDP", 1, "pympgu", True), ("DDP", 2, "pympgu", True)], seen
    assert [r["system"] for r in rows] == (["pympgu"] * 3 + ["DDP"] * 2 + ["DDP-bf16"] * 2
                                           + ["DDP-pympgu"] * 2 + ["DDP-pympgu-graph"] * 2)
    # Ranks sharing a GPU: NCCL's DDP runs on one rank alone; pympgu's hook on both.
    seen.clear()
    bench_train.measure([0, 0], ["wide"], ["sync1"], 10, 2, None,
                        ddp=("DDP", "DDP-pympgu", "DDP-pympgu-graph"), log=lambda *a, **k: None)
    assert [s for s in seen if s[0] == "DDP"] == [
        ("DDP", 1, None, False), ("DDP", 1, "pympgu", False), ("DDP", 2, "pympgu", False),
        ("DDP", 1, "pympgu", True), ("DDP", 2, "pympgu", True)]


def test_train_bench_picks_ddp_systems_from_its_flags():
    from pympgu.bench.torch_ddp import DDP_SYSTEMS, ddp_systems
    assert ddp_systems(["sync1"]) == ("DDP", "DDP-graph")
    assert ddp_systems(["sync1", "sync1-bf16"], graphs=False) == ("DDP", "DDP-bf16")
    assert ddp_systems(["sync1"], hook=True) == ("DDP", "DDP-graph", "DDP-pympgu",
                                                 "DDP-pympgu-graph")
    assert ddp_systems(["sync1"], graphs=False, hook=True) == ("DDP", "DDP-pympgu")
    every = ddp_systems(["sync1-bf16"], hook=True)
    assert set(every) == set(DDP_SYSTEMS)  # each system a flag can reach
    assert [s for s in every if DDP_SYSTEMS[s][0]] == ["DDP-graph", "DDP-pympgu-graph"]


def test_ddp_runs_on_cpu_ranks_through_gloo():
    """The CPU workers' baseline: DDP's twin of the MLP on 2 CPU ranks, gloo carrying its
    gradients; no GPU time is asked of it."""
    pytest.importorskip("torch.distributed")
    from pympgu.bench.torch_ddp import run_ddp
    cfg = model_config("seed").replace(batch_size=32)
    r = run_ddp([None, None], cfg, 784, 10, steps=3, warmup=1)
    assert r["samples_per_s"] > 0 and r["ms_per_step"] > 0 and "gpu_ms" not in r


def test_train_bench_ranks_time_the_multi_gpu_rows_at_each_size(monkeypatch):
    """--ranks 2 4 on GPUs 0 to 3 (runs faked: no GPU here): each GPU alone, then every
    variant and DDP on the first 2 and on all 4, each row scaled against GPU 0 alone and
    against its own GPUs alone."""
    from pympgu.bench import train as bench_train
    seen = []

    def fake_pympgu(devices, cfg, steps, warmup, plain_jax=False, inside=True):
        seen.append(("pympgu", list(devices)))
        ms = 0.580 if len(devices) == 1 else 0.580 + 0.05 * len(devices)
        return {"ms_per_step": ms, "samples_per_s": 1024 * len(devices) * 1e3 / ms}

    def fake_ddp(devices, cfg, n_in, n_classes, steps, warmup, graph=False, layout=None,
                 hook=None):
        seen.append(("DDP", list(devices)))
        ms = 0.9 * (1 + 0.1 * (len(devices) - 1))
        return {"ms_per_step": ms, "samples_per_s": 1024 * len(devices) * 1e3 / ms}

    monkeypatch.setattr(bench_train, "run_pympgu", fake_pympgu)
    monkeypatch.setattr(bench_train, "run_ddp", fake_ddp)
    rows = bench_train.measure([0, 1, 2, 3], ["wide"], ["sync1"], 10, 2, None, ddp=("DDP",),
                               log=lambda *a, **k: None, ranks=[2, 4])
    assert seen == [("pympgu", [0]), ("pympgu", [1]), ("pympgu", [2]), ("pympgu", [3]),
                    ("pympgu", [0, 1]), ("pympgu", [0, 1, 2, 3]), ("DDP", [0]), ("DDP", [0, 1]),
                    ("DDP", [0, 1, 2, 3])], seen
    by = {(r["system"], tuple(r["gpus"])): r for r in rows}
    assert by["pympgu", (0, 1)]["scaling"] == pytest.approx(0.580 / 0.680)
    assert by["pympgu", (0, 1, 2, 3)]["scaling"] == pytest.approx(0.580 / 0.780)
    assert by["pympgu", (0, 1, 2, 3)]["scaling_alone"] == pytest.approx(0.580 / 0.780)
    assert by["DDP", (0, 1, 2, 3)]["scaling"] == pytest.approx(1 / 1.3)
    text = bench_train.table(rows)
    assert "wide: pympgu sync1 on GPUs [0, 1]: scaling 0.853" in text, text
    # The GPUs column widens to 8 GPUs' list, so the columns after it stay aligned.
    eight = dict(by["pympgu", (0, 1, 2, 3)], gpus=list(range(8)))
    lines = bench_train.table(rows + [eight]).splitlines()
    assert len({line.index("1024") for line in lines[2:2 + len(rows) + 1]}) == 1, lines
    # The flag's own checks, before any GPU is looked for.
    with pytest.raises(SystemExit):
        bench_train.main(["--cpu", "2", "--ranks", "3"])


def test_train_bench_env_settings_alternate_within_each_round(monkeypatch):
    """--env NAME=A,B: each multi-GPU row once per value, the values alternating within each
    round beside the same round's 1-GPU runs, which keep the environment as given; each
    worker launch sees its value, and the environment is restored afterwards."""
    from pympgu.bench import train as bench_train
    knob = "PYMPGU_TEST_BENCH_KNOB"
    monkeypatch.delenv(knob, raising=False)
    seen = []

    def fake(devices, cfg, steps, warmup, plain_jax=False, inside=True):
        value = os.environ.get(knob)
        seen.append((list(devices), value))
        ms = 0.580 if len(devices) == 1 else {"a": 0.610, "b": 0.620}[value]
        return {"ms_per_step": ms, "samples_per_s": 1024 * len(devices) * 1e3 / ms}

    monkeypatch.setattr(bench_train, "run_pympgu", fake)
    settings = bench_train.env_settings([f"{knob}=a,b"])
    rows = bench_train.measure([0, 0], ["wide"], ["overlap4"], 10, 2, None, ddp=(),
                               log=lambda *a, **k: None, repeats=2, settings=settings)
    assert seen == [([0], None), ([0, 0], "a"), ([0, 0], "b")] * 2, seen
    assert knob not in os.environ
    pairs = [r for r in rows if len(r["gpus"]) == 2]
    assert [(r["variant"], r["env"], r["ms_per_step"]) for r in pairs] == [
        (f"overlap4 {knob}=a", {knob: "a"}, 0.610), (f"overlap4 {knob}=b", {knob: "b"}, 0.620)]
    assert "env" not in rows[0]
    assert pairs[0]["scaling"] == pytest.approx(0.580 / 0.610)
    # The table's variant column widens to the longest name, so its columns stay aligned.
    lines = bench_train.table(rows).splitlines()
    assert len({line.index("1024") for line in lines[2:5]}) == 1, lines[:5]


def test_train_bench_env_settings_parse_and_refuse():
    from pympgu.bench.train import env_settings, main
    assert env_settings([]) == [{}]
    assert env_settings(["A=1,0", "B=x,y"]) == [
        {"A": "1", "B": "x"}, {"A": "1", "B": "y"}, {"A": "0", "B": "x"}, {"A": "0", "B": "y"}]
    for bad in (["A"], ["1A=1"], ["A=1,"], ["A=1,1"], ["A=1", "A=2"]):
        with pytest.raises(ValueError):
            env_settings(bad)
    with pytest.raises(SystemExit) as info:
        main(["--cpu", "2", "--env", "A"])
    assert info.value.code == 2


def test_train_bench_times_the_step_forms_in_rounds(monkeypatch):
    """The PyTensor call, the direct call and the plain JAX step are timed in rounds, each
    once a round after one untimed call each, and each gets the median of its rounds."""
    from pympgu.bench import steps
    clock, log = [0.0], []
    monkeypatch.setattr(steps.time, "perf_counter", lambda: clock[0])

    def form(name, seconds):
        # Each timed pass over the two batches takes the next of ``seconds``; the untimed
        # first call takes none.
        left = iter(seconds)

        def call(idx):
            log.append(name)
            if idx == 1 and len(log) > 2:
                clock[0] += next(left)
        return call, lambda: None

    got = steps._time_rounds([form("a", [5.0, 1.0, 2.0]), form("b", [3.0, 4.0, 9.0])],
                                   [0, 1], rounds=3)
    assert log == ["a", "b"] + ["a", "a", "b", "b"] * 3, log
    assert got == [pytest.approx(1e3 * 2.0 / 2), pytest.approx(1e3 * 4.0 / 2)]


def test_clocks_averages_nvml_samples_and_counts_the_capped_ones(monkeypatch):
    import ctypes
    import time

    from pympgu.bench.clocks import Clocks

    class FakeNvml:
        """Returns 1980 MHz, then 1900 MHz held down by the power cap, in turn."""
        calls = 0

        def nvmlInit_v2(self):
            return 0

        def nvmlShutdown(self):
            return 0

        def nvmlDeviceGetHandleByIndex_v2(self, index, handle):
            return 0 if index == 1 else 2  # NVML_ERROR_INVALID_ARGUMENT

        def nvmlDeviceGetClockInfo(self, handle, which, mhz):
            assert which == Clocks.SM
            FakeNvml.calls += 1
            ctypes.cast(mhz, ctypes.POINTER(ctypes.c_uint))[0] = 1980 if self.calls % 2 else 1900
            return 0

        def nvmlDeviceGetCurrentClocksEventReasons(self, handle, reasons):
            ctypes.cast(reasons, ctypes.POINTER(ctypes.c_ulonglong))[0] = \
                0 if self.calls % 2 else 0x4  # SwPowerCap with the low clock
            return 0

    monkeypatch.setattr(ctypes, "CDLL", lambda name: FakeNvml())
    with Clocks(1, period=0.001) as c:
        deadline = time.monotonic() + 10  # a sampler that died must fail the test, not hang it
        while FakeNvml.calls < 10 and time.monotonic() < deadline:
            time.sleep(0.001)
    n = len(c.samples)
    assert n >= 10 and c.mhz == (1980 * ((n + 1) // 2) + 1900 * (n // 2)) / n
    assert c.capped == (n // 2) / n
    with Clocks(0) as c:  # NVML has no such GPU
        pass
    assert (c.mhz, c.capped) == (None, None)
    with Clocks(None) as c:  # a CPU worker
        pass
    assert (c.mhz, c.capped) == (None, None)


def test_exchange_bench_table_leaves_out_what_a_method_does_not_take():
    """'ll' takes buffers up to its mailboxes' size: beyond them its cells read nan, the
    other columns and the host times stay."""
    from pympgu.bench.exchange import table
    rows = [{"bytes": 4096, "ll": {"us": 5.0, "e2e_us": 14.0, "queue_us": 5.0},
             "oneshot": {"us": 8.0, "e2e_us": 16.0, "queue_us": 4.5},
             "nccl": {"us": 80.0, "e2e_us": 70.0, "queue_us": 24.0}},
            {"bytes": 1 << 30, "oneshot": {"us": 3200.0}, "nccl": {"us": 3300.0}}]
    lines = table(rows, ["ll", "oneshot"]).splitlines()
    small = next(x for x in lines if x.strip().startswith("4 KiB"))
    assert "16.00" in small and "10.00" in small  # each method's speedup over NCCL
    big = next(x for x in lines if x.strip().startswith("1 GiB"))
    assert big.split("|")[1].split() == ["nan", "nan"] and "3200.0" in big
    e2e = lines[lines.index(next(x for x in lines if x.startswith("end to end"))) + 2]
    assert e2e.split("|")[1].split() == ["14.0", "(", "5.0)", "16.0", "(", "4.5)", "70.0", "(",
                                         "24.0)"]


def test_exchange_bench_columns_cap_kernels_and_size_the_resident_kernel():
    """--blocks B adds a capped column for every method but the copy method, which runs no
    grid of its own; for 'resident', B is its kernel's block count."""
    from pympgu.bench.exchange import METHODS, columns
    assert "resident" in METHODS
    got = columns(["ll", "resident", "copy"], [None, 4])
    assert got == [("ll", "ll", None), ("resident", "resident", None), ("copy", "copy", None),
                   ("ll@4", "ll", 4), ("resident@4", "resident", 4)]


def test_the_nodes_table_sets_the_hierarchy_against_flat_nccl():
    from pympgu.bench.nodes import table
    rows = [{"bytes": 4096, "hierarchy": {"us": 50.0, "e2e_us": 70.0, "queue_us": 5.0},
             "flat": {"us": 60.0, "e2e_us": 80.0, "queue_us": 5.0}},
            {"bytes": 1 << 26, "hierarchy": {"us": 5000.0}, "flat": {"us": 6000.0}}]
    text = table(rows).splitlines()
    assert "flat/hierarchy" in text[0]
    assert text[2].split() == ["4", "KiB", "|", "50.0", "0.1", "|", "60.0", "0.1", "|", "1.20"]
    assert text[3].split()[-1] == "1.20" and "13.4" in text[3]
    assert text[-1].split() == ["4", "KiB", "|", "70.0", "80.0"]
    alone = table([{k: v for k, v in r.items() if k != "flat"} for r in rows])
    assert "flat/hierarchy" not in alone and alone.endswith("which NCCL refuses")


def test_kills_bench_runs_with_the_training_flags_it_is_given(tmp_path):
    """``python -m pympgu.bench kills``: an undisturbed run, then one with a kill, on 2 nodes
    of 2 CPU workers under DiLoCo, the lost one replaced (--train-flags reach every run);
    the table's row says what ran, and the JSON holds every run's status and what was left
    behind."""
    out = tmp_path / "kills.json"
    r = subprocess.run([sys.executable, "-m", "pympgu.bench", "kills", "--nnodes", "2", "--cpu",
                        "2", "--min-workers", "1", "--restart-workers", "1", "--runs", "1",
                        "--kills", "1", "--epochs", "300", "--spacing", "0.5", "--train-flags",
                        "--hidden 16 --across-nodes diloco --outer-every 5", "--json", str(out)],
                       capture_output=True, text=True, timeout=280)
    assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-3000:])
    assert "| 2 x 2 --hidden 16 --across-nodes diloco --outer-every 5 (min 1, 1 restarts) |" \
        in r.stdout, r.stdout
    rows = json.loads(out.read_text())
    assert rows["args"]["train_flags"] == "--hidden 16 --across-nodes diloco --outer-every 5"
    assert rows["undisturbed"]["status"] == 0
    run, = rows["runs"]
    assert (run["status"], run["orphans"], run["shm_left"]) == (0, 0, 0), run
    assert run["kills"] == run["recovered"] == 1, run
