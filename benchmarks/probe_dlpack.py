"""Which host calls between JAX and pympgu block until the GPU catches up?

    python benchmarks/probe_dlpack.py        # one GPU, JAX and pympgu installed

A long JAX computation (or a long chain of pympgu kernels) is queued, then one call is
timed on the host: a call that returns in microseconds does not wait for the GPU; one that
takes as long as the queued work does. It also checks that an imported pympgu buffer is
read only after the pympgu work queued before the import (the DLPack stream handshake).
"""
import os
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from pympgu import cuda  # noqa: E402


def timed(f):
    t0 = time.perf_counter()
    r = f()
    return r, 1e3 * (time.perf_counter() - t0)


def main():
    dev = jax.devices("gpu")[0]
    cuda.set_device(dev.local_hardware_id if hasattr(dev, "local_hardware_id") else dev.id)
    a = jax.device_put(np.full((8192, 8192), 0.5, np.float32), dev)

    @jax.jit
    def slow(a):
        for _ in range(30):
            a = jnp.tanh(a @ a * 1e-4)
        return a

    _, ms_slow = timed(lambda: slow(a).block_until_ready())
    _, ms_slow = timed(lambda: slow(a).block_until_ready())
    print(f"the queued JAX work takes {ms_slow:.2f} ms on the GPU")
    s = cuda.Stream()
    plus1 = jax.jit(lambda y: y + 1)
    rows = []
    for name, call in [
            ("x.__dlpack__(stream=pympgu's)", lambda x: x.__dlpack__(stream=s.ptr)),
            ("x.__dlpack__()", lambda x: x.__dlpack__()),
            ("x.__cuda_array_interface__", lambda x: x.__cuda_array_interface__),
            ("x.unsafe_buffer_pointer()", lambda x: x.unsafe_buffer_pointer()),
            ("cuda.array_info(x, stream=pympgu's)", lambda x: cuda.array_info(x, "x", s)),
            ("jitted x + 1 (dispatch)", plus1)]:
        call(slow(a))  # warm (compiles the jitted call)
        jax.block_until_ready(a)
        x, ms_dispatch = timed(lambda: slow(a))
        _, ms = timed(lambda: call(x))
        x.block_until_ready()
        rows.append((name, ms_dispatch, ms))
    # The import direction: pympgu work queued on its stream, then jax.dlpack.from_dlpack.
    n = 1 << 28  # 1 GiB of float32
    buf = cuda.DeviceBuffer(4 * n)
    other = cuda.DeviceBuffer(4 * n)
    v = buf.view("float32", (n,), 0, s)
    w = other.view("float32", (n,), 0, s)
    for trial in range(2):
        v.copy_from_host(np.ones(n, np.float32))
        w.copy_from_host(np.full(n, 3.0, np.float32))
        for _ in range(40):  # about 40 ms of kernels that leave v unchanged (mean of v, v)
            cuda.average([v, v], out=v, stream=s, synchronize=False)
        cuda.average([v, w], out=v, stream=s, synchronize=False)  # v becomes 2.0
        imported, ms_import = timed(lambda: jax.dlpack.from_dlpack(v))
        m, ms_use = timed(lambda: jnp.min(imported))
        got = float(m)
        s.synchronize()
    rows.append(("jax.dlpack.from_dlpack(pympgu view)", float("nan"), ms_import))
    rows.append(("jnp.min(imported) (dispatch)", float("nan"), ms_use))
    print(f"{'host call, with the GPU busy':<40} {'dispatch ms':>12} {'call ms':>9}")
    for name, d, ms in rows:
        print(f"{name:<40} {d:12.3f} {ms:9.3f}")
    print(f"imported buffer read after pympgu's queued work: min {got} "
          f"({'ordered' if got == 2.0 else 'NOT ORDERED: read too early'})")


if __name__ == "__main__":
    main()
