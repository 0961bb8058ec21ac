"""Which cores a node's CPU workers run on: each its own share of the launcher's.

Each CPU worker's XLA sizes its thread pool to the cores it may run on. Left to all of
them, L workers of a node run L pools over the same cores, and their steps contend
(docs/DECISIONS.md, "CPU workers on cores of their own"). A worker is pinned, before JAX
starts, to 1/L of the physical cores it was allowed, whole cores at a time (a core's
hyperthreads go together), in local rank order.
"""
import os

SYSFS = "/sys/devices/system/cpu"


def physical_cores(cpus, sysfs=SYSFS):
    """``cpus`` (logical CPU numbers) grouped by physical core, in order of each core's
    first CPU; a CPU whose topology sysfs does not say is a core of its own."""
    groups = {}
    for cpu in sorted(cpus):
        try:
            with open(f"{sysfs}/cpu{cpu}/topology/physical_package_id") as f:
                package = f.read().strip()
            with open(f"{sysfs}/cpu{cpu}/topology/core_id") as f:
                key = (package, f.read().strip())
        except OSError:
            key = ("cpu", cpu)
        groups.setdefault(key, []).append(cpu)
    return list(groups.values())


def share(cores, nlocal, local_rank):
    """Local rank ``local_rank``'s CPUs of ``cores`` (physical cores, each a list of
    CPUs) split among ``nlocal`` workers: a run of whole cores, the first ranks taking
    one more where they do not divide; None where there are fewer cores than workers
    (two workers would share one either way: the kernel places them better)."""
    if nlocal < 2 or len(cores) < nlocal:
        return None
    lo = local_rank * len(cores) // nlocal
    hi = (local_rank + 1) * len(cores) // nlocal
    return sorted(cpu for core in cores[lo:hi] for cpu in core)


def pin(nlocal, local_rank):
    """Pin this process to its share (``share``) of the CPUs it may run on now; returns
    them, or None where it is left as it was (PYMPGU_PIN_CPU_WORKERS=0, among others)."""
    from .. import settings
    if not hasattr(os, "sched_getaffinity") or not settings.get().pin_cpu_workers:
        return None
    global _pinned
    mine = share(physical_cores(os.sched_getaffinity(0)), nlocal, local_rank)
    if mine is not None:
        os.sched_setaffinity(0, mine)
        _pinned = mine
    return mine


_pinned = None


def own_cpus(nlocal):
    """How many CPUs this worker of ``nlocal`` may count as its own: those it was pinned
    to (pin), else its share of those it may run on."""
    if _pinned is not None:
        return len(_pinned)
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1
    return max(1, cpus // nlocal)


def on_one_host(nnodes, node):
    """For a node's launcher started beside the others on one host (a benchmark's, a
    test's): Popen's preexec_fn that gives it its share of this process's cores, which its
    workers then share out."""
    return lambda: pin(nnodes, node)
