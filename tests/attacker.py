"""A local process that knows everything about a run but its secret, and tries to steer it.

    python tests/attacker.py PORT VICTIM SECONDS [NRANKS]

Run as another user where the tests run as root (it drops to nobody). For SECONDS it
watches /dev/shm for the run's names, and sends the coordinator at 127.0.0.1:PORT, from
the first moment: forged HELLO, METRIC (an epoch 999 line), ERROR (terminal escapes),
BARRIER and REGISTER (naming VICTIM, a file it wants written) for every rank, sealed as
the protocol says but under secrets of its own; the previous protocol's messages; 10,000
fuzzed messages; 1,000 connections of one message each; one 100 MB frame. It prints what
it did, and when it had done all but the forgeries (phases_done_at), as JSON on its last
line.
"""
import encodings.idna  # noqa: F401 (sockets need it, and nobody cannot read it later)
import json
import os
import random
import socket
import sys
import time

import zmq

from pympgu import control


def forge(kind, rank, seq, payload, blobs=()):
    """A message as the workers seal them, under a secret that is not the run's."""
    return control.seal(os.urandom(control.SECRET_BYTES), b"C", kind, rank, seq, payload,
                        blobs)


def forged(nranks, run_ids, victim):
    epoch = {"kind": "epoch", "epoch": 999, "loss": 0.0, "valid_error": 0.0,
             "test_error": 0.0, "samples_per_s": 1.0, "exchange_share": 0.0, "lr": 1.0}
    for rank in range(nranks):
        for seq in (1, 2, 10 ** 9):
            yield forge("HELLO", rank, seq, {"version": control.PROTOCOL_VERSION, "pid": 1,
                                             "device": None})
            yield forge("METRIC", rank, seq, epoch)
            yield forge("METRIC", rank, seq, {"kind": "epoch"})  # a malformed one
            yield forge("ERROR", rank, seq, {"traceback": "\x1b[2J\x1b[31mpwned\x07"})
            yield forge("BARRIER", rank, seq, {"seq": 1, "what": None, "value": None,
                                               "shared": True})
            yield forge("HEARTBEAT", rank, seq, {})
            for name in [victim, "../.." + victim] + [f"pympgu-{i}-{rank}" for i in run_ids]:
                yield forge("REGISTER", rank, seq, {"layout": [], "facts": {}},
                            [name.encode()])
        # The previous protocol: [token, kind, JSON payload, blobs...]
        token = (run_ids[0] if run_ids else "0" * 32).encode()
        yield [token, b"HELLO", json.dumps({"rank": rank, "version": 1}).encode()]
        yield [token, b"METRIC", json.dumps({"rank": rank, **epoch}).encode(), b""]


def fuzz(rng, nranks):
    """A random message: random frames, or a sealed one with a byte flipped."""
    if rng.random() < 0.5:
        return [rng.randbytes(rng.randrange(0, 300)) for _ in range(rng.randrange(0, 14))]
    kind = rng.choice(sorted(control.TO_COORDINATOR))
    frames = forge(kind, rng.randrange(-1, nranks + 1), rng.randrange(0, 2 ** 40),
                   {"rank": 0, "x": rng.random()})
    i = rng.randrange(len(frames))
    if frames[i]:
        b = bytearray(frames[i])
        b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
        frames[i] = bytes(b)
    return frames


def main():
    port, victim, seconds = int(sys.argv[1]), sys.argv[2], float(sys.argv[3])
    nranks = int(sys.argv[4]) if len(sys.argv) > 4 else 2
    if os.geteuid() == 0:  # another user's view of the machine
        os.setgid(65534)
        os.setuid(65534)
    address = f"tcp://127.0.0.1:{port}"
    rng = random.Random(1234)
    zctx = zmq.Context()
    zctx.setsockopt(zmq.LINGER, 0)
    done = {"uid": os.geteuid(), "forged": 0, "fuzzed": 0, "connections": 0, "big": 0,
            "raw": 0, "names_seen": [], "names_read": 0}
    run_ids = []
    main_sock = zctx.socket(zmq.DEALER)
    main_sock.setsockopt(zmq.SNDHWM, 100000)
    main_sock.connect(address)
    deadline = time.monotonic() + seconds
    steps = 0
    while time.monotonic() < deadline:
        steps += 1
        # What /dev/shm shows of the run: names, and (it must not) their contents.
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
        for frames in forged(nranks, run_ids, victim):
            main_sock.send_multipart(frames)
            done["forged"] += 1
        if done["fuzzed"] < 10000:
            for _ in range(500):
                frames = fuzz(rng, nranks)
                if frames:
                    main_sock.send_multipart(frames)
                    done["fuzzed"] += 1
        elif done["connections"] < 1000:
            for _ in range(100):
                s = zctx.socket(zmq.DEALER)
                s.connect(address)
                s.send_multipart(forge("HELLO", 1, 1, {"version": control.PROTOCOL_VERSION,
                                                       "pid": 1, "device": None}))
                s.close(0)
                done["connections"] += 1
        elif not done["big"]:
            big = zctx.socket(zmq.DEALER)
            big.connect(address)
            big.send_multipart([b"METRIC 0 1", b"x" * (100 << 20), b"y" * 32])
            time.sleep(0.5)
            big.close(0)
            done["big"] = 1
            done["phases_done_at"] = time.time()
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1) as raw:
                raw.sendall(b"GET / HTTP/1.0\r\n\r\n" + rng.randbytes(64))
            done["raw"] += 1
        except OSError:
            pass
        time.sleep(0.01)
    main_sock.close(0)
    zctx.term()
    print(json.dumps(done))


if __name__ == "__main__":
    main()
