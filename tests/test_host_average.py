"""The host averaging kernel against a float64 reference and an exact numpy model."""
import numpy as np
import pytest

import pympgu
from reference import mean64, model_average, random_replicas, same_bits, to_f32

DTYPES = ["float32", "float16", "bfloat16"]
# Relative error bound of one rounding into each storage type (half an ulp) plus the fp32
# accumulation's own rounding.
REL_TOL = {"float32": 2 ** -23, "float16": 2 ** -10, "bfloat16": 2 ** -7}
LENGTHS = [1, 2, 3, 7, 8, 9, 15, 17, 1000, 4097, 65537, 1_000_003, 3_000_001]


def storage_empty(n, dtype):
    return np.empty(n, dtype=np.uint16 if dtype == "bfloat16" else dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize("nranks", [1, 2, 3, 8])
def test_matches_model_and_float64(dtype, n, nranks, seed):
    rng = np.random.default_rng(seed)
    inputs = random_replicas(rng, nranks, n, dtype, scale=rng.uniform(0.01, 100))
    out = storage_empty(n, dtype)
    out[:] = 0xFF if dtype != "float32" else np.nan  # poison: every element must be written
    pympgu.host_average(inputs, out, dtype=dtype)
    assert same_bits(out, model_average(inputs, dtype), dtype)
    ref = mean64(inputs, dtype)
    got = to_f32(out, dtype).astype(np.float64)
    scale = np.max([np.abs(to_f32(a, dtype)) for a in inputs], axis=0)
    assert np.all(np.abs(got - ref) <= 2 * REL_TOL[dtype] * scale + 1e-45)


@pytest.mark.parametrize("dtype", DTYPES)
def test_in_place(dtype, seed):
    rng = np.random.default_rng(seed)
    inputs = random_replicas(rng, 4, 1001, dtype)
    expected = model_average(inputs, dtype)
    pympgu.host_average(inputs, inputs[2], dtype=dtype)
    assert same_bits(inputs[2], expected, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("nranks", [1, 2, 5, 8])
@pytest.mark.parametrize("n", [1, 2047, 2048, 2049, 10_001])  # around the kernel's block
def test_into_every_input(dtype, nranks, n, seed):
    """The mean stored into every replica at once, each an input too: the node's exchange."""
    rng = np.random.default_rng(seed)
    inputs = random_replicas(rng, nranks, n, dtype)
    expected = model_average(inputs, dtype)
    pympgu.host_average(inputs, inputs, dtype=dtype)
    for a in inputs:
        assert same_bits(a, expected, dtype)


def test_every_output_checked():
    a = np.zeros(4, np.float32)
    with pytest.raises(ValueError, match="output 1 has 3 items"):
        pympgu.host_average([a], [a.copy(), np.zeros(3, np.float32)])
    with pytest.raises(ValueError, match="output 0 must be a writable"):
        ro = np.zeros(4, np.float32)
        ro.flags.writeable = False
        pympgu.host_average([a], [ro])
    with pytest.raises(ValueError, match="writes 1 to 8 outputs, got 0"):
        pympgu.host_average([a], [])


@pytest.mark.parametrize("dtype", DTYPES)
def test_nan_and_inf_propagate(dtype, seed):
    rng = np.random.default_rng(seed)
    a, b = (to_f32(x, dtype) for x in random_replicas(rng, 2, 64, dtype))
    a[3], a[5], b[5], a[7], b[7] = np.nan, np.inf, np.inf, np.inf, -np.inf
    b[9] = -np.inf
    from reference import from_f32
    inputs = [from_f32(a, dtype), from_f32(b, dtype)]
    out = storage_empty(64, dtype)
    pympgu.host_average(inputs, out, dtype=dtype)
    got = to_f32(out, dtype)
    assert np.isnan(got[3]) and np.isnan(got[7])
    assert got[5] == np.inf and got[9] == -np.inf
    assert same_bits(out, model_average(inputs, dtype), dtype)


def test_negative_zero_survives():
    z = np.array([-0.0], dtype=np.float32)
    out = np.empty(1, np.float32)
    pympgu.host_average([z, z.copy()], out)
    assert np.signbit(out[0])


def test_fp16_overflow_and_subnormals():
    big = np.array([65504, 60000, 6e-8, -6e-8, 1e-5], dtype=np.float16)
    out = np.empty_like(big)
    pympgu.host_average([big, big.copy()], out)
    assert np.array_equal(out, big)
    pympgu.host_average([big, big.copy(), big.copy()], out)
    assert same_bits(out, model_average([big] * 3, "float16"), "float16")


def test_bad_arguments_name_the_problem():
    a = np.zeros(4, np.float32)
    with pytest.raises(ValueError, match="unsupported dtype 'float64'"):
        pympgu.host_average([a.astype(np.float64)], a.astype(np.float64))
    with pytest.raises(ValueError, match="input 1 has 3 items"):
        pympgu.host_average([a, a[:3]], a)
    with pytest.raises(ValueError, match="1 to 8 inputs"):
        pympgu.host_average([a] * 9, a)
    with pytest.raises(ValueError, match="C-contiguous"):
        pympgu.host_average([a, np.zeros(8, np.float32)[::2]], a)


@pytest.mark.parametrize("wire", ["float16", "bfloat16"])
@pytest.mark.parametrize("n", [1, 5, 1000, 65537])
def test_wire_delta_and_accumulate_match_model(wire, n, seed):
    from pympgu._host import host_accumulate, host_delta
    from reference import from_f32
    rng = np.random.default_rng(seed)
    ref = rng.standard_normal(n).astype(np.float32)
    x = ref + (rng.standard_normal(n) * 0.01).astype(np.float32)
    x[0] = np.inf if n > 1 else x[0]  # an overflow must travel as Inf, not be clipped
    w = storage_empty(n, wire)
    w[:] = 0xFF if wire == "bfloat16" else np.nan
    host_delta(x, ref, w, wire)
    with np.errstate(all="ignore"):
        assert same_bits(w, from_f32(x - ref, wire), wire)
    acc = ref.copy()
    host_accumulate(acc, w, wire)
    finite = np.isfinite(x)
    with np.errstate(all="ignore"):
        assert np.array_equal(acc, ref + to_f32(w, wire))
        # only the change since ref was rounded: the error is relative to |x - ref|
        err = np.abs(acc - x)[finite]
    assert np.all(err <= np.abs(x - ref)[finite] * REL_TOL[wire] + 1e-7)


def test_wire_rejects_bad_arguments():
    from pympgu._host import host_accumulate, host_delta
    x = np.zeros(4, np.float32)
    with pytest.raises(ValueError, match="wire dtype"):
        host_delta(x, x, np.zeros(4, np.float32), "float32")
    with pytest.raises(ValueError, match="wire has 3 items"):
        host_delta(x, x, np.zeros(3, np.uint16), "bfloat16")
    with pytest.raises(ValueError, match="ref must be float32"):
        host_accumulate(np.zeros(4, np.float64), np.zeros(4, np.uint16), "bfloat16")


@pytest.fixture
def threads():
    """Sets the host code's threads for one test, and puts back one after it."""
    from pympgu import _host
    yield _host.set_threads
    _host.set_threads(1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("nthreads", [2, 3, 8])
def test_threads_give_the_same_bits(dtype, nthreads, threads, seed):
    """Shared out among threads (a part a run of whole blocks), every element is what one
    thread computes, into every output."""
    from pympgu import _host
    rng = np.random.default_rng(seed)
    for nranks, n in [(2, 1_000_003), (3, 300_001), (8, 70_000), (2, 100)]:
        inputs = random_replicas(rng, nranks, n, dtype)
        expected = model_average(inputs, dtype)
        threads(nthreads)
        assert _host.threads() == nthreads
        outs = [storage_empty(n, dtype) for _ in range(2)]
        for o in outs:
            o.view(np.uint8)[:] = 0xFF  # poison (NaN): every element must be written
        pympgu.host_average(inputs, outs, dtype=dtype)
        pympgu.host_average(inputs, inputs, dtype=dtype)
        for a in outs + inputs:
            assert same_bits(a, expected, dtype)


@pytest.mark.parametrize("nthreads", [1, 2, 5])
def test_copies_shared_out_among_threads(nthreads, threads):
    from pympgu import _host
    rng = np.random.default_rng(0)
    threads(nthreads)
    # Entries of every size, the parts' bounds falling inside them and between them.
    sizes = [0, 1, 3, 700_001, 64, 250_000, 5]
    srcs = [rng.standard_normal(n).astype(np.float32) for n in sizes]
    dsts = [np.full(n, np.nan, np.float32) for n in sizes]
    _host.host_copy(list(zip(srcs, dsts)))
    for s, d in zip(srcs, dsts):
        assert s.tobytes() == d.tobytes()


def test_copy_and_threads_refuse_bad_arguments(threads):
    from pympgu import _host
    a = np.zeros(4, np.float32)
    with pytest.raises(ValueError, match="pair 0: 16 bytes into 12"):
        _host.host_copy([(a, np.zeros(3, np.float32))])
    with pytest.raises(ValueError, match="destination 0 must be a writable"):
        _host.host_copy([(a, a[::2])])
    for n in (0, 65):
        with pytest.raises(ValueError, match="threads must be 1 to 64"):
            threads(n)
