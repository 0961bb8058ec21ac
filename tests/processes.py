"""Helpers for tests that start launchers as processes of their own and kill them."""
import os
import signal
import socket
import subprocess
import time


def alive(pid):
    """Whether process ``pid`` runs (a zombie is dead for our purposes)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def wait_until(done, timeout, every=0.1):
    """Poll ``done()`` until it is true or ``timeout`` seconds pass; returns its last value."""
    deadline = time.monotonic() + timeout
    while not (value := done()) and time.monotonic() < deadline:
        time.sleep(every)
    return value


def start(argv, env=None):
    """A process leading a session of its own (so that its workers can be found, and
    killed, with it), its output captured as text."""
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, start_new_session=True)


def kill_session(proc):
    """SIGKILL whatever is left of ``proc``'s session."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)


def session_left(pid):
    """Processes still alive in the session ``pid`` led, as ps prints them ('' for none)."""
    return subprocess.run(["ps", "-o", "pid,args", "--no-headers", "-s", str(pid)],
                          capture_output=True, text=True).stdout.strip()


def free_port(pair=False, fixed=False):
    """A port free on loopback (and, with ``pair``, the next one too); with ``fixed``, one
    below the range that the kernel hands connections, which a flood of them cannot take."""
    import random
    while True:
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", random.randrange(20000, 30000) if fixed else 0))
            except OSError:
                continue
            port = s.getsockname()[1]
        if not pair:
            return port
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + 1))
                return port
            except OSError:
                continue


def communicate_all(procs, timeout=240):
    """(exit status, stdout, stderr) of every process, once each has ended; whatever is
    left of their sessions is killed even when one outlives ``timeout``."""
    out = []
    try:
        for p in procs:
            o, e = p.communicate(timeout=timeout)
            out.append((p.returncode, o, e))
    finally:
        for p in procs:
            kill_session(p)
    return out


NOBODY = 65534


def as_nobody(fn, *args):
    """``fn(*args)`` in a forked child running as uid and gid 65534: another local user's
    view of the machine (the caller must be root). Raises if it raised."""
    import traceback
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            fn(*args)
            code = 0
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise AssertionError(f"{getattr(fn, '__name__', fn)} failed as nobody")
