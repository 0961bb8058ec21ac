"""``python -m pympgu.bench kills``: training that goes on without lost workers, measured.

Runs ``python -m pympgu.train --cpu N --min-workers M [--restart-workers R]`` (on
``--nnodes`` nodes of this host, over loopback) once undisturbed, then ``--runs`` times
with ``--kills`` workers killed (SIGKILL, at random moments of training, a random worker of
any node each time; with restarts, once the last one's replacement has joined), and prints
a table: every run's status, the time from each kill to the
survivors' next completed exchange (metrics.jsonl's membership record), the restarted
workers that joined, the final test error against the undisturbed run's, and what was left
behind (processes, /dev/shm)."""
import argparse
import glob
import json
import os
import random
import secrets
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time

from ..runtime import cores


def _workers(pid):
    """The launcher ``pid``'s worker processes (spawned children; not its resource tracker)."""
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            children = [int(c) for c in f.read().split()]
    except OSError:
        return []
    found = []
    for c in children:
        try:
            with open(f"/proc/{c}/cmdline", "rb") as f:
                if b"spawn_main" in f.read():
                    found.append(c)
        except OSError:
            pass
    return found


def _session_left(pid, wait=2.0):
    """How many processes of the run's session outlive it (after ``wait`` seconds: a
    multiprocessing resource tracker leaves a moment after its launcher)."""
    deadline = time.monotonic() + wait
    while True:
        out = subprocess.run(["ps", "-o", "pid=,args=", "-s", str(pid)], capture_output=True,
                             text=True).stdout.strip()
        if not out or time.monotonic() > deadline:
            return len(out.splitlines()), out
        time.sleep(0.1)


def _shm():
    return set(glob.glob("/dev/shm/pympgu-*"))


def _wait(done, timeout):
    deadline = time.monotonic() + timeout
    while not done() and time.monotonic() < deadline:
        time.sleep(0.1)


def _joined(metrics):
    """How many times metrics.jsonl says restarted workers joined (a GPU node's workers
    start again together: one time, several ranks)."""
    try:
        with open(metrics) as f:
            return sum(bool(json.loads(x).get("joined")) for x in f if '"joined"' in x)
    except (OSError, ValueError):
        return 0


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(args, out):
    """The run's launchers: one, or one a node (node 0's keeps ``out``)."""
    command = (shlex.split(args.command) if args.command else
               [sys.executable, "-m", "pympgu.train", "--cpu", str(args.cpu)])
    argv = command + ["--epochs", str(args.epochs), "--quiet", "--min-workers",
                      str(args.min_workers), "--restart-workers", str(args.restart_workers)]
    if args.data_dir:
        argv += ["--data-dir", args.data_dir]
    argv += shlex.split(args.train_flags)
    env = dict(os.environ)
    if args.nnodes > 1:
        env["PYMPGU_SECRET"] = secrets.token_hex(32)
        where = f"127.0.0.1:{_free_port()}"
    procs = []
    for k in range(args.nnodes):
        more = ["--out", out] if k == 0 else []
        if args.nnodes > 1:
            more += ["--nnodes", str(args.nnodes), "--node-rank", str(k), "--coordinator",
                     where]
        procs.append(subprocess.Popen(argv + more, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True, env=env,
                                      start_new_session=True,
                                      preexec_fn=cores.on_one_host(args.nnodes, k)))
    return procs


def _train(args, out, kills, rng):
    """One run with ``kills`` kills; returns its row."""
    before = _shm()
    t0 = time.time()
    procs = _start(args, out)
    proc = procs[0]
    killed = []
    try:
        # The first epoch's line says training is under way (compiled); then the kills.
        metrics = os.path.join(out, "metrics.jsonl")
        while proc.poll() is None and not os.path.exists(metrics):
            time.sleep(0.05)
        for _ in range(kills):
            time.sleep(rng.uniform(0.3, args.spacing))
            workers = [w for p in procs for w in _workers(p.pid)]
            if proc.poll() is not None or len(workers) <= args.min_workers:
                break
            victim = rng.choice(workers)
            killed.append(time.time())
            os.kill(victim, signal.SIGKILL)
            time.sleep(0.2)
            if args.restart_workers:
                # The next kill once its replacement has joined: kills faster than a new
                # worker compiles would take every worker of the run in the end.
                _wait(lambda: _joined(metrics) >= len(killed) or proc.poll() is not None,
                      120)
        ends = [p.communicate(timeout=600) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    status = max(p.returncode for p in procs)
    stderr = "\n".join(f"node {k}: {err[-2000:]}" for k, (_, err) in enumerate(ends)
                       if procs[k].returncode)
    records = [json.loads(x) for x in open(metrics)] if os.path.exists(metrics) else []
    changes = [r for r in records if r.get("event") == "membership"]
    epochs = [r for r in records if "event" not in r]
    # Each kill's recovery: the first record of a loss after it (none where the worker
    # killed was a restarted one that had not joined yet).
    losses = [c for c in changes if c["lost"]]
    recovery = [next((c["time"] - k for c in losses if c["time"] > k), None) for k in killed]
    return {"status": status, "kills": len(killed), "recovered": len(losses),
            "joined": sum(len(c.get("joined") or []) for c in changes),
            "recovery_s": recovery, "test_error": epochs[-1]["test_error"] if epochs else None,
            "seconds": time.time() - t0,
            "orphans": sum(_session_left(p.pid)[0] for p in procs),
            "shm_left": len(_shm() - before), "stderr": stderr}


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m pympgu.bench kills", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cpu", type=int, default=4, help="CPU workers a node (default: 4)")
    p.add_argument("--command", help="what trains instead of 'python -m pympgu.train --cpu "
                   "N', in one argument: GPU workers, e.g. 'python -m pympgu.train --gpus 0 "
                   "1' (or 'python benchmarks/two_on_one_gpu.py --gpus 0' for two a GPU)")
    p.add_argument("--nnodes", type=int, default=1,
                   help="nodes, each a launcher of this host on loopback (default: 1)")
    p.add_argument("--min-workers", type=int, default=1, help="(default: 1)")
    p.add_argument("--restart-workers", type=int, default=0, help="(default: 0)")
    p.add_argument("--runs", type=int, default=3, help="runs with kills (default: 3)")
    p.add_argument("--kills", type=int, default=3, help="kills a run (default: 3)")
    p.add_argument("--epochs", type=int, default=4, help="(default: 4)")
    p.add_argument("--spacing", type=float, default=3.0,
                   help="at most this many seconds between kills (default: 3)")
    p.add_argument("--data-dir", help="as pympgu.train's (default: the embedded MNIST)")
    p.add_argument("--train-flags", default="", metavar="FLAGS",
                   help="more of pympgu.train's flags for every run, in one argument (e.g. "
                   "'--across-nodes diloco --outer-every 50')")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write the rows here too")
    args = p.parse_args(argv)
    rng = random.Random(args.seed)
    rows = []
    with tempfile.TemporaryDirectory(prefix="pympgu-kills-") as tmp:
        base = _train(args, os.path.join(tmp, "base"), 0, rng)
        print(f"undisturbed: status {base['status']}, test error "
              f"{100 * base['test_error']:.2f}%, {base['seconds']:.1f} s", flush=True)
        for r in range(args.runs):
            row = _train(args, os.path.join(tmp, f"run{r}"), args.kills, rng)
            rows.append(row)
            times = ", ".join("-" if s is None else f"{s:.2f}" for s in row["recovery_s"])
            err = "-" if row["test_error"] is None else f"{100 * row['test_error']:.2f}%"
            print(f"run {r + 1}: status {row['status']}, {row['kills']} kills, recovered in "
                  f"[{times}] s, {row['joined']} joined, test error {err}, "
                  f"{row['orphans']} orphans, "
                  f"{row['shm_left']} /dev/shm left", flush=True)
            if row["status"] != 0:
                print(row["stderr"], file=sys.stderr)
    times = sorted(s for r in rows for s in r["recovery_s"] if s is not None)
    kills = sum(r["kills"] for r in rows)
    errors = [r["test_error"] for r in rows if r["test_error"] is not None]
    print("\n| workers | kills | runs ending 0 | losses recovered | kill to next exchange, "
          "median (max) | restarted and joined | test error, undisturbed | test error with "
          "kills, worst | orphans | /dev/shm left |\n|---|---|---|---|---|---|---|---|---|---|")
    median = times[len(times) // 2] if times else float("nan")
    worst = max(errors, key=lambda e: abs(e - base["test_error"]), default=float("nan"))
    workers = args.command or f"{args.cpu}"
    shape = f"{args.nnodes} x {workers}" if args.nnodes > 1 else workers
    shape += f" {args.train_flags}" if args.train_flags else ""
    print(f"| {shape} (min {args.min_workers}, {args.restart_workers} restarts) | {kills} | "
          f"{sum(r['status'] == 0 for r in rows)}/{len(rows)} | {len(times)}/{kills} | "
          f"{median:.2f} s ({max(times, default=float('nan')):.2f} s) | "
          f"{sum(r['joined'] for r in rows)} | "
          f"{100 * base['test_error']:.2f}% | "
          f"{100 * worst:.2f}% | "
          f"{sum(r['orphans'] for r in rows)} | {sum(r['shm_left'] for r in rows)} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "undisturbed": base, "runs": rows}, f, indent=1)
    return 0 if all(r["status"] == 0 for r in rows) else 1
