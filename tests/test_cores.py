"""CPU workers on cores of their own (pympgu.runtime.cores): the split, the topology it
reads, and the workers of a run pinned apart."""
import os
import subprocess
import sys

import pytest

from pympgu.runtime import cores
from processes import kill_session, start, wait_until

pytestmark = pytest.mark.timeout(120)


def fake_sysfs(tmp_path, topology):
    """A sysfs of CPUs {cpu: (package, core)}."""
    for cpu, (package, core) in topology.items():
        d = tmp_path / f"cpu{cpu}" / "topology"
        d.mkdir(parents=True)
        (d / "physical_package_id").write_text(f"{package}\n")
        (d / "core_id").write_text(f"{core}\n")
    return str(tmp_path)


def test_hyperthreads_of_a_core_go_together(tmp_path):
    # 4 cores of 2 threads, the second threads numbered after the first (4-7).
    sysfs = fake_sysfs(tmp_path, {c: (0, c % 4) for c in range(8)})
    assert cores.physical_cores(range(8), sysfs) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    # A CPU sysfs does not describe is a core of its own.
    assert cores.physical_cores([0, 9], sysfs) == [[0], [9]]
    # Two packages with the same core ids are different cores.
    sysfs = fake_sysfs(tmp_path / "two", {0: (0, 0), 1: (1, 0)})
    assert cores.physical_cores([0, 1], sysfs) == [[0], [1]]


@pytest.mark.parametrize("ncores,nlocal,expected", [
    (8, 2, [[0, 1, 2, 3], [4, 5, 6, 7]]),
    (8, 3, [[0, 1], [2, 3, 4], [5, 6, 7]]),  # every core used, shares differ by one at most
    (2, 2, [[0], [1]]),
    (3, 4, [None] * 4),  # fewer cores than workers: left to the kernel
    (8, 1, [None]),  # a lone worker keeps every core
])
def test_each_worker_takes_a_run_of_whole_cores(ncores, nlocal, expected):
    physical = [[c] for c in range(ncores)]
    assert [cores.share(physical, nlocal, k) for k in range(nlocal)] == expected


def test_a_core_s_threads_stay_with_one_worker():
    physical = [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert [cores.share(physical, 2, k) for k in range(2)] == [[0, 1, 4, 5], [2, 3, 6, 7]]


def _allowed(pid):
    with open(f"/proc/{pid}/status") as f:
        return next(line.split(":", 1)[1].strip() for line in f
                    if line.startswith("Cpus_allowed_list"))


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs")
@pytest.mark.parametrize("pin", ["1", "0"])
def test_a_runs_cpu_workers_are_pinned_apart_unless_told_not_to(pin, tmp_path):
    """python -m pympgu.train --cpu 2: each worker runs on its own share of the cores the
    launcher may use (PYMPGU_PIN_CPU_WORKERS=0: on all of them, as the launcher)."""
    out = tmp_path / "run"
    proc = start([sys.executable, "-m", "pympgu.train", "--cpu", "2", "--hidden", "16",
                  "--epochs", "100000", "--out", str(out)],
                 dict(os.environ, PYMPGU_PIN_CPU_WORKERS=pin))
    try:
        # Pinned before the model is built: once an epoch is done, they are.
        assert wait_until((out / "metrics.jsonl").exists, 90, every=0.05)
        workers = [int(p) for p in subprocess.run(
            ["pgrep", "-f", "-s", str(proc.pid), "spawn_main"], capture_output=True,
            text=True).stdout.split()]
        assert len(workers) == 2, workers
        allowed = sorted(_allowed(w) for w in workers)
    finally:
        kill_session(proc)
    expected = cores.share(cores.physical_cores(os.sched_getaffinity(0)), 2, 0)
    if pin == "1" and expected is not None:
        shares = [cores.share(cores.physical_cores(os.sched_getaffinity(0)), 2, k)
                  for k in range(2)]
        assert allowed == sorted(_ranges(s) for s in shares)
    else:
        assert allowed == [_allowed(os.getpid())] * 2


def _ranges(cpus):
    """CPUs as /proc writes them: 0-3,8."""
    out, run = [], [cpus[0], cpus[0]]
    for c in cpus[1:]:
        if c == run[1] + 1:
            run[1] = c
        else:
            out.append(run)
            run = [c, c]
    out.append(run)
    return ",".join(f"{a}" if a == b else f"{a}-{b}" for a, b in out)


def test_a_worker_counts_its_own_cpus(monkeypatch):
    """The threads of a CPU worker's copies: the CPUs it was pinned to, else its share."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)))
    monkeypatch.setattr(cores, "_pinned", None)
    assert [cores.own_cpus(n) for n in (1, 2, 3, 32)] == [16, 8, 5, 1]
    monkeypatch.setattr(cores, "_pinned", [4, 5, 6])
    assert cores.own_cpus(2) == 3
