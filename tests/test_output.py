"""What a run prints, and what it leaves: one line a flag error, the exchange's road on CPU
workers too, no temporary file left behind, the missing driver named."""
import os
import subprocess
import sys

import pytest

from pympgu import cuda

pytestmark = pytest.mark.timeout(300)
TRAIN = [sys.executable, "-m", "pympgu.train", "--cpu", "2", "--hidden", "16"]


def test_a_flag_error_takes_one_line_and_names_the_help():
    r = subprocess.run(TRAIN + ["--lr", "0"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert r.stderr.splitlines() == [
        "python -m pympgu.train: error: --lr must be positive, got 0.0 (see --help)"], r.stderr


def test_a_cpu_run_says_its_road_and_leaves_no_temporary_file(tmp_path):
    tmp, out = tmp_path / "tmp", tmp_path / "run"
    tmp.mkdir()
    env = dict(os.environ, TMPDIR=str(tmp))
    r = subprocess.run(TRAIN + ["--epochs", "2", "--sync-every", "2", "--quiet", "--out",
                                str(out)], capture_output=True, text=True, timeout=240, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    roads = [line.strip() for line in r.stdout.splitlines() if "exchange:" in line]
    assert roads == ["exchange: averaged after every 2 steps, through shared memory (CPU "
                     "workers)"], r.stdout
    assert not os.listdir(tmp), os.listdir(tmp)  # PyTensor's sources went with the run
    r = subprocess.run([sys.executable, "-m", "pympgu.evaluate", str(out)], capture_output=True,
                       text=True, timeout=240, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert not os.listdir(tmp), os.listdir(tmp)


@pytest.mark.skipif(cuda.device_count() > 0, reason="a GPU is here")
def test_a_machine_without_a_driver_is_told_so():
    import ctypes
    try:
        ctypes.CDLL("libcuda.so.1")
        pytest.skip("an NVIDIA driver is installed here")
    except OSError:
        pass
    assert cuda.availability() == (False, "no NVIDIA driver here (libcuda.so.1 is not "
                                          "installed)")
