"""An independent numpy model of pympgu's averaging arithmetic, for exact comparisons.

fp32 accumulation in rank order, one fp32 division by R, round-to-nearest-even into the
storage type. bfloat16 is held as uint16 storage.
"""
import numpy as np


def bf16_to_f32(u16):
    return (u16.astype(np.uint32) << 16).view(np.float32)


def f32_to_bf16(f32):
    b = np.ascontiguousarray(f32, dtype=np.float32).view(np.uint32)
    nan = (b & 0x7FFFFFFF) > 0x7F800000
    rounded = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16).astype(np.uint16)
    return np.where(nan, ((b >> 16) | 0x40).astype(np.uint16), rounded)


def to_f32(a, dtype):
    return bf16_to_f32(a) if dtype == "bfloat16" else a.astype(np.float32)


def from_f32(x, dtype):
    return f32_to_bf16(x) if dtype == "bfloat16" else x.astype(dtype)


def model_average(inputs, dtype):
    """What every pympgu kernel must produce, bit for bit (NaN payloads aside)."""
    with np.errstate(all="ignore"):
        acc = to_f32(inputs[0], dtype).copy()
        for a in inputs[1:]:
            acc += to_f32(a, dtype)
        return from_f32(acc / np.float32(len(inputs)), dtype)


def random_replicas(rng, nranks, n, dtype, scale=1.0):
    """nranks fresh random arrays of n elements in dtype's storage."""
    out = []
    for _ in range(nranks):
        x = (rng.standard_normal(n) * scale).astype(np.float32)
        out.append(from_f32(x, dtype))
    return out


def mean64(inputs, dtype):
    return np.mean([to_f32(a, dtype).astype(np.float64) for a in inputs], axis=0)


def same_bits(a, b, dtype):
    """Equal storage, where NaNs only need to be NaN in both."""
    fa, fb = to_f32(a, dtype), to_f32(b, dtype)
    nan = np.isnan(fa)
    return bool(np.array_equal(nan, np.isnan(fb)) and
                np.array_equal(a.view(np.uint8).reshape(len(a), -1)[~nan],
                               b.view(np.uint8).reshape(len(b), -1)[~nan]))


def model_wire_exchanges(rounds_inputs, wire):
    """Results of successive exchanges of float32 arrays over a low-precision wire.

    rounds_inputs[k][r] is rank r's array at exchange k. The first exchange is exact and sets
    ref; each later one sends round(x - ref) in `wire`, averages the wire values and adds the
    average to ref in float32 (pmg_host_delta / pmg_host_accumulate). Returns every
    exchange's result.
    """
    ref = model_average(rounds_inputs[0], "float32")
    results = [ref.copy()]
    with np.errstate(all="ignore"):
        for inputs in rounds_inputs[1:]:
            wires = [from_f32(x - ref, wire) for x in inputs]
            ref = ref + to_f32(model_average(wires, wire), wire)
            results.append(ref.copy())
    return results
