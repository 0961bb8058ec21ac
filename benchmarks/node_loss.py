"""A node lost and the others going on: 2 nodes of CPU workers on this host, --min-workers,
node 1's launcher (or one of its workers) killed once node 0 has checkpointed an epoch (with
``rejoin``: its launcher, then started again once node 0 goes on alone); a table of the
seconds from the kill to node 0's next completed exchange (and from the new start to the
join, and the others' pause for it), the statuses, the final test error against an
undisturbed run, and what was left behind (``--gpu``: GPU workers).

    python benchmarks/node_loss.py --data-dir /usr/share/datasets/fashion-mnist --runs 3

Loopback, not a network: the time is node 0's node timeout (5 s of silence) for a launcher,
or the worker's death reaching node 0 through node 1's launcher, plus the recovery."""
import argparse
import glob
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

import pympgu
from pympgu.runtime import cores


def _port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(args, out, victim):
    """One run; returns (seconds from the kill to the next exchange, node 0's status, node
    1's, the last test error, orphans, names left in /dev/shm)."""
    home = os.path.dirname(os.path.dirname(pympgu.__file__))  # (the GPU script's pympgu)
    env = dict(os.environ, PYMPGU_SECRET=os.urandom(16).hex(),
               PYTHONPATH=os.pathsep.join([home, os.environ.get("PYTHONPATH", "")]))
    port = _port()
    before = set(glob.glob("/dev/shm/pympgu-*"))
    shared = os.path.join(os.path.dirname(os.path.abspath(__file__)), "two_on_one_gpu.py")
    workers = ([shared, "--gpus", "0", "--across-nodes", "diloco", "--outer-every", "10"]
               if args.gpu else ["-m", "pympgu.train", "--cpu", str(args.cpu)])
    base = [sys.executable, *workers, "--nnodes", "2",
            "--coordinator", f"127.0.0.1:{port}", "--epochs", str(args.epochs), "--quiet",
            *(["--data-dir", args.data_dir] if args.data_dir else []),
            *(["--min-workers", str(2 if args.gpu else args.cpu)] if victim else [])]
    def node(k):
        return subprocess.Popen(base + ["--node-rank", str(k)] + (["--out", out] if k == 0
                                                                  else []),
                                env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                text=True, start_new_session=True,
                                preexec_fn=cores.on_one_host(2, k))
    procs = [node(k) for k in range(2)]
    metrics = os.path.join(out, "metrics.jsonl")
    killed = again = None
    try:
        if victim:
            while not os.path.exists(os.path.join(out, "checkpoint.npz")):
                time.sleep(0.02)
            target = procs[1].pid
            if victim == "worker":
                target = int(subprocess.run(["pgrep", "-f", "-s", str(procs[1].pid),
                                             "spawn_main"], capture_output=True,
                                            text=True).stdout.split()[-1])
            killed = time.time()
            os.kill(target, signal.SIGKILL)
        if victim == "rejoin":  # started again once node 0 goes on alone
            while not (os.path.exists(metrics) and '"membership"' in open(metrics).read()):
                time.sleep(0.02)
            procs[1].wait()
            again = time.time()
            procs.append(node(1))
        codes = [p.wait(timeout=3600) for p in procs]
        codes = [codes[0], codes[-1]]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    records = [json.loads(x) for x in open(os.path.join(out, "metrics.jsonl"))]
    change = next((r for r in records if r.get("event") == "membership"), None)
    seconds = change["time"] - killed if change and killed else None
    join = next((r for r in records if r.get("joined")), None)
    joined = (join["time"] - again, join["seconds"]) if join and again else None
    def left():  # processes of either session still alive (a moment allowed to exit)
        return sum(bool(subprocess.run(["ps", "-o", "pid=", "-s", str(p.pid)],
                                       capture_output=True, text=True).stdout.strip())
                   for p in procs)
    deadline = time.monotonic() + 5
    while left() and time.monotonic() < deadline:
        time.sleep(0.1)
    epochs = [r for r in records if "test_error" in r]
    return (seconds, joined, codes[0], codes[1], epochs[-1]["test_error"], left(),
            len(set(glob.glob("/dev/shm/pympgu-*")) - before))


def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data-dir")
    p.add_argument("--cpu", type=int, default=2, help="workers a node (default: 2)")
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--runs", type=int, default=3, help="runs of each victim")
    p.add_argument("--victims", nargs="+", default=["launcher", "worker", "rejoin"])
    p.add_argument("--gpu", action="store_true",
                   help="two GPU workers a node sharing GPU 0 (a lost worker takes its node "
                        "with it), DiLoCo every 10 steps between the nodes")
    args = p.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="pympgu-node-loss-") as tmp:
        plans = [None] + [v for v in args.victims for _ in range(args.runs)]
        for k, victim in enumerate(plans):
            row = run(args, os.path.join(tmp, str(k)), victim)
            rows.append((victim or "none (undisturbed)", *row))
            print(rows[-1], flush=True)
    print("\n| killed | kill to node 0's next exchange | started again to joined (the "
          "others' pause) | node 0's status | node 1's | test error | orphans | /dev/shm "
          "left |")
    print("|---|---|---|---|---|---|---|---|")
    for victim, seconds, joined, c0, c1, err, left, shm in rows:
        join = "-" if joined is None else f"{joined[0]:.2f} s ({joined[1]:.2f} s)"
        print(f"| {victim} | {'-' if seconds is None else f'{seconds:.2f} s'} | {join} | "
              f"{c0} | {c1} | {100 * err:.2f}% | {left} | {shm} |")


if __name__ == "__main__":
    main()
