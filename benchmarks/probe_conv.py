"""Does PyTensor's JAX backend run a LeNet-style convolution on the GPU? Prints the answer."""
import os
import time

os.environ.setdefault("PYTENSOR_FLAGS", "floatX=float32")
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
import numpy as np  # noqa: E402
import pytensor  # noqa: E402
import pytensor.tensor as pt  # noqa: E402
from pytensor.tensor.conv import conv2d  # noqa: E402

x = pt.tensor("x", dtype="float32", shape=(256, 1, 28, 28))
w = pytensor.shared(np.random.default_rng(0).standard_normal((20, 1, 5, 5)).astype(np.float32))
y = pt.tanh(conv2d(x, w))
cost = y.sum()
g = pytensor.grad(cost, w)
try:
    f = pytensor.function([x], [y, g], mode="JAX")
    data = np.random.default_rng(1).standard_normal((256, 1, 28, 28)).astype(np.float32)
    out = f(data)
    t0 = time.perf_counter()
    for _ in range(20):
        out = f(data)
    out[0].block_until_ready()
    print("conv2d+grad under mode=JAX: output on", out[0].devices(), "shape", out[0].shape,
          f"{(time.perf_counter() - t0) / 20 * 1e3:.2f} ms/step")
except Exception as e:  # report, whatever it is
    print("conv2d under mode=JAX failed:", type(e).__name__, str(e)[:500])
