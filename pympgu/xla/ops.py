"""pympgu's XLA operations: their registration, attributes and calls.

The FFI calls themselves (csrc/xla_ffi.cc): ``average`` in one operation, and the
start/done/wait pieces of an exchange that runs beside XLA's work, which overlap, results
and gradients compose. Every call takes a connected PeerGroup.
"""
import functools

import numpy as np

from .. import methods, settings
from ..exchange.layout import ITEMSIZE, plan_layout

TARGET = "pympgu_average"
START, DONE = "pympgu_average_start", "pympgu_average_done"
WAIT = "pympgu_average_wait"
_registered = False


def copies_to_every_peer(nranks):
    """Whether 'auto' takes, on ``nranks`` ranks, the exchanges that send every rank's whole
    arrays to every peer: the cut step and the gradients (average_results,
    average_gradients) and the overlapped step's 'gather' by the copy engines. They send
    R - 1 times the bytes per rank, where the two-shot kernels send 2 (R - 1) / R times: the
    same at R = 2, and R / 2 times more above (docs/DECISIONS.md, "Copies to every peer"):
    at most PYMPGU_SPLIT_MAX_RANKS ranks."""
    return nranks <= settings.get().split_max_ranks


@functools.lru_cache(maxsize=None)
def available():
    """(True, None), or (False, why the operation cannot be used here). Asked once per
    process: none of it changes while the process runs."""
    from .. import cuda
    ok, info = cuda.availability()
    if not ok:
        return False, f"no usable GPU ({info})"
    from .. import _cuda
    if _cuda.xla_handler() is None:
        return False, ("pympgu was built without jaxlib's XLA FFI headers; install jax and "
                       "rebuild (./build.sh, or pip install --no-build-isolation .)")
    try:
        import jax
        platforms = {d.platform for d in jax.devices()}
    except ImportError:
        return False, "JAX is not installed"
    except RuntimeError as e:  # no backend could start
        return False, f"JAX could not start: {e}"
    if "gpu" not in platforms:
        return False, f"JAX has no GPU backend here (it runs on {', '.join(sorted(platforms))})"
    return True, None


def register():
    """Register pympgu's operations with JAX, once per process."""
    global _registered
    if _registered:
        return
    ok, why = available()
    if not ok:
        raise RuntimeError(f"pympgu.xla.average is unavailable: {why}")
    import jax

    from .. import _cuda
    for name in _cuda.XLA_OPERATIONS:
        jax.ffi.register_ffi_target(name, _cuda.xla_handler(name), platform="CUDA")
    _registered = True


def attributes(arrays, group, algo, max_blocks, overlapped=False, pushed=False):
    """The operation's attributes for averaging ``arrays`` over ``group`` (checked here, so
    that a bad call fails when traced rather than when run), and the algorithm's name.
    overlapped: for the start/done pair, where 'auto' means 'gather' for float32. pushed:
    the arrays are only pushed into the peers' shared shadow, where XLA's own arithmetic
    reads them (average_gradients), so 'gather' takes any float dtype."""
    from .._cuda import ALGORITHM_CODES, ce_chunk_bytes
    layout = [(str(i), list(a.shape), str(a.dtype)) for i, a in enumerate(arrays)]
    offsets, total, dtype = plan_layout(layout)
    nbytes = total * ITEMSIZE[dtype]
    if nbytes > group.nbytes:
        raise ValueError(f"the arrays need {nbytes} bytes in the group's buffer, which holds "
                         f"{group.nbytes}")
    moves = dtype == "float32" or pushed  # what the gather algorithm may take
    if methods.gathers(algo) and not (overlapped and moves):
        raise ValueError("algo 'gather' is for float32 arrays averaged during other work "
                         "(average_during, correct_during)")
    if overlapped and methods.chooses(algo) and moves and copies_to_every_peer(group.nranks):
        # Beside XLA's work the copy engines move the bytes and no SM is taken from it. On
        # more ranks they move R - 1 copies, and a kernel capped at the group's grid
        # ('push', two-shot) takes less of the step than they do.
        chosen = methods.GATHER
    else:
        chosen = methods.GATHER if methods.gathers(algo) else group.algorithm(nbytes, algo)
    blocks = group.max_blocks if max_blocks is None else int(max_blocks)
    register()
    attrs = dict(group=np.int64(group.xla_id(shadow=methods.gathers(chosen))),
                 algo=np.int32(ALGORITHM_CODES[chosen]), max_blocks=np.int32(blocks),
                 chunk_bytes=np.int64(ce_chunk_bytes()), offsets=np.asarray(offsets, np.int64),
                 total=np.int64(total))
    return attrs, chosen


def shapes(arrays):
    import jax
    return [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in arrays]


def average(arrays, group, algo="auto", max_blocks=None):
    """The mean over every rank of each array in ``arrays``, as new arrays (inside jit they
    take the inputs' buffers). See the module docstring for the rules."""
    import jax
    arrays = list(arrays)
    if not arrays:
        return []
    attrs, _ = attributes(arrays, group, algo, max_blocks)
    call = jax.ffi.ffi_call(
        TARGET, shapes(arrays),
        # Not a side effect: JAX dispatches a function with effects through Python, not its
        # C++ fast path (docs/DECISIONS.md, "Operations without side effects"). The package
        # docstring says what users must keep to instead.
        has_side_effect=False,
        input_output_aliases={i: i for i in range(len(arrays))})
    return list(call(*arrays, **attrs))


def reads_shadow(nranks):
    """Whether XLA's own arithmetic reads the shared shadow on nranks ranks (shadow_array,
    gradient_plan): 'auto' lands the peers' arrays there (copies_to_every_peer), and the
    mean divides as the kernels' does (_fusable)."""
    return copies_to_every_peer(nranks) and fusable(nranks)


def fusable(nranks):
    """Whether XLA's arithmetic may take the mean of nranks ranks as the kernels do: more
    than one, and a power of two, by which every division is exact (shadow_array)."""
    return nranks > 1 and nranks & (nranks - 1) == 0


def slot_elems(group, total, itemsize=4):
    """Elements of ``itemsize`` bytes per shadow slot for an exchange of ``total``:
    gather_elems in csrc/xla_ffi.cc (rounded up to 64, within the buffer)."""
    return min((total + 63) // 64 * 64, group.nbytes // itemsize)


# The phases of a start (csrc/xla_ffi.cc): with the barrier before, after, or both.
FIRST, LAST, WHOLE = 1, 2, 3
# The parts of a done: the whole exchange, or the first or last part's arrays of a start in
# two parts (csrc/xla_ffi.cc).
DONE_WHOLE, DONE_FIRST, DONE_LAST = 0, 1, 2


def start(arrays, attrs, phase, offsets=None, after=None):
    """Queue the exchange of ``arrays`` (the start's part ``phase``); returns its token. The
    last part takes the first part's token (``after``) as its first operand: XLA drops an
    operation whose token nothing uses, even through an optimization barrier."""
    import jax
    start = jax.ffi.ffi_call(START, jax.ShapeDtypeStruct((), np.uint32), has_side_effect=False)
    if offsets is not None:
        attrs = dict(attrs, offsets=offsets)
    if phase == LAST:
        arrays = [after, *arrays]
    return start(*arrays, **attrs, phase=np.int32(phase))


def done(token, arrays, attrs, fresh=None, in_place=False, part=DONE_WHOLE, offsets=None):
    """The averages of ``arrays`` once the exchange of ``token`` has ended (with ``fresh``,
    the corrected values instead). Written over ``fresh`` if given, or with ``in_place``
    over ``arrays`` (the gather algorithm reads each element before it writes it; XLA
    would copy an array that is still used elsewhere first). After a start in two parts,
    ``part`` and ``offsets`` average one part's arrays: the first part's once they have
    landed, the last part's once everything has."""
    import jax
    n = len(arrays)
    if fresh is not None:
        aliases = {1 + n + i: i for i in range(n)}
    elif in_place and attrs["algo"] == gather_code():
        aliases = {1 + i: i for i in range(n)}
    else:
        aliases = {}
    done = jax.ffi.ffi_call(DONE, shapes(arrays), has_side_effect=False,
                            input_output_aliases=aliases)
    keep = {k: attrs[k] for k in ("group", "algo", "offsets", "total")}
    if offsets is not None:
        keep["offsets"] = offsets
    return list(done(token, *arrays, *(fresh or []), **keep, part=np.int32(part)))


def wait(token, after, attrs, k, part=DONE_WHOLE):
    """``after[k]``, once the exchange of ``token`` has landed (``part``: after a start in
    two parts, its first part, or all of it) and every array of ``after`` exists."""
    import jax
    wait = jax.ffi.ffi_call(WAIT, jax.ShapeDtypeStruct(after[k].shape, after[k].dtype),
                            has_side_effect=False, input_output_aliases={1 + k: 0})
    return wait(token, *after, group=attrs["group"], part=np.int32(part))


def gather_code():
    from .._cuda import ALGORITHM_CODES
    return ALGORITHM_CODES[methods.GATHER]


def part_offsets(offsets, part):
    """The buffer offsets of a part's arrays: ``offsets[i]`` for each output i of the part."""
    return np.asarray([offsets[i] for i in part])
