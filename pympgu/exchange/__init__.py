"""The exchange: a worker's parameter arrays averaged with every other worker's.

Each worker owns one shared staging buffer holding all its parameters back to back (each
starting on a 256-byte boundary). An exchange is three steps, each one pass over the
parameters:

1. pack: copy the parameters into the staging buffer (GPU: one multi-tensor launch);
2. average: average every rank's staging buffer in place (GPU: the fused kernel with its
   GPU barrier; CPU: each rank averages its 1/R slice with the host kernel and writes it into
   every rank's buffer, between two host barriers; on several nodes that slice is summed
   across the nodes first, then divided once);
3. unpack: hand the result back. On the CPU these are numpy views of the rank's own buffer,
   of which it has two, taken in turn: valid until the exchange after next (new arrays with
   a half-precision wire). On the GPU they are DeviceArray views of pympgu memory, valid
   until the next exchange starts; the caller imports them into its framework and copies
   them there (``jax.dlpack`` then a copy), so results only ever reach a framework through
   DLPack and never by writing into memory the framework owns.

``start(arrays)`` does steps 1 and 2 and, on the GPU, returns while the average still runs on
pympgu's own stream; ``finish()`` waits and does step 3. Between the two the caller may
compute (the training loop's ``--overlap``). ``average_arrays`` is both at once.

On the GPU the host need never wait. ``start`` takes the arrays through DLPack naming
pympgu's stream, so their producer (JAX's compute stream, say) orders its pending work before
the pack instead of the host blocking on it; ``finish(wait=False)`` returns views whose DLPack
export orders the consumer's stream after the average in the same way. The training loop
runs like this, so the host queues step after step while the GPU works.

A low-precision wire (``wire_dtype='bfloat16'`` or ``'float16'``) halves the bytes that cross
the link. The parameters stay float32: every rank keeps ``ref``, the float32 result of the
last exchange (identical on every rank), sends round(x - ref) in the wire dtype, and adds
the averaged wire back to ref in float32. Rounding then costs a fraction of the change since
the last exchange, not of the parameter, and replicas stay bit-identical. The first exchange
is exact (float32 on the wire) to set ref. Inside XLA the wire takes one road alone, where
no ``ref`` is needed: pympgu.xla.average_gradients, whose gradients cross rounded to it
(DDP's bf16_compress_hook), summed in float32.

Layouts (names, shapes, dtypes) must be identical on every rank; the launcher compares them
before any training and names both layouts if they differ.

Modules: layout (where each array lies in the buffer), exchanger (the Exchanger), host (CPU
workers' shared memory, and every worker's host road between nodes), across (that road's
sums between nodes), outer (the outer optimizers on it) and gpu (GPU workers' PeerGroup).
"""
from .exchanger import METHODS, WIRE_DTYPES, Exchanger
from .layout import ALIGN_BYTES, ITEMSIZE, plan_layout

__all__ = ["ALIGN_BYTES", "ITEMSIZE", "METHODS", "WIRE_DTYPES", "Exchanger", "plan_layout"]
