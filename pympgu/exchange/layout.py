"""Where each array lies in an exchange's shared buffer: one dtype, every entry aligned."""
import math

# Every entry starts on a 256-byte boundary: the kernels' 16-byte vector loads, and DDP's
# buckets (pympgu.ddp) placed as the Exchanger's arrays are.
ALIGN_BYTES = 256
ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2}


def plan_layout(layout):
    """Element offsets of each entry of ``layout`` (a list of (name, shape, dtype), one
    dtype), each 256-byte aligned, the total element count, and the dtype."""
    dtypes = {d for _, _, d in layout}
    if len(dtypes) != 1:
        raise ValueError(f"an Exchanger averages one dtype; the layout has {sorted(dtypes)}")
    dtype = dtypes.pop()
    if dtype not in ITEMSIZE:
        raise ValueError(f"unsupported dtype {dtype!r}: float32, float16 or bfloat16")
    step = ALIGN_BYTES // ITEMSIZE[dtype]
    offsets, total = [], 0
    for _, shape, _ in layout:
        offsets.append(total)
        size = math.prod(shape)
        total += -(-size // step) * step
    return offsets, total, dtype
