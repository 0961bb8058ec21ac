"""Without a usable GPU, pympgu imports, reports why, and raises CudaError instead of crashing."""
import pickle

import pytest

import pympgu
from standin import StandInGroup

pytestmark = pytest.mark.skipif(pympgu.cuda_available(), reason="a GPU is usable here")


def test_import_and_reason():
    reason = pympgu.cuda_unavailable_reason()
    assert reason and ("cuda" in reason.lower() or "gpu" in reason.lower())


@pytest.mark.parametrize("call", [
    lambda: pympgu.cuda.get_device_count(),
    lambda: pympgu.cuda.DeviceBuffer(1024),
    lambda: pympgu.cuda.PeerGroup(0, 2, 1024),
    lambda: pympgu.cuda.set_device(0),
])
def test_cuda_calls_raise_cuda_error(call):
    with pytest.raises(pympgu.CudaError) as info:
        call()
    err = info.value
    assert isinstance(err, RuntimeError)
    assert err.name.startswith(("cuda", "pmg")) and err.message
    assert err.name in str(err)
    again = pickle.loads(pickle.dumps(err))
    assert (again.status, again.name, again.message) == (err.status, err.name, err.message)


def test_a_capture_error_says_what_a_capture_takes():
    err = pympgu.CudaError(900, "cudaErrorStreamCaptureUnsupported", "operation not permitted "
                           "when stream is capturing", "rank 0 of 2")
    assert str(err).startswith("rank 0 of 2: cudaErrorStreamCaptureUnsupported (900): ")
    assert "synchronize=False" in str(err) and "ModelAverager" in str(err)
    assert "synchronize=False" not in str(pympgu.CudaError(2, "cudaErrorMemoryAllocation",
                                                           "out of memory"))


def test_device_count_is_zero_not_an_error():
    assert pympgu.cuda.device_count() == 0


def test_xla_operation_is_built_and_says_why_it_cannot_run():
    import importlib.util
    from pympgu import xla
    from pympgu.xla import ops
    try:
        from pympgu import _cuda
    except ImportError:
        pytest.skip("pympgu was built without CUDA")
    if importlib.util.find_spec("jaxlib") is not None:
        # Built with jaxlib installed (as CI does): the FFI handler must be compiled in.
        for name in _cuda.XLA_OPERATIONS:
            assert type(_cuda.xla_handler(name)).__name__ == "PyCapsule", name
    ok, why = xla.available()
    assert not ok and "GPU" in why
    with pytest.raises(RuntimeError, match="unavailable: no usable GPU"):
        ops.register()


def test_xla_average_checks_before_it_needs_a_gpu():
    from pympgu import xla

    class Group(StandInGroup):
        nbytes = 1024

    class Shaped:
        def __init__(self, *shape):
            self.shape, self.dtype = shape, "float32"

    assert xla.average([], Group()) == []
    with pytest.raises(ValueError, match="need 1280 bytes in the group's buffer, which holds 1024"):
        xla.average([Shaped(16, 16), Shaped(4)], Group())  # 1024 B + a 256 B-aligned slot
    with pytest.raises(ValueError, match="unsupported dtype"):
        xla.average([type("Int", (), {"shape": (4,), "dtype": "int32"})()], Group())
    with pytest.raises(ValueError, match="need 1280 bytes"):
        xla.average_during([Shaped(16, 16), Shaped(4)], Group(), lambda: None)
    assert xla.average_during([], Group(), lambda x: x + 1, 1) == ([], 2)
    with pytest.raises(ValueError, match="algo 'gather' is for float32 arrays averaged during"):
        xla.average([Shaped(4)], Group(), algo="gather")  # it has no single-operation form


def test_xla_average_keeps_jax_fast_dispatch(monkeypatch):
    # A jitted function with effects is dispatched through Python instead of JAX's C++ path,
    # which cost the fused training step host time worth most of a step. Tracing (no GPU
    # needed) shows whether average() adds an effect.
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    from pympgu import xla
    from pympgu.xla import ops

    Group = StandInGroup

    monkeypatch.setattr(ops, "register", lambda: None)
    jaxpr = jax.make_jaxpr(lambda a, b: xla.average([a * 2, b], Group()))(
        jnp.ones((4, 4)), jnp.ones(3))
    assert "ffi_call" in str(jaxpr)
    assert not jaxpr.effects
    # The overlapped pair: no effect either, and the work between start and done, held
    # there by optimization barriers.
    jaxpr = jax.make_jaxpr(lambda a, b: xla.average_during([a * 2], Group(), jnp.sin, b))(
        jnp.ones((4, 4)), jnp.ones(3))
    assert not jaxpr.effects
    order = [e.primitive.name for e in jaxpr.jaxpr.eqns if e.primitive.name != "mul"]
    assert order == ["ffi_call", "optimization_barrier", "sin", "optimization_barrier",
                     "ffi_call"], order
    # When fn reads only the averaged arrays, they are held: fn still follows the start.
    jaxpr = jax.make_jaxpr(lambda a: xla.average_during([a], Group(), jnp.sin, a))(jnp.ones(3))
    held = jaxpr.jaxpr.eqns[1]
    assert held.primitive.name == "optimization_barrier", jaxpr
    assert jaxpr.jaxpr.invars[0] in held.invars, held
    # The delayed correction: fused into the done operation by the gather algorithm (no
    # arithmetic after it), done by XLA after the averages with a kernel algorithm.
    for algo, tail in (("auto", []), ("oneshot", ["sub", "add"])):
        jaxpr = jax.make_jaxpr(lambda a, b: xla.correct_during(
            [a], Group(), lambda x: ([x * 3], jnp.sin(b)), a, algo=algo))(
            jnp.ones((4, 4)), jnp.ones(3))
        order = [e.primitive.name for e in jaxpr.jaxpr.eqns]
        assert order[-2 - len(tail):] == ["optimization_barrier", "ffi_call"] + tail, order
    with pytest.raises(ValueError, match="one array per averaged array"):
        jax.make_jaxpr(lambda a: xla.correct_during([a, a], Group(), lambda x: ([x], None), a))(
            jnp.ones(4))


def test_xla_timeline_marks_match_the_c_api():
    try:
        from pympgu import _cuda
    except ImportError:
        pytest.skip("pympgu was built without CUDA")
    assert len(_cuda.XLA_MARKS) == _cuda.XLA_MARK_COUNT


def test_barrier_watch_finds_a_peer_that_stopped():
    """PeerGroup's watchdog for stream barriers, its judgement alone: a peer behind but
    moving is never blamed; one that stays behind past the timeout is, and from then on the
    stream is let past every barrier it waits at."""
    try:
        from pympgu._cuda import BarrierWatch
    except ImportError:
        pytest.skip("pympgu was built without CUDA")
    w = BarrierWatch(rank=1, timeout=2.0)
    assert w.look([5, 5, 5], 0.0) == [] and w.look([6, 6, 6], 10.0) == []  # nobody waits
    # Rank 1 reached barrier 7; rank 0 announced 6, rank 2 7: rank 0 is late, and moves on.
    for t, flags in enumerate([[6, 7, 7], [6, 7, 7], [7, 8, 7], [7, 8, 7]]):
        assert w.look(flags, 1.5 * t) == [], (t, flags)
    assert w.late is None
    # Rank 2 stops at 7 while rank 1 waits at 9: found once 2 s have passed unchanged.
    assert w.look([9, 9, 7], 100.0) == [] and w.look([9, 9, 7], 102.0) == []
    assert w.look([9, 9, 7], 102.5) == [2] and w.late == 2
    # Failed: every late peer is let past at once, rank 0 too now.
    assert w.look([9, 10, 9], 102.6) == [0, 2] and w.late == 2
    # Numbers compare cyclically, as the stream's wait does.
    w = BarrierWatch(rank=0, timeout=0.0)
    assert w.look([1, 2**32 - 1], 0.0) == [] and w.look([1, 2**32 - 1], 1.0) == [1]
    assert BarrierWatch(0, 0.0).look([2**32 - 1, 1], 0.0) == []  # the peer is ahead
    # Closing after barrier 3 was queued: rank 0 announced 2, rank 2 already 4.
    assert BarrierWatch(1, 2.0).behind([2, 1, 4], 3) == [0]
    assert BarrierWatch(0, 2.0).behind([0, 2**32 - 1], 1) == [1]


def test_peer_group_handles_are_split_and_checked():
    """A PeerGroup's handle is its block's IPC handle, then its stream barrier flags' name:
    either every rank has flags or none, and a short handle is refused. A name is opened
    as a file: one not of pympgu's form, or not of the rank's prefix, is refused."""
    try:
        from pympgu._cuda._core import _split_handles
    except ImportError:
        pytest.skip("pympgu was built without CUDA")
    ipc = [bytes([r]) * 64 for r in range(3)]
    assert _split_handles(ipc, 3) == (ipc, None)
    names = [f"pympgu-7e57-{r}-flags-0a{r}" for r in range(3)]
    named = [h + n.encode() for h, n in zip(ipc, names)]
    prefixes = [f"pympgu-7e57-{r}-flags" for r in range(3)]
    assert _split_handles(named, 3) == (ipc, names)
    assert _split_handles(named, 3, prefixes) == (ipc, names)
    assert _split_handles(named[:1], 1) == (ipc[:1], None)  # one rank has no barriers
    with pytest.raises(ValueError, match="stream_barriers alike.*rank 0: on, "
                                         "rank 1: off, rank 2: on"):
        _split_handles([named[0], ipc[1], named[2]], 3)
    with pytest.raises(ValueError, match="at least 64 bytes, got 63"):
        _split_handles([ipc[0], ipc[1][:63]], 2)
    for bad in (b"/etc/passwd", b"../../etc/shadow", b"pympgu-7e57-1-flags/../../x",
                "pympgu-7e57-1-flags-\u00e9".encode()):
        with pytest.raises(ValueError, match="refused the shared-memory name"):
            _split_handles([named[0], ipc[1] + bad, named[2]], 3)
    with pytest.raises(ValueError, match="not this run's \\(pympgu-7e57-1-flags\\)"):
        _split_handles([named[0], ipc[1] + names[2].encode(), named[2]], 3, prefixes)


def test_host_flags_that_cannot_be_registered_leave_nothing():
    """Without a driver the flags page cannot be page-locked: CUDA's error, and no segment
    left in /dev/shm."""
    try:
        from pympgu._cuda._core import HostFlags, _flags_name
    except ImportError:
        pytest.skip("pympgu was built without CUDA")
    import os
    name = _flags_name()
    assert name.startswith(f"pympgu-flags-{os.getpid()}-") and name != _flags_name()
    assert _flags_name("pympgu-7e57-1-flags").startswith("pympgu-7e57-1-flags-")
    with pytest.raises(pympgu.CudaError) as info:
        HostFlags(name, create=True)
    assert info.value.message
    assert not os.path.exists(f"/dev/shm/{name}")


def test_python_m_pympgu_reports_what_this_installation_can_do():
    import subprocess
    import sys
    r = subprocess.run([sys.executable, "-m", "pympgu"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    lines = r.stdout.splitlines()
    assert lines[0].startswith(f"pympgu {pympgu.__version__} (")
    assert f"CUDA: not usable: {pympgu.cuda_unavailable_reason()}" in r.stdout
    assert "python -m pympgu.train --help" in r.stdout
    import importlib.util
    torch = importlib.util.find_spec("torch") is not None
    assert ("PyTorch, DDP's hook and ModelAverager (pympgu.ddp): "
            + ("torch installed" if torch else "needs torch (not installed)")) in r.stdout


def test_python_m_pympgu_names_a_build_without_the_xla_operation(monkeypatch):
    # The state an isolated `pip install .` leaves: no jaxlib at build time, so no XLA
    # operation, and GPU training queues its exchanges from Python.
    from pympgu import __main__ as main
    from pympgu import cuda
    if cuda._cuda is None:
        pytest.skip("pympgu was built without CUDA")
    monkeypatch.setattr(cuda._cuda, "xla_handler", lambda *a: None)
    assert "no: pympgu was built without jaxlib's XLA FFI headers" in main._xla_state(True)
    assert "--no-build-isolation" in main._xla_state(False)
    monkeypatch.undo()
    if cuda._cuda.xla_handler() is not None:
        assert main._xla_state(False) == "built in; it needs a GPU"
