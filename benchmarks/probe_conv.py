"""Does PyTensor's JAX backend run a LeNet-style convolution on the GPU? Prints the answer.

PyTensor 3 has no nnet.conv2d (Theano's LeNet layer); its convolution is
pytensor.tensor.signal.convolve2d, batched by broadcasting. This builds a LeNet first layer
(20 5x5 filters over 28x28 images) and its gradient with it, under mode="JAX".
"""
import os
import time

os.environ.setdefault("PYTENSOR_FLAGS", "floatX=float32")
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
import numpy as np  # noqa: E402
import pytensor  # noqa: E402
import pytensor.tensor as pt  # noqa: E402
from pytensor.tensor.signal import convolve2d  # noqa: E402

x = pt.tensor("x", dtype="float32", shape=(256, 1, 28, 28))
w = pytensor.shared(np.random.default_rng(0).standard_normal((1, 20, 5, 5)).astype(np.float32))
y = pt.tanh(convolve2d(x, w, mode="valid"))  # (256, 20, 24, 24)
g = pytensor.grad(y.sum(), w)
try:
    f = pytensor.function([x], [y, g], mode="JAX")
    data = np.random.default_rng(1).standard_normal((256, 1, 28, 28)).astype(np.float32)
    out = f(data)
    t0 = time.perf_counter()
    for _ in range(20):
        out = f(data)
    out[0].block_until_ready()
    print("convolve2d+grad under mode=JAX: output on", out[0].devices(), "shape", out[0].shape,
          f"{(time.perf_counter() - t0) / 20 * 1e3:.2f} ms/step")
except Exception as e:  # report, whatever it is
    print("convolve2d under mode=JAX failed:", type(e).__name__, str(e)[:500])
