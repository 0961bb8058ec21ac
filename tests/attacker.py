"""A local process that knows everything about a run but its secret, and tries to steer it.

    python tests/attacker.py TARGET VICTIM SECONDS [NRANKS] [FLOOD]

Run as another user where the tests run as root (it drops to nobody). TARGET is
``tcp://HOST:PORT`` (node 0's port), or ``runs``: the control socket of every run it finds
in the temporary directory. For SECONDS it watches /dev/shm for the run's names and tries
to read them, and sends TARGET, from the first moment: forged HELLO, METRIC (an epoch 999
line), ERROR (terminal escapes), BARRIER and REGISTER (naming VICTIM, a file it wants
written) for every rank, sealed as the protocol says but under secrets of its own; 10,000
fuzzed messages; 1,000 connections of one message each; one message of 128 frames of
1 MiB; on TCP, FLOOD idle connections held open. It prints what it did, and when it had
done all but the forgeries (phases_done_at), as JSON on its last line.
"""
import encodings.idna  # noqa: F401 (sockets need it, and nobody cannot read it later)
import glob
import json
import os
import random
import socket
import sys
import tempfile
import time

import zmq

from pympgu.runtime import protocol


def forge(kind, rank, seq, payload, blobs=()):
    """A message as the workers seal them, under a secret that is not the run's."""
    return protocol.seal(os.urandom(protocol.SECRET_BYTES), b"C", kind, rank, seq, payload,
                         blobs)


def forged(nranks, run_ids, victim):
    epoch = {"kind": "epoch", "epoch": 999, "loss": 0.0, "valid_error": 0.0,
             "test_error": 0.0, "samples_per_s": 1.0, "exchange_share": 0.0, "lr": 1.0}
    for rank in range(nranks):
        for seq in (1, 2, 10 ** 9):
            yield forge("HELLO", rank, seq, {"version": protocol.PROTOCOL_VERSION, "pid": 1,
                                             "device": None})
            yield forge("METRIC", rank, seq, epoch)
            yield forge("ERROR", rank, seq, {"traceback": "\x1b[2J\x1b[31mpwned\x07",
                                             "message": None})
            yield forge("BARRIER", rank, seq, {"seq": 1, "what": None, "value": None,
                                               "shared": True, "local": False,
                                               "gather": False})
            yield forge("HEARTBEAT", rank, seq, {})
            yield forge("JOIN", rank, seq, {"version": protocol.PROTOCOL_VERSION, "pid": 1,
                                            "host": "evil", "nlocal": 1})
            for name in [victim, "../.." + victim] + [f"pympgu-{i}-{rank}" for i in run_ids]:
                yield forge("REGISTER", rank, seq, {"layout": [], "facts": {}},
                            [name.encode()])


def fuzz(rng, nranks):
    """A random message: random frames, or a sealed one with a byte flipped."""
    if rng.random() < 0.5:
        return [rng.randbytes(rng.randrange(0, 300)) for _ in range(rng.randrange(0, 14))]
    kind = rng.choice(sorted(protocol.TO_COORDINATOR))
    frames = forge(kind, rng.randrange(-1, nranks + 1), rng.randrange(0, 2 ** 40),
                   {"rank": 0, "x": rng.random()})
    i = rng.randrange(len(frames))
    if frames[i]:
        b = bytearray(frames[i])
        b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
        frames[i] = bytes(b)
    return frames


def targets(target, done):
    """The endpoints to attack now."""
    if target != "runs":
        return [target]
    found = []
    for directory in glob.glob(os.path.join(tempfile.gettempdir(), "pympgu-*")):
        path = os.path.join(directory, "control")
        if directory not in done["dirs_seen"]:
            done["dirs_seen"].append(directory)
            try:  # a plain Unix connection, as anyone could try
                with socket.socket(socket.AF_UNIX) as s:
                    s.connect(path)
                done["ipc_connected"] += 1
            except OSError:
                done["ipc_refused"] += 1
        found.append(f"ipc://{path}")
    return found


def flood(host, port, n, held):
    """Open ``n`` more idle TCP connections (as many as the attacker's own limit allows)."""
    for _ in range(n):
        try:
            s = socket.create_connection((host, port), timeout=2)
        except OSError:
            return
        s.setblocking(False)
        held.append(s)


def closed(held):
    """How many of the held connections the other end has closed."""
    n = 0
    for s in held:
        try:
            while s.recv(1 << 16):  # the server's greeting, then its end
                pass
            n += 1
        except BlockingIOError:
            pass
        except OSError:
            n += 1
    return n


def look_at_shm(done, run_ids):
    """What /dev/shm shows of the run: names, and (it must not) their contents."""
    for name in os.listdir("/dev/shm"):
        if name.startswith("pympgu-") and name not in done["names_seen"]:
            done["names_seen"].append(name)
            run_id = name.split("-")[1]
            if run_id not in run_ids:
                run_ids.insert(0, run_id)
            try:
                with open(os.path.join("/dev/shm", name), "rb") as f:
                    f.read(16)
                done["names_read"] += 1
            except OSError:
                pass


def next_phase(zctx, sock, address, rng, nranks, done):
    """One turn of the phase under way at ``address``: fuzz 10,000 messages, then open and
    close 1,000 connections that say HELLO, then send one message of 128 MiB."""
    if done["fuzzed"] < 10000:
        for _ in range(500):
            frames = fuzz(rng, nranks)
            if frames:
                try:
                    sock.send_multipart(frames, zmq.NOBLOCK)
                except zmq.Again:
                    pass
                done["fuzzed"] += 1
    elif done["connections"] < 1000:
        for _ in range(100):
            s = zctx.socket(zmq.DEALER)
            s.connect(address)
            s.send_multipart(forge("HELLO", 1, 1, {
                "version": protocol.PROTOCOL_VERSION, "pid": 1, "device": None}), zmq.NOBLOCK)
            s.close(0)
            done["connections"] += 1
    elif not done["big"]:
        big = zctx.socket(zmq.DEALER)
        big.connect(address)
        big.send_multipart([b"REGISTER 0 1", b"{}", *[b"x" * (1 << 20)] * 128, b"y" * 32],
                           zmq.NOBLOCK)
        time.sleep(0.5)
        big.close(0)
        done["big"] = 1
        done["phases_done_at"] = time.time()


def at_the_port(address, rng, nflood, held, done):
    """A TCP target's raw bytes, and its idle connections up to ``nflood``."""
    host, port = address[6:].rsplit(":", 1)
    try:
        with socket.create_connection((host, int(port)), timeout=1) as raw:
            raw.sendall(b"GET / HTTP/1.0\r\n\r\n" + rng.randbytes(64))
        done["raw"] += 1
    except OSError:
        pass
    if len(held) < nflood:
        flood(host, int(port), min(500, nflood - len(held)), held)
        done["flood"] = len(held)


def main():
    target, victim, seconds = sys.argv[1], sys.argv[2], float(sys.argv[3])
    nranks = int(sys.argv[4]) if len(sys.argv) > 4 else 2
    nflood = int(sys.argv[5]) if len(sys.argv) > 5 else 0
    if os.geteuid() == 0:  # another user's view of the machine
        os.setgid(65534)
        os.setuid(65534)
    rng = random.Random(1234)
    zctx = zmq.Context()
    zctx.setsockopt(zmq.LINGER, 0)
    done = {"uid": os.geteuid(), "forged": 0, "fuzzed": 0, "connections": 0, "big": 0,
            "raw": 0, "names_seen": [], "names_read": 0, "dirs_seen": [], "ipc_connected": 0,
            "ipc_refused": 0, "flood": 0, "flood_closed": 0}
    run_ids, socks, held = [], {}, []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        look_at_shm(done, run_ids)
        for address in targets(target, done):
            if address not in socks:
                socks[address] = zctx.socket(zmq.DEALER)
                socks[address].setsockopt(zmq.SNDHWM, 100000)
                socks[address].connect(address)
            for frames in forged(nranks, run_ids, victim):
                try:
                    socks[address].send_multipart(frames, zmq.NOBLOCK)
                    done["forged"] += 1
                except zmq.Again:
                    pass
            next_phase(zctx, socks[address], address, rng, nranks, done)
            if address.startswith("tcp://"):
                at_the_port(address, rng, nflood, held, done)
        time.sleep(0.01)
    done["flood_closed"] = closed(held)
    for s in held:
        s.close()
    for s in socks.values():
        s.close(0)
    zctx.term()
    print(json.dumps(done))


if __name__ == "__main__":
    main()
