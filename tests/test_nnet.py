"""pympgu.nnet's convolution and pooling: numpy's values against scipy, both gradients against
finite differences, the JAX conversion against numpy, and the errors for bad input."""

import numpy as np
import pytest

from pympgu import nnet

import pytensor  # noqa: E402  (after pympgu.nnet: it sets floatX)
import pytensor.tensor as pt  # noqa: E402

pytestmark = pytest.mark.timeout(300)


def scipy_correlate(x, w, padding, stride=(1, 1), dilation=(1, 1)):
    """By the definition: the filters with dilation - 1 zeros between taps, correlated at
    every position, then every stride-th output kept."""
    signal = pytest.importorskip("scipy.signal")
    (ph, pw), (sh, sw), (dh, dw) = padding, stride, dilation
    xp = np.pad(x, ((0, 0), (0, 0), (ph, ph), (pw, pw)))
    kh, kw = w.shape[2:]
    wd = np.zeros(w.shape[:2] + ((kh - 1) * dh + 1, (kw - 1) * dw + 1))
    wd[:, :, ::dh, ::dw] = w
    y = np.stack([np.stack([sum(signal.correlate(xp[b, c], wd[f, c], mode="valid")
                                for c in range(x.shape[1])) for f in range(w.shape[0])])
                  for b in range(x.shape[0])])
    return y[:, :, ::sh, ::sw]


# (padding, stride, dilation): plain; padded; a stride that divides neither side; a
# dilation; all three at once, different along rows and columns.
GEOMETRIES = [((0, 0), (1, 1), (1, 1)), ((2, 1), (1, 1), (1, 1)), ((1, 0), (2, 2), (1, 1)),
              ((0, 0), (1, 1), (2, 2)), ((1, 2), (3, 2), (2, 1))]


@pytest.mark.parametrize("padding,stride,dilation", GEOMETRIES)
def test_numpy_correlation_is_scipys(padding, stride, dilation):
    rng = np.random.default_rng(0)
    x, w = rng.standard_normal((3, 2, 12, 9)), rng.standard_normal((4, 2, 5, 3))
    y = nnet.correlate(x, w, padding, stride, dilation)
    rows, cols = ((n + 2 * p - d * (k - 1) - 1) // s + 1
                  for n, k, p, s, d in zip((12, 9), (5, 3), padding, stride, dilation))
    assert y.shape == (3, 4, rows, cols)
    assert np.allclose(y, scipy_correlate(x, w, padding, stride, dilation), rtol=1e-12,
                       atol=1e-12)


@pytest.mark.parametrize("padding,stride,dilation", [(0, 1, 1), ((2, 1), 1, 1), (1, 2, 1),
                                                     ((1, 0), (2, 3), (2, 1))])
def test_conv2d_gradients_are_the_finite_differences(padding, stride, dilation):
    """Both gradient Ops, in float64 through PyTensor's own checker (a stride that leaves
    rows no window reads, whose gradient is zero, included); and the pooled layer whose
    gradient goes through the reshape and the max."""
    rng = np.random.default_rng(1)
    x, w = rng.standard_normal((2, 3, 10, 9)), rng.standard_normal((4, 3, 3, 2))
    pytensor.gradient.verify_grad(lambda x, w: nnet.conv2d(x, w, padding, stride, dilation),
                                  [x, w], rng=rng, mode="FAST_COMPILE")

    shapes = x.shape, w.shape  # static, as max_pool_2d needs them

    def layer(xv, wv):
        y = nnet.conv2d(pt.specify_shape(xv, shapes[0]), pt.specify_shape(wv, shapes[1]),
                        padding, stride, dilation)
        return pt.tanh(nnet.max_pool_2d(y, 2))
    pytensor.gradient.verify_grad(layer, [x, w], rng=rng, mode="FAST_COMPILE")


def test_max_pool_keeps_each_blocks_maximum_and_drops_the_ragged_edge():
    x = pt.tensor("x", dtype="float32", shape=(2, 3, 7, 6))
    xv = np.random.default_rng(2).standard_normal((2, 3, 7, 6)).astype(np.float32)
    got = pytensor.function([x], nnet.max_pool_2d(x, 3))(xv)
    want = xv[:, :, :6, :6].reshape(2, 3, 2, 3, 2, 3).max(axis=(3, 5))
    assert got.shape == (2, 3, 2, 2) and np.array_equal(got, want)


def test_square_images_are_one_channel_or_three():
    assert nnet.square_images(784) == (1, 28) and nnet.square_images(3 * 32 * 32) == (3, 32)
    with pytest.raises(ValueError, match="LeNet takes square images of 1 or 3 channels; 780"):
        nnet.square_images(780, "LeNet")


def test_filters_of_a_shared_variable_give_static_output_sizes():
    """A model's filters are shared variables, whose type leaves the shape open: conv2d
    fixes it, so that max_pool_2d and reshapes to fixed sizes (JAX's need) can follow."""
    x = pt.tensor("x", dtype="float32", shape=(None, 1, 28, 28))
    w = pytensor.shared(np.zeros((20, 1, 5, 5), np.float32))
    y = nnet.max_pool_2d(nnet.conv2d(x, w), 2)
    assert y.type.shape == (None, 20, 12, 12)


@pytest.mark.parametrize("build,message", [
    (lambda: nnet.conv2d(pt.matrix("x"), pt.tensor4("w")), "the images x must be 4-d"),
    (lambda: nnet.conv2d(pt.tensor("x", shape=(1, 3, 8, 8)), pt.tensor("w", shape=(2, 1, 3, 3))),
     "the images have 3 channels, the filters 1"),
    (lambda: nnet.conv2d(pt.tensor4("x", dtype="float32"), pt.tensor4("w", dtype="float64")),
     "the filters w is float64 but the images are float32"),
    (lambda: nnet.conv2d(pt.tensor4("x", dtype="int32"), pt.tensor4("w", dtype="int32")),
     "the images x must be float"),
    (lambda: nnet.conv2d(pt.tensor4("x"), pt.tensor4("w"), padding=-1),
     "padding must be one or two non-negative ints"),
    (lambda: nnet.conv2d(pt.tensor4("x"), pt.tensor4("w"), stride=(2, 0)),
     "stride must be one or two positive ints"),
    (lambda: nnet.conv2d(pt.tensor4("x"), pt.tensor4("w"), dilation=1.5),
     "dilation must be one or two positive ints"),
    (lambda: nnet.conv2d(pt.tensor("x", shape=(1, 1, 8, 8)), pt.tensor("w", shape=(1, 1, 3, 3)),
                         dilation=4), r"3x3 filters \(dilation \(4, 4\)\) do not fit 8x8"),
    (lambda: nnet.max_pool_2d(pt.tensor4("x")), "static rows and columns"),
    (lambda: nnet.max_pool_2d(pt.tensor("x", shape=(1, 1, 4, 4)), 5), "does not fit 4x4"),
])
def test_bad_layers_are_named(build, message):
    with pytest.raises((ValueError, TypeError), match=message):
        build()


@pytest.mark.parametrize("platform", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_jax_conversion_agrees_with_numpy(jax_process, platform):
    """The same layer, its output and both gradients, with padding, strides and dilation,
    by PyTensor's CPU backend (numpy's perform) and by its JAX backend (XLA's convolution;
    on a GPU cuDNN's, at full float32 precision rather than TF32, so that one tolerance
    fits both), in float32, in a fresh process on that platform."""
    pytest.importorskip("jax")
    jax_process("convolutions_agree", platform, platform=platform)
