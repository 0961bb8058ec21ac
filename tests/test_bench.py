"""The training benchmark's own logic, on CPU workers (its GPU numbers come from the device)."""
import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(300)


def test_train_bench_smoke_on_cpu_workers(tmp_path):
    out = tmp_path / "rows.json"
    r = subprocess.run([sys.executable, "-m", "pympgu.bench", "train", "--cpu", "2", "--models",
                        "seed", "--steps", "2", "--warmup", "1", "--variants", "sync4", "overlap",
                        "bf16", "--json", str(out)], capture_output=True, text=True, timeout=280)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [(len(x["gpus"]), x["variant"]) for x in rows] == [
        (1, "-"), (2, "sync4"), (2, "overlap"), (2, "bf16")]
    assert all(x["samples_per_s"] > 0 for x in rows)
    # the bf16 wire carries half the bytes of the float32 one
    wire = {x["variant"]: x["wire_bytes"] for x in rows if "wire_bytes" in x}
    assert wire["bf16"] * 2 == wire["overlap"]
    assert "plain JAX step" in r.stdout and "scaling" in r.stdout


def test_train_bench_rejects_bad_flags():
    r = subprocess.run([sys.executable, "-m", "pympgu.bench", "train", "--cpu", "9"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "--cpu takes 1 to 8" in r.stderr


def test_train_bench_table_says_whether_ddp_is_host_bound():
    from pympgu.bench_train import table
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

    from pympgu.bench_train import MODELS, run_ddp
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"DDP rank [01] failed:[\s\S]*torch"):
        run_ddp([0, 1], MODELS["seed"], 784, 10, steps=1, warmup=1, timeout=60)
    assert time.monotonic() - t0 < 50
    assert not mp.active_children()
