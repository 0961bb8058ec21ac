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
import math
import warnings

import numpy as np

from ._pytensor import import_pytensor

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


def _windows(x, kernel, stride=(1, 1), dilation=(1, 1)):
    """Every window of x (b, c, h, w) that a (kh, kw) filter reads, moved by ``stride`` and
    with its taps ``dilation`` apart, as a view (b, c, oh, ow, kh, kw)."""
    (kh, kw), (sh, sw), (dh, dw) = kernel, stride, dilation
    span = ((kh - 1) * dh + 1, (kw - 1) * dw + 1)
    return np.lib.stride_tricks.sliding_window_view(x, span, axis=(2, 3))[
        :, :, ::sh, ::sw, ::dh, ::dw]


def correlate(x, w, padding=(0, 0), stride=(1, 1), dilation=(1, 1)):
    """numpy's y[b, f, i, j] = sum over c, k, l of xp[b, c, sh i + dh k, sw j + dw l] *
    w[f, c, k, l], xp being x zero-padded by ``padding`` (rows, columns) on each side."""
    windows = _windows(_pad(x, padding), w.shape[2:], stride, dilation)
    y = np.tensordot(windows, w, axes=([1, 4, 5], [1, 2, 3]))
    return np.ascontiguousarray(y.transpose(0, 3, 1, 2))


def correlate_grad_w(x, gy, kernel, padding=(0, 0), stride=(1, 1), dilation=(1, 1)):
    """The gradient of correlate's w, (f, c, kh, kw), for the gradient gy of its output."""
    windows = _windows(_pad(x, padding), kernel, stride, dilation)
    return np.tensordot(gy, windows, axes=([0, 2, 3], [0, 2, 3]))


def correlate_grad_x(w, gy, image, padding=(0, 0), stride=(1, 1), dilation=(1, 1)):
    """The gradient of correlate's x, (b, c, h, w), for the gradient gy of its output: each
    output's share of every filter tap, added back where that tap read (col2im), less the
    padding."""
    kh, kw = w.shape[2:]
    b, _, oh, ow = gy.shape
    (ph, pw), (sh, sw), (dh, dw) = padding, stride, dilation
    # (c, kh, kw, b, oh, ow): one product for every tap, then kh * kw sums of slabs, several
    # times quicker than correlating the padded gy with the turned filters, whose windows
    # numpy must copy. Rows and columns that no window reaches (a stride that does not
    # divide the image) keep a zero gradient.
    taps = np.tensordot(w, gy, axes=([0], [1]))
    gxp = np.zeros((w.shape[1], b, image[0] + 2 * ph, image[1] + 2 * pw), taps.dtype)
    for ky in range(kh):
        for kx in range(kw):
            y0, x0 = ky * dh, kx * dw
            rows = slice(y0, y0 + sh * (oh - 1) + 1, sh)
            cols = slice(x0, x0 + sw * (ow - 1) + 1, sw)
            gxp[:, :, rows, cols] += taps[:, ky, kx]
    gxp = gxp.transpose(1, 0, 2, 3)
    return np.ascontiguousarray(gxp[:, :, ph:ph + image[0], pw:pw + image[1]])


def _correlate_jax(x, w, padding, stride, dilation):
    from jax import lax
    ph, pw = padding
    return lax.conv_general_dilated(x, w, stride, ((ph, ph), (pw, pw)), rhs_dilation=dilation,
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


def _out_size(n, k, p, s, d):
    """Outputs along one axis of n inputs, padded by p, for a filter of k taps d apart
    moved by s (the windows that fit)."""
    return None if n is None or k is None else (n + 2 * p - d * (k - 1) - 1) // s + 1


def _pairs(name, value, least):
    """One int, or (rows, columns), as a pair of ints each at least ``least``."""
    try:
        pair = (value, value) if np.ndim(value) == 0 else tuple(value)
        valid = len(pair) == 2 and all(int(v) == v >= least for v in pair)
    except (TypeError, ValueError):
        valid = False
    if not valid:
        what = "non-negative" if least == 0 else "positive"
        raise ValueError(f"conv2d: {name} must be one or two {what} ints, got {value!r}")
    return tuple(int(v) for v in pair)


class _Op(Op):
    """An Op whose gradient is its pullback, under every PyTensor: older ones (and Theano)
    ask an Op for L_op, PyTensor 3 for pullback."""

    def L_op(self, inputs, outputs, output_grads):
        return self.pullback(inputs, outputs, output_grads)


class _Geometry(_Op):
    """What a convolution's Ops share: its padding, stride and filter dilation, each a pair
    (rows, columns)."""

    def _geometry(self, padding, stride, dilation):
        self.padding = _pairs("padding", padding, 0)
        self.stride = _pairs("stride", stride, 1)
        self.dilation = _pairs("dilation", dilation, 1)

    @property
    def geometry(self):
        return self.padding, self.stride, self.dilation


class Conv2d(_Geometry):
    """y = conv2d(x, w): x (b, c, h, w) images, w (f, c, kh, kw) filters, y (b, f, oh, ow)
    with oh = (h + 2 ph - dh (kh - 1) - 1) // sh + 1 (and ow alike): padding p, stride s,
    dilation d. Cross-correlation, as cuDNN, PyTorch and JAX compute it (Theano's conv2d
    turned the filters half a turn first; learned filters do not care)."""

    __props__ = ("padding", "stride", "dilation")

    def __init__(self, padding=(0, 0), stride=(1, 1), dilation=(1, 1)):
        self._geometry(padding, stride, dilation)

    def make_node(self, x, w):
        x = _as_images("the images x", x)
        w = _as_images("the filters w", w, x.type.dtype)
        (b, c, h, wd), (f, c2, kh, kw) = x.type.shape, w.type.shape
        if c is not None and c2 is not None and c != c2:
            raise ValueError(f"conv2d: the images have {c} channels, the filters {c2}")
        rows, cols = (_out_size(n, k, *g) for n, k, g in
                      zip((h, wd), (kh, kw), zip(*self.geometry)))
        if (rows is not None and rows < 1) or (cols is not None and cols < 1):
            raise ValueError(f"conv2d: {kh}x{kw} filters (dilation {self.dilation}) do not "
                             f"fit {h}x{wd} images padded by {self.padding}")
        out = pt.tensor(dtype=x.type.dtype, shape=(b, f, rows, cols))
        return Apply(self, [x, w], [out])

    def infer_shape(self, fgraph, node, shapes):
        (b, _, h, wd), (f, _, kh, kw) = shapes
        return [(b, f) + tuple(_out_size(n, k, *g) for n, k, g in
                               zip((h, wd), (kh, kw), zip(*self.geometry)))]

    def perform(self, node, inputs, outputs):
        x, w = inputs
        outputs[0][0] = correlate(x, w, *self.geometry).astype(x.dtype, copy=False)

    def pullback(self, inputs, outputs, cotangents):
        x, w = inputs
        [gy] = cotangents
        return [Conv2dGrad(*self.geometry, wrt=wrt)(x, w, gy) for wrt in ("x", "w")]


class Conv2dGrad(_Geometry):
    """The gradient of Conv2d's output gy with respect to its images (``wrt='x'``) or its
    filters (``wrt='w'``). Both take (x, w, gy), so that each knows every shape."""

    __props__ = ("padding", "stride", "dilation", "wrt")

    def __init__(self, padding=(0, 0), stride=(1, 1), dilation=(1, 1), wrt="x"):
        if wrt not in ("x", "w"):
            raise ValueError(f"wrt must be 'x' or 'w', got {wrt!r}")
        self._geometry(padding, stride, dilation)
        self.wrt = wrt

    def make_node(self, x, w, gy):
        x, w, gy = (pt.as_tensor_variable(v) for v in (x, w, gy))
        like = x if self.wrt == "x" else w
        return Apply(self, [x, w, gy], [like.type()])

    def infer_shape(self, fgraph, node, shapes):
        return [shapes[0] if self.wrt == "x" else shapes[1]]

    def perform(self, node, inputs, outputs):
        x, w, gy = inputs
        if self.wrt == "x":
            g = correlate_grad_x(w, gy, x.shape[2:], *self.geometry)
        else:
            g = correlate_grad_w(x, gy, w.shape[2:], *self.geometry)
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
            return _correlate_jax(x, w, *op.geometry)
        return conv2d

    @jax_funcify.register(Conv2dGrad)
    def _conv2d_grad(op, **kwargs):
        wrt = 0 if op.wrt == "x" else 1

        def conv2d_grad(x, w, gy):
            # XLA differentiates its own convolution (cuDNN's backward kernels on GPUs);
            # the gradient left unused is removed when the step is compiled.
            _, vjp = jax.vjp(lambda x, w: _correlate_jax(x, w, *op.geometry), x, w)
            return vjp(gy)[wrt]
        return conv2d_grad


_register_jax()


def conv2d(x, w, padding=0, stride=1, dilation=1):
    """The 2-d cross-correlation of images x (batch, channels, rows, columns) with filters w
    (filters, channels, kh, kw), after zero-padding x by ``padding`` on each side: 0 gives
    'valid', d (k - 1) // 2 'same' for odd k and stride 1. ``stride`` moves the filter that
    many pixels between outputs (2 halves the image, as a ResNet's downsampling does);
    ``dilation`` spaces its taps that far apart. Each is an int or (rows, columns).
    Differentiable in x and w; runs on CPU workers and, under the JAX backend, on GPUs."""
    op = Conv2d(padding, stride, dilation)  # checks them, naming the one at fault
    if isinstance(w, SharedVariable) and None in w.type.shape:
        # A shared variable's type leaves its shape open (set_value may change it); a
        # model's filters keep theirs, and saying so gives the output static rows and
        # columns, which max_pool_2d and a reshape to fixed sizes need under JAX.
        w = pt.specify_shape(w, w.get_value(borrow=True).shape)
    return op(x, w)


def he_normal(rng, shape):
    """Filters of ``shape`` (filters, channels, kh, kw) drawn from He et al.'s normal for
    layers followed by ReLU (2015): mean 0, variance 2 / fan-in, the fan-in being a filter's
    taps (channels x kh x kw). ``rng``: a numpy Generator seeded as the model is, so that
    every worker draws the same values."""
    fan_in = int(np.prod(shape[1:]))
    return rng.normal(0.0, np.sqrt(2.0 / fan_in), shape)


def square_images(n_in, model="the model"):
    """(channels, side) of square images of ``n_in`` values, of 1 channel or 3 (an RGB
    image, channels first): how a convnet reshapes the flat rows pympgu's datasets give
    (MNIST's 784 are 1x28x28, CIFAR's 3072 3x32x32)."""
    for channels in (1, 3):
        side = math.isqrt(n_in // channels)
        if n_in % channels == 0 and side * side * channels == n_in:
            return channels, side
    raise ValueError(f"{model} takes square images of 1 or 3 channels; {n_in} inputs are "
                     "neither")


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


def augment(x, flip=None, shift=0, offsets=None):
    """Training images varied as the usual augmentations vary them, each image its own way:
    x (batch, channels, rows, columns), static sizes. ``flip``, uniform numbers in [0, 1)
    of shape (batch,): an image whose number is under 1/2 is mirrored left to right.
    ``shift`` pixels with ``offsets``, uniform numbers of shape (batch, 2): each image is
    moved by up to ``shift`` pixels down or up and right or left, what moves out is lost
    and what comes in is zero (a random crop of the image padded by ``shift``, as CIFAR's
    pad-4 crop is). Inputs, not parameters: no gradient is needed through it."""
    x = pt.as_tensor_variable(x)
    batch, channels, rows, cols = x.type.shape if x.type.ndim == 4 else (None,) * 4
    if None in (batch, channels, rows, cols):
        raise ValueError(f"augment: x must be 4-d with static sizes, got {x.type}")
    if flip is not None:
        x = pt.switch((flip < 0.5)[:, None, None, None], x[:, :, :, ::-1], x)
    if shift:
        if offsets is None or not 0 < shift < min(rows, cols):
            raise ValueError(f"augment: a shift of 1 to {min(rows, cols) - 1} pixels with "
                             f"its offsets, got {shift}")
        padded = pt.set_subtensor(
            pt.zeros((batch, channels, rows + 2 * shift, cols + 2 * shift), dtype=x.dtype)[
                :, :, shift:shift + rows, shift:shift + cols], x)
        # Each image's window into its padded copy starts at 0 to 2 shift, a row and a
        # column: gathered by four index arrays that broadcast to the image's shape.
        start = pt.cast(pt.floor(offsets * (2 * shift + 1)), "int32")
        row = start[:, 0][:, None] + pt.arange(rows, dtype="int32")[None, :]
        col = start[:, 1][:, None] + pt.arange(cols, dtype="int32")[None, :]
        x = padded[pt.arange(batch, dtype="int32")[:, None, None, None],
                   pt.arange(channels, dtype="int32")[None, :, None, None],
                   row[:, None, :, None], col[:, None, None, :]]
    return x
