"""Convolution and pooling layers for pympgu models, on CPUs and on GPUs.

Theano's LeNet layer was ``nnet.conv2d``. PyTensor dropped it, and its own convolution
(``pytensor.tensor.signal.convolve2d``, one channel at a time, by scipy) has no JAX
conversion, so a convnet could not train on GPUs (``benchmarks/probe_conv.py``). ``conv2d``
here is one PyTensor Op, with its two gradients as Ops: numpy on PyTensor's own CPU
backends (Numba, C, Python; CPU workers), XLA's convolution (cuDNN on GPUs) under the JAX
backend. ``max_pool_2d`` is built from reshape and max, which every backend already has.

Both work on NCHW images: (batch, channels, rows, columns).
"""
import importlib.util
import warnings

import numpy as np

from pympgu.models import import_pytensor

import_pytensor()  # floatX before PyTensor's first import
import pytensor.tensor as pt  # noqa: E402
from pytensor.compile.sharedvalue import SharedVariable  # noqa: E402
from pytensor.gradient import grad_not_implemented  # noqa: E402
from pytensor.graph.basic import Apply  # noqa: E402
from pytensor.graph.op import Op  # noqa: E402


# PyTensor's Numba backend (its default CPU linker in 3.x) runs perform in Numba's object
# mode and warns once per Op; perform is numpy calling BLAS already, so the warning says
# nothing a user can act on.
warnings.filterwarnings("ignore", message=r"Numba will use object mode to run Conv2d")


def _pad(x, padding):
    ph, pw = padding
    return np.pad(x, ((0, 0), (0, 0), (ph, ph), (pw, pw))) if ph or pw else x


def _windows(x, kh, kw):
    """Every (kh, kw) window of x (b, c, h, w), as a view (b, c, oh, ow, kh, kw)."""
    return np.lib.stride_tricks.sliding_window_view(x, (kh, kw), axis=(2, 3))


def correlate(x, w, padding=(0, 0)):
    """numpy's y[b, f, i, j] = sum over c, k, l of xp[b, c, i + k, j + l] * w[f, c, k, l],
    xp being x zero-padded by ``padding`` (rows, columns) on each side."""
    y = np.tensordot(_windows(_pad(x, padding), *w.shape[2:]), w, axes=([1, 4, 5], [1, 2, 3]))
    return np.ascontiguousarray(y.transpose(0, 3, 1, 2))


def correlate_grad_w(x, gy, kernel, padding=(0, 0)):
    """The gradient of correlate's w, (f, c, kh, kw), for the gradient gy of its output."""
    return np.tensordot(gy, _windows(_pad(x, padding), *kernel), axes=([0, 2, 3], [0, 2, 3]))


def correlate_grad_x(w, gy, image, padding=(0, 0)):
    """The gradient of correlate's x, (b, c, h, w), for the gradient gy of its output: each
    output's share of every filter tap, added back where that tap read (col2im), less the
    padding."""
    kh, kw = w.shape[2:]
    b, _, oh, ow = gy.shape
    # (c, kh, kw, b, oh, ow): one product for every tap, then kh * kw sums of contiguous
    # slabs, several times quicker than correlating the padded gy with the turned
    # filters, whose windows numpy must copy.
    taps = np.tensordot(w, gy, axes=([0], [1]))
    gxp = np.zeros((w.shape[1], b, oh + kh - 1, ow + kw - 1), taps.dtype)
    for dy in range(kh):
        for dx in range(kw):
            gxp[:, :, dy:dy + oh, dx:dx + ow] += taps[:, dy, dx]
    gxp = gxp.transpose(1, 0, 2, 3)
    ph, pw = padding
    return np.ascontiguousarray(gxp[:, :, ph:ph + image[0], pw:pw + image[1]])


def _correlate_jax(x, w, padding):
    from jax import lax
    ph, pw = padding
    return lax.conv_general_dilated(x, w, (1, 1), ((ph, ph), (pw, pw)),
                                    dimension_numbers=("NCHW", "OIHW", "NCHW"))


def _as_images(name, v, dtype=None):
    v = pt.as_tensor_variable(v)
    if v.type.ndim != 4:
        raise ValueError(f"conv2d: {name} must be 4-d (NCHW images, OIHW filters), got "
                         f"{v.type.ndim}-d {v.type}")
    if dtype is not None and v.type.dtype != dtype:
        raise TypeError(f"conv2d: {name} is {v.type.dtype} but the images are {dtype}; "
                        "give both the same float dtype")
    if not v.type.dtype.startswith("float"):
        raise TypeError(f"conv2d: {name} must be float, got {v.type.dtype}")
    return v


def _out_size(n, k, p):
    return None if n is None or k is None else n + 2 * p - k + 1


class _Op(Op):
    """An Op whose gradient is its pullback, under every PyTensor: older ones (and Theano)
    ask an Op for L_op, PyTensor 3 for pullback."""

    def L_op(self, inputs, outputs, output_grads):
        return self.pullback(inputs, outputs, output_grads)


class Conv2d(_Op):
    """y = conv2d(x, w): x (b, c, h, w) images, w (f, c, kh, kw) filters, y (b, f, h + 2 ph -
    kh + 1, w + 2 pw - kw + 1); stride 1. Cross-correlation, as cuDNN, PyTorch and JAX
    compute it (Theano's conv2d turned the filters half a turn first; learned filters do not
    care)."""

    __props__ = ("padding",)

    def __init__(self, padding=(0, 0)):
        self.padding = tuple(int(p) for p in padding)

    def make_node(self, x, w):
        x = _as_images("the images x", x)
        w = _as_images("the filters w", w, x.type.dtype)
        (b, c, h, wd), (f, c2, kh, kw) = x.type.shape, w.type.shape
        if c is not None and c2 is not None and c != c2:
            raise ValueError(f"conv2d: the images have {c} channels, the filters {c2}")
        out = pt.tensor(dtype=x.type.dtype, shape=(b, f, _out_size(h, kh, self.padding[0]),
                                                   _out_size(wd, kw, self.padding[1])))
        return Apply(self, [x, w], [out])

    def infer_shape(self, fgraph, node, shapes):
        (b, _, h, wd), (f, _, kh, kw) = shapes
        ph, pw = self.padding
        return [(b, f, h + 2 * ph - kh + 1, wd + 2 * pw - kw + 1)]

    def perform(self, node, inputs, outputs):
        x, w = inputs
        outputs[0][0] = correlate(x, w, self.padding).astype(x.dtype, copy=False)

    def pullback(self, inputs, outputs, cotangents):
        x, w = inputs
        [gy] = cotangents
        return [Conv2dGrad(self.padding, "x")(x, w, gy), Conv2dGrad(self.padding, "w")(x, w, gy)]


class Conv2dGrad(_Op):
    """The gradient of Conv2d's output gy with respect to its images (``wrt='x'``) or its
    filters (``wrt='w'``). Both take (x, w, gy), so that each knows every shape."""

    __props__ = ("padding", "wrt")

    def __init__(self, padding, wrt):
        if wrt not in ("x", "w"):
            raise ValueError(f"wrt must be 'x' or 'w', got {wrt!r}")
        self.padding, self.wrt = tuple(int(p) for p in padding), wrt

    def make_node(self, x, w, gy):
        x, w, gy = (pt.as_tensor_variable(v) for v in (x, w, gy))
        like = x if self.wrt == "x" else w
        return Apply(self, [x, w, gy], [like.type()])

    def infer_shape(self, fgraph, node, shapes):
        return [shapes[0] if self.wrt == "x" else shapes[1]]

    def perform(self, node, inputs, outputs):
        x, w, gy = inputs
        if self.wrt == "x":
            g = correlate_grad_x(w, gy, x.shape[2:], self.padding)
        else:
            g = correlate_grad_w(x, gy, w.shape[2:], self.padding)
        outputs[0][0] = g.astype(x.dtype, copy=False)

    def pullback(self, inputs, outputs, cotangents):
        return [grad_not_implemented(self, i, v, "conv2d has no second derivative")
                for i, v in enumerate(inputs)]


def _register_jax():
    """Teach PyTensor's JAX backend both Ops. Importing its dispatch imports JAX (a second
    or two), so this is done only where JAX is installed, and only by models that import
    this module."""
    if importlib.util.find_spec("jax") is None:
        return
    import jax
    from pytensor.link.jax.dispatch import jax_funcify

    @jax_funcify.register(Conv2d)
    def _conv2d(op, **kwargs):
        def conv2d(x, w):
            return _correlate_jax(x, w, op.padding)
        return conv2d

    @jax_funcify.register(Conv2dGrad)
    def _conv2d_grad(op, **kwargs):
        wrt = 0 if op.wrt == "x" else 1

        def conv2d_grad(x, w, gy):
            # XLA differentiates its own convolution (cuDNN's backward kernels on GPUs);
            # the gradient left unused is removed when the step is compiled.
            _, vjp = jax.vjp(lambda x, w: _correlate_jax(x, w, op.padding), x, w)
            return vjp(gy)[wrt]
        return conv2d_grad


_register_jax()


def conv2d(x, w, padding=0):
    """The 2-d cross-correlation of images x (batch, channels, rows, columns) with filters w
    (filters, channels, kh, kw), stride 1, after zero-padding x by ``padding`` (an int, or
    (rows, columns)) on each side: 0 gives 'valid', k // 2 'same' for odd k. Differentiable
    in x and w; runs on CPU workers and, under the JAX backend, on GPUs."""
    if np.ndim(padding) == 0:
        padding = (padding, padding)
    padding = tuple(int(p) for p in padding)
    if len(padding) != 2 or min(padding) < 0:
        raise ValueError(f"conv2d: padding must be one or two non-negative ints, got {padding}")
    if isinstance(w, SharedVariable) and None in w.type.shape:
        # A shared variable's type leaves its shape open (set_value may change it); a
        # model's filters keep theirs, and saying so gives the output static rows and
        # columns, which max_pool_2d and a reshape to fixed sizes need under JAX.
        w = pt.specify_shape(w, w.get_value(borrow=True).shape)
    return Conv2d(padding)(x, w)


def max_pool_2d(x, size=2):
    """The maximum of each (size, size) block of x (batch, channels, rows, columns), which
    must have static rows and columns; rows and columns that do not fill a block are dropped
    (Theano's ignore_border=True). Its gradient goes to each block's maximum (to every one
    where several are equal)."""
    x = pt.as_tensor_variable(x)
    rows, cols = x.type.shape[2:] if x.type.ndim == 4 else (None, None)
    if x.type.ndim != 4 or rows is None or cols is None:
        raise ValueError(f"max_pool_2d: x must be 4-d with static rows and columns, got "
                         f"{x.type}: reshape the flat input with constant sizes")
    if size < 1 or size > min(rows, cols):
        raise ValueError(f"max_pool_2d: size {size} does not fit {rows}x{cols} images")
    r, c = rows // size, cols // size
    x = x[:, :, :r * size, :c * size]
    # Static sizes where they are known: JAX needs every size it reshapes to (the gradient
    # reshapes back) as a constant.
    batch, channels = (s if s is not None else x.shape[i] for i, s in enumerate(x.type.shape[:2]))
    return x.reshape((batch, channels, r, size, c, size)).max(axis=(3, 5))
