"""pympgu's average as an XLA operation: average JAX arrays with the other ranks inside jit.

    from pympgu import xla
    step = jax.jit(lambda params, batch: xla.average(sgd(params, batch), group))

``average(arrays, group)`` queues, on XLA's own stream and in the middle of the jitted
function, what an Exchanger does around its kernel: pack the arrays into ``group``'s shared
buffer, all-reduce-average it with every rank (the same kernels, bit-identical replicas), and
unpack. No DLPack export or import, no host wait and no Python run at each call: the host
cost of an exchange becomes that of the jitted call it is part of.

``group`` is a connected ``pympgu.PeerGroup`` on the GPU the arrays live on, or an
``Exchanger`` (whose method and grid cap then apply, as ``Exchanger.xla_average``). Every
rank must call it with arrays of the same shapes and dtype in the same order, and the same
``algo`` and ``max_blocks``, and use its results alike: like XLA's own collectives it is not
a side effect, so XLA removes an average whose results are unused, and merges two averages
of the same arrays. Every rank compiles the same program, so it does so on every rank. The
group must stay open while any function traced with it may still run; after ``close()`` such
a function raises instead of touching freed memory.

``average_during(arrays, group, fn, *args)`` returns the averages and ``fn(*args)``, the
peers' data crossing the link on a side stream of the group's while XLA computes ``fn``: the
link and the SMs work at once. Only a pack (before ``fn``, unless the group has a shared
shadow) and the last pass (after it) stay on XLA's stream. ``correct_during`` is the same
with the one-step-delayed correction of an overlapped training step fused into that last
pass, or, given the shared shadow as a JAX array (``shadow_array``), into ``fn``'s own
update, with no pass at all. ``average_results(fn, which, group, *args)`` averages some of
``fn``'s own results, each sent as soon as it is computed, while ``fn`` computes the rest:
an exact exchange that hides behind the end of a training step, as DDP's gradient buckets
do. ``average_gradients(fn, updated, which, group, *args)`` goes one further for a step
whose ranks start from the same state: the gradients cross instead, and ``fn``'s own
elementwise update reads their mean from the shared shadow, so no pass averages anything
(above SPLIT_MAX_RANKS ranks the kernel averages them, and the update reads the means).
A group carries one of these exchanges at a time: two start/done pairs on the same group
must not interleave in one function, since both land in the same shadow.

Needs pympgu built with jaxlib installed (its XLA FFI headers; ``build.sh`` and
``pip install --no-build-isolation .`` see it) and JAX with CUDA.
"""
import functools
import math
import os

import numpy as np

TARGET = "pympgu_average"
START, DONE = "pympgu_average_start", "pympgu_average_done"
WAIT = "pympgu_average_wait"
_registered = False
# average_results cuts a function for exchanges of at least this many bytes (the size from
# which 'auto' takes the link-bound 'push' algorithm on 2 H200s); PYMPGU_SPLIT_MIN_BYTES
# overrides it.
SPLIT_MIN_BYTES = int(os.environ.get("PYMPGU_SPLIT_MIN_BYTES", 16 << 20))
# ... and of at most this many ranks (copies_to_every_peer); PYMPGU_SPLIT_MAX_RANKS
# overrides it.
SPLIT_MAX_RANKS = int(os.environ.get("PYMPGU_SPLIT_MAX_RANKS", 2))
# A kernel beside XLA's work, at its full grid (two blocks per SM), would hold every SM until
# it ends, and nothing would overlap; capped, it leaves SMs to the work. On 4 H200s the
# overlapped wide MLP took 1.013 ms a step with 64 blocks against 1.136 with 128
# (docs/BENCHMARKS.md, session 26; session 3 has the sweep on 2). PYMPGU_BESIDE_BLOCKS
# overrides it (every rank alike: the ranks' grids must match, roads()).
BESIDE_BLOCKS = int(os.environ.get("PYMPGU_BESIDE_BLOCKS", 64))
if not 1 <= BESIDE_BLOCKS <= 512:
    raise ValueError(f"PYMPGU_BESIDE_BLOCKS must be 1 to 512, got {BESIDE_BLOCKS}")
# A norm that every rank computes from the same mean gradients (a clipped update) must be
# the same bits on every rank, or the replicas drift apart. XLA's fusion autotuner times
# each fusion's candidate kernels (its own emitter's, and tilings of Triton's block-level
# emitter) on the rank that compiles it and keeps the fastest. On 2 ranks of one H200 the
# ranks chose other kernels for the same reductions in the update of a clipped step, which
# then summed the norm in other orders: 6 of 16 runs ended with replicas apart. With the
# autotuner off for the step, the ranks' reductions were the same kernels in 9 of 9 runs
# (benchmarks/probe_reduce.py --training, docs/TRAINING.md). A step whose every rank
# computes its update from the same mean is therefore compiled with the first of these
# options that this XLA knows. The first turns that autotuner off alone: the wide MLP's
# step took 0.575 ms with it and without on one H200. The second
# (--xla_gpu_exclude_nondeterministic_ops) turns every autotuner off, the gemms' too:
# 0.602 ms.
ALIKE_OPTIONS = ({"xla_gpu_experimental_enable_fusion_autotuner": False},
                 {"xla_gpu_exclude_nondeterministic_ops": True})
# The same in XLA_FLAGS, for every compile of a process (a step jitted without the
# options), and the stricter --xla_gpu_deterministic_ops, which implies the last.
_ALIKE_FLAGS = tuple(f"--{name}={str(value).lower()}" for options in ALIKE_OPTIONS
                     for name, value in options.items()) + ("--xla_gpu_deterministic_ops=true",)
DETERMINISTIC_FLAG = "--xla_gpu_exclude_nondeterministic_ops=true"  # the documented one


def accepts(options):
    """Whether this process's XLA compiles with jax.jit's ``compiler_options``: it refuses,
    at the compile, an option it does not know (INVALID_ARGUMENT). Any other failure is
    raised: a rank that took it for a refusal would compile its step otherwise than its
    peers."""
    import jax
    try:
        jax.jit(lambda x: x + 1, compiler_options=options).lower(np.float32(0)).compile()
    except jax.errors.JaxRuntimeError as e:
        if "INVALID_ARGUMENT" not in str(e):
            raise
        return False
    return True


@functools.cache
def alike_options():
    """jax.jit's ``compiler_options`` under which every rank compiles a step's reductions
    to the same kernels: {} on a CPU, where XLA's are fixed by the shapes; on GPUs the first
    of ALIKE_OPTIONS that this XLA accepts, or None if it accepts neither."""
    import jax
    if jax.default_backend() == "cpu":
        return {}
    return next((options for options in ALIKE_OPTIONS if accepts(options)), None)


def deterministic_reductions(alike=False):
    """Whether every rank compiles this process's reductions to the same kernels: with
    ``alike`` (the step is jitted with ``compiler_options=alike_options()``), on a CPU, or
    with XLA_FLAGS that turn the fusion autotuner off for every compile (DETERMINISTIC_FLAG,
    or one of the others in _ALIKE_FLAGS; read when JAX's GPU backend starts)."""
    import jax
    flags = os.environ.get("XLA_FLAGS", "").split()
    return (alike or jax.default_backend() == "cpu"
            or any(flag in flags for flag in _ALIKE_FLAGS))


def copies_to_every_peer(nranks):
    """Whether 'auto' takes, on ``nranks`` ranks, the exchanges that send every rank's whole
    arrays to every peer: the cut step and the gradients (average_results,
    average_gradients) and the overlapped step's 'gather' by the copy engines. They send
    R - 1 times the bytes per rank, where the two-shot kernels send 2 (R - 1) / R times: the
    same at R = 2, and R / 2 times more above. On 4 H200s the wide MLP's step took 1.69 ms
    with the gradients crossing against 1.04 with 'push' after the update, and 1.14 ms with
    the overlapped whole state gathered once in 4 steps against 0.79 with 'push' beside the
    step (docs/BENCHMARKS.md, session 26). At most SPLIT_MAX_RANKS ranks."""
    return nranks <= SPLIT_MAX_RANKS


def roads():
    """The settings that choose how a training step's exchange is laid into its XLA program,
    as text: every rank must have the same (the Exchanger checks it when it connects). A
    rank that cut its step where a peer did not, sent gradients where a peer sent
    parameters, or the whole state where a peer sent half of it (PYMPGU_OVERLAP_WHOLE),
    would read the peer's shadow by its own layout; one whose kernel beside XLA's work ran
    another grid (PYMPGU_BESIDE_BLOCKS) would wait at its barriers for blocks that never
    come."""
    return " ".join([str(SPLIT_MIN_BYTES), str(SPLIT_MAX_RANKS), str(BESIDE_BLOCKS),
                     os.environ.get("PYMPGU_GRADIENTS", "1"),
                     os.environ.get("PYMPGU_FUSED_CORRECTION", "1"),
                     str(int(overlap_whole()))])


def overlap_whole():
    """PYMPGU_OVERLAP_WHOLE: with --overlap and --sync-every K > 1, '1' (the default) sends
    the whole state once a cycle, in the due step; '0' sends the momentum in the due step
    and the parameters in the next, half the bytes at each (pympgu.train.Sync). Every rank
    must set it alike (roads)."""
    value = os.environ.get("PYMPGU_OVERLAP_WHOLE", "1")
    if value not in ("0", "1"):
        raise ValueError(f"PYMPGU_OVERLAP_WHOLE must be '0' or '1', got {value!r}")
    return value == "1"


@functools.lru_cache(maxsize=None)
def available():
    """(True, None), or (False, why the operation cannot be used here). Asked once per
    process: none of it changes while the process runs."""
    from . import cuda
    ok, info = cuda.availability()
    if not ok:
        return False, f"no usable GPU ({info})"
    from . import _cuda
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


def _register():
    global _registered
    if _registered:
        return
    ok, why = available()
    if not ok:
        raise RuntimeError(f"pympgu.xla.average is unavailable: {why}")
    import jax

    from . import _cuda
    for name in _cuda.XLA_OPERATIONS:
        jax.ffi.register_ffi_target(name, _cuda.xla_handler(name), platform="CUDA")
    _registered = True


def _attributes(arrays, group, algo, max_blocks, overlapped=False, pushed=False):
    """The operation's attributes for averaging ``arrays`` over ``group`` (checked here, so
    that a bad call fails when traced rather than when run), and the algorithm's name.
    overlapped: for the start/done pair, where 'auto' means 'gather' for float32. pushed:
    the arrays are only pushed into the peers' shared shadow, where XLA's own arithmetic
    reads them (average_gradients), so 'gather' takes any float dtype."""
    from ._cuda import ALGORITHM_CODES, ce_chunk_bytes
    from .exchange import ITEMSIZE, plan_layout
    layout = [(str(i), list(a.shape), str(a.dtype)) for i, a in enumerate(arrays)]
    offsets, total, dtype = plan_layout(layout)
    nbytes = total * ITEMSIZE[dtype]
    if nbytes > group.nbytes:
        raise ValueError(f"the arrays need {nbytes} bytes in the group's buffer, which holds "
                         f"{group.nbytes}")
    moves = dtype == "float32" or pushed  # what the gather algorithm may take
    if algo == "gather" and not (overlapped and moves):
        raise ValueError("algo 'gather' is for float32 arrays averaged during other work "
                         "(average_during, correct_during)")
    if overlapped and algo == "auto" and moves and copies_to_every_peer(group.nranks):
        # Beside XLA's work the copy engines move the bytes and no SM is taken from it. On
        # more ranks they move R - 1 copies, and a kernel capped at the group's grid
        # ('push', two-shot) takes less of the step than they do.
        chosen = "gather"
    else:
        chosen = "gather" if algo == "gather" else group.algorithm(nbytes, algo)
    blocks = group.max_blocks if max_blocks is None else int(max_blocks)
    _register()
    attrs = dict(group=np.int64(group.xla_id(shadow=chosen == "gather")),
                 algo=np.int32(ALGORITHM_CODES[chosen]), max_blocks=np.int32(blocks),
                 chunk_bytes=np.int64(ce_chunk_bytes()), offsets=np.asarray(offsets, np.int64),
                 total=np.int64(total))
    return attrs, chosen


def _shapes(arrays):
    import jax
    return [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in arrays]


def average(arrays, group, algo="auto", max_blocks=None):
    """The mean over every rank of each array in ``arrays``, as new arrays (inside jit they
    take the inputs' buffers). See the module docstring for the rules."""
    import jax
    if hasattr(group, "xla_average"):  # an Exchanger: its checks, method and grid cap
        return group.xla_average(arrays)
    arrays = list(arrays)
    if not arrays:
        return []
    attrs, _ = _attributes(arrays, group, algo, max_blocks)
    call = jax.ffi.ffi_call(
        TARGET, _shapes(arrays),
        # Not a side effect: JAX dispatches a function with effects through Python, not its
        # C++ fast path, which cost the fused training step about 1 ms of host time per call
        # (docs/BENCHMARKS.md). The module docstring says what users must keep to instead.
        has_side_effect=False,
        input_output_aliases={i: i for i in range(len(arrays))})
    return list(call(*arrays, **attrs))


def average_during(arrays, group, fn, *args, algo="auto", max_blocks=None):
    """``(averages, fn(*args))``: the mean over every rank of each array in ``arrays``, taken
    while ``fn`` computes. ``args`` and ``fn``'s result are JAX arrays, or pytrees of them.

    ``fn`` starts once the arrays are packed, and the averages are made once it has
    finished; in between, the peers' data crosses the link on the group's high-priority side
    stream beside ``fn``'s kernels. With ``algo="auto"`` float32 arrays go by the copy
    engines ('gather'), which leave every SM to ``fn``, on up to SPLIT_MAX_RANKS ranks
    (copies_to_every_peer), and by the group's kernel above; the kernels may be named.
    The same rules as ``average`` apply (module docstring). Put in ``fn`` the work that does
    not need the averages: the overlap is at most its length.
    """
    if hasattr(group, "xla_average_during"):  # an Exchanger
        return group.xla_average_during(arrays, fn, *args)
    return _overlapped(list(arrays), group, fn, args, algo, max_blocks, correct=False)


def correct_during(arrays, group, fn, *args, algo="auto", max_blocks=None, shadow=None,
                   ready=()):
    """The one-step-delayed correction of an overlapped exchange, in one call.

    ``fn(*args)`` returns ``(new, extra)``, where ``new`` is a list whose first
    ``len(arrays)`` entries are the successors of ``arrays`` (same shapes), computed while
    ``arrays`` are averaged as in ``average_during``; any further entries are other values
    of the same update (the parameters, when their momentum is averaged), neither
    corrected nor returned. Returns ``([new_i + (mean_i - arrays_i)], extra)``: the step's
    own change, applied to the average. With the gather algorithm the average and the
    correction are one pass over the bytes.

    ``shadow`` (``shadow_array(group)``, passed into the jitted function as an argument;
    the gather algorithm and a shared shadow) takes that pass away: the mean is summed,
    in rank order, inside XLA's own elementwise update of each array (``fn``'s
    elementwise tail, pympgu.jaxsplit.Tail), which then reads the peers' values straight
    from the shadow where they landed. XLA's stream waits for them just before that
    update, once the gradients it reads exist.

    ``fn``'s work waits for the exchange's start through the arguments it reads, except
    ``arrays`` and ``ready``: list there the arguments that need not wait (a model's state
    that is not averaged at this step), since what comes out of that wait is not fused as
    freely (``_hold``).
    """
    if hasattr(group, "xla_correct_during"):  # an Exchanger
        return group.xla_correct_during(arrays, fn, *args, shadow=shadow, ready=ready)
    return _overlapped(list(arrays), group, fn, args, algo, max_blocks, correct=True,
                       shadow=shadow, ready=ready)


def shadow_array(group, dtype="float32"):
    """``correct_during``'s ``shadow`` for ``group``: a JAX array of ``dtype`` over its
    shared shadow, without a copy (average_gradients' takes its wire's dtype). Pass it
    into the jitted function as an argument: closed over, JAX would copy it into the
    program as a constant. None when the group has no shared shadow, or
    when its number of ranks is not a power of two: XLA's division then rounds otherwise
    than pympgu's kernels (by one unit in the last place, seen on 3 H200 ranks), or when
    'auto' does not take the gather algorithm on that many ranks (copies_to_every_peer)."""
    import jax
    if not _reads_shadow(group.nranks):
        return None
    view = group.shadow_view(dtype)
    return None if view is None else jax.dlpack.from_dlpack(view)


def _reads_shadow(nranks):
    """Whether XLA's own arithmetic reads the shared shadow on nranks ranks (shadow_array,
    gradient_plan): 'auto' lands the peers' arrays there (copies_to_every_peer), and the
    mean divides as the kernels' does (_fusable)."""
    return copies_to_every_peer(nranks) and _fusable(nranks)


def _fusable(nranks):
    """Whether XLA's arithmetic may take the mean of nranks ranks as the kernels do: more
    than one, and a power of two, by which every division is exact (shadow_array)."""
    return nranks > 1 and nranks & (nranks - 1) == 0


def _overlapped(arrays, group, fn, args, algo, max_blocks, correct, shadow=None, ready=()):
    from jax import lax
    if not arrays:
        result = fn(*args)
        return ([], result[1]) if correct else ([], result)
    attrs, chosen = _attributes(arrays, group, algo, max_blocks, overlapped=True)
    if shadow is not None and not (chosen == "gather" and getattr(group, "shadow_offset", 0)
                                   and _fusable(group.nranks)):
        raise ValueError("correct_during: shadow= needs the gather algorithm (float32, algo "
                         "'auto' or 'gather'), a group made with shadow=True, and a power "
                         "of two ranks")
    token = _start(arrays, attrs, _WHOLE)
    # XLA orders independent work as it likes; these barriers make fn's inputs wait for the
    # start, and the done wait for fn's results, so that fn runs while the link works.
    token, args = _hold(token, args, [*arrays, *ready])
    if shadow is not None:
        fused = _corrected_in_update(arrays, group, fn, args, attrs, token, shadow)
        if fused is not None:
            return fused
    result = fn(*args)
    token, result = lax.optimization_barrier((token, result))
    if not correct:
        return _done(token, arrays, attrs), result
    new, extra = result
    fresh = _fresh(new, arrays)
    if chosen == "gather":  # the correction fused into the average's pass
        return _done(token, arrays, attrs, fresh), extra
    means = _done(token, arrays, attrs)
    return [f + (m - a) for f, m, a in zip(fresh, means, arrays)], extra


def _hold(token, args, arrays):
    """``(token, args)``, with the arguments that are not among ``arrays`` (a training
    step's minibatch, say) held behind the start's token: fn's work that needs them waits
    for the start. ``arrays`` (the averaged ones, and any others that need not wait) are not
    held: with the weights and biases coming out of the barrier too, XLA stopped fusing the
    bias adds into cuBLAS's matrix products and fused the backward pass otherwise, which
    cost the wide MLP's overlapped step 0.03 ms (docs/BENCHMARKS.md, session 11). When
    no argument is left to hold, all are held."""
    import jax
    from jax import lax
    leaves, tree = jax.tree_util.tree_flatten(args)
    own = {id(a) for a in arrays}
    held = [i for i, leaf in enumerate(leaves) if id(leaf) not in own] or range(len(leaves))
    token, kept = lax.optimization_barrier((token, [leaves[i] for i in held]))
    for i, leaf in zip(held, kept):
        leaves[i] = leaf
    return token, jax.tree_util.tree_unflatten(tree, leaves)


def _corrected_in_update(arrays, group, fn, args, attrs, token, shadow):
    """correct_during's result with the correction inside fn's own update (``shadow``), or
    None when fn has no work before its update for the wait to follow (then pympgu's pass
    corrects)."""
    import jax
    from jax import lax

    from . import jaxsplit
    leaves, tree = jax.tree_util.tree_flatten(args)

    out_tree, updated = [], []

    def flat(*xs):
        result = fn(*jax.tree_util.tree_unflatten(tree, xs))
        outs, structure = jax.tree_util.tree_flatten(result)
        out_tree[:], updated[:] = [structure], [len(result[0])]
        return outs

    # Inlined: fn may return a jitted program's results in an order of its own (JaxStep).
    # The tail is that of every new value fn returns, not of the averaged arrays' alone:
    # the parameters' update reads the momentum's new value, which would otherwise leave
    # the momentum's tail empty when the momentum alone is averaged.
    cut = jaxsplit.Tail(jaxsplit.trace(flat, leaves, inline=True), range(updated[0]))

    if not cut.crossing:
        return None

    def hold(gradients):
        # The wait takes what the update reads from before it (the gradients), so that XLA's
        # stream waits there; it passes the smallest through, so that XLA keeps it (XLA
        # drops an operation whose results nothing uses, even through a barrier).
        k = min(range(len(gradients)), key=lambda i: math.prod(gradients[i].shape))
        gradients = list(gradients)
        gradients[k] = _wait(token, gradients, attrs, k)
        return lax.optimization_barrier((gradients, shadow))

    outs, landed = cut.run(leaves, hold)
    new, extra = jax.tree_util.tree_unflatten(out_tree[0], outs)
    slot = _slot_elems(group, int(attrs["total"]))
    return [f + (_rank_mean(a, landed, at, slot, group) - a)
            for f, a, at in zip(_fresh(new, arrays), arrays, attrs["offsets"])], extra


def _rank_mean(own, landed, at, slot, group):
    """The mean of ``own`` over every rank, in XLA's arithmetic: the peers' values are read
    from the shadow where they landed (``landed``, slots of ``slot`` elements, the array at
    element ``at`` of each). Summed as pmg_mean_list sums (csrc/average.cu), in rank order,
    then one division, by a power of two, which XLA rounds as the kernel does
    (shadow_array). Values of a half-precision wire are summed in float32, as the kernels
    sum them."""
    from jax import lax
    rank, nranks = group.rank, group.nranks
    size = math.prod(own.shape)
    total = None
    for r in range(nranks):
        if r == rank:
            term = own
        else:
            begin = (r if r < rank else r - 1) * slot + int(at)
            term = lax.slice(landed, (begin,), (begin + size,)).reshape(own.shape)
        term = term.astype(np.float32)
        total = term if total is None else total + term
    return total / np.float32(nranks)


def _fresh(new, arrays):
    """The successors of ``arrays`` at the head of ``new``, checked."""
    fresh = list(new[:len(arrays)])
    if [(f.shape, f.dtype) for f in fresh] != [(a.shape, a.dtype) for a in arrays]:
        raise ValueError("correct_during: fn's new values must begin with one array per "
                         f"averaged array, of its shape and dtype; got {len(fresh)} for "
                         f"{len(arrays)}")
    return fresh


def _slot_elems(group, total, itemsize=4):
    """Elements of ``itemsize`` bytes per shadow slot for an exchange of ``total``:
    gather_elems in csrc/xla_ffi.cc (rounded up to 64, within the buffer)."""
    return min((total + 63) // 64 * 64, group.nbytes // itemsize)


# The phases of a start (csrc/xla_ffi.cc): with the barrier before, after, or both.
_FIRST, _LAST, _WHOLE = 1, 2, 3
# The parts of a done: the whole exchange, or the first or last part's arrays of a start in
# two parts (csrc/xla_ffi.cc).
_DONE_WHOLE, _DONE_FIRST, _DONE_LAST = 0, 1, 2


def _start(arrays, attrs, phase, offsets=None, after=None):
    """Queue the exchange of ``arrays`` (the start's part ``phase``); returns its token. The
    last part takes the first part's token (``after``) as its first operand: XLA drops an
    operation whose token nothing uses, even through an optimization barrier."""
    import jax
    start = jax.ffi.ffi_call(START, jax.ShapeDtypeStruct((), np.uint32), has_side_effect=False)
    if offsets is not None:
        attrs = dict(attrs, offsets=offsets)
    if phase == _LAST:
        arrays = [after, *arrays]
    return start(*arrays, **attrs, phase=np.int32(phase))


def _done(token, arrays, attrs, fresh=None, in_place=False, part=_DONE_WHOLE, offsets=None):
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
    elif in_place and attrs["algo"] == _gather_code():
        aliases = {1 + i: i for i in range(n)}
    else:
        aliases = {}
    done = jax.ffi.ffi_call(DONE, _shapes(arrays), has_side_effect=False,
                            input_output_aliases=aliases)
    keep = {k: attrs[k] for k in ("group", "algo", "offsets", "total")}
    if offsets is not None:
        keep["offsets"] = offsets
    return list(done(token, *arrays, *(fresh or []), **keep, part=np.int32(part)))


def _wait(token, after, attrs, k, part=_DONE_WHOLE):
    """``after[k]``, once the exchange of ``token`` has landed (``part``: after a start in
    two parts, its first part, or all of it) and every array of ``after`` exists."""
    import jax
    wait = jax.ffi.ffi_call(WAIT, jax.ShapeDtypeStruct(after[k].shape, after[k].dtype),
                            has_side_effect=False, input_output_aliases={1 + k: 0})
    return wait(token, *after, group=attrs["group"], part=np.int32(part))


def _gather_code():
    from ._cuda import ALGORITHM_CODES
    return ALGORITHM_CODES["gather"]


def _part_offsets(offsets, part):
    """The buffer offsets of a part's arrays: ``offsets[i]`` for each output i of the part."""
    return np.asarray([offsets[i] for i in part])


def _send_in_parts(split, flat, attrs, offsets, part_attrs=None):
    """Evaluate ``split`` (a jaxsplit.Split with early results) on ``flat`` with its early
    results' start between its phases and its late results' start after them; ``offsets[i]``
    is output i's offset in the buffer, and ``part_attrs(part)``, if given, a part's own
    attributes (its algorithm and grid). Returns the last token, every output, and the parts
    with the kind of done or wait that each takes: the early one's when it has landed, the
    late one's when everything has."""
    from jax import lax
    part_attrs = part_attrs or (lambda part: attrs)

    def start(values):
        return _start(values, part_attrs(split.early), _FIRST if split.late else _WHOLE,
                      _part_offsets(offsets, split.early))

    token, outs = split.run(flat, start, lambda t, v: lax.optimization_barrier((t, v)))
    parts = [(split.early, _DONE_FIRST if split.late else _DONE_WHOLE)]
    if split.late:  # after phase 2 by its operands, and after the first part by the token
        token = _start([outs[i] for i in split.late], part_attrs(split.late), _LAST,
                       _part_offsets(offsets, split.late), after=token)
        parts.append((split.late, _DONE_LAST))
    return token, outs, parts


def average_results(fn, which, group, *args, algo="auto", max_blocks=None):
    """``fn(*args)``, a flat list of arrays, with the arrays at positions ``which`` replaced by
    their means over every rank; each mean starts as soon as its array is computed.

    With ``algo="auto"``, float32 arrays and a group made with ``shadow=True`` (an Exchanger
    made with ``shadow=True``), ``fn`` is cut in two (pympgu.jaxsplit): the arrays computed
    first, such as a network's last layers, cross the link by DMA while ``fn`` computes the
    rest, and the others follow. One pass at the end averages them all, summed in rank
    order, so every rank gets the same bits. Otherwise, for exchanges under
    ``SPLIT_MIN_BYTES`` or groups of more than ``SPLIT_MAX_RANKS``, or when ``fn`` offers
    nothing to hide the link behind, it is ``average`` after ``fn``. The rules of
    ``average`` apply (module docstring); ``which`` names the arrays in the order the
    group's buffer lays them out.
    """
    if hasattr(group, "xla_average_results"):  # an Exchanger
        return group.xla_average_results(fn, which, *args)
    import jax
    from jax import lax

    from . import jaxsplit
    flat = list(args)
    which = list(which)
    split = None
    if (which and getattr(group, "shadow_offset", 0) and group.nranks > 1
            and copies_to_every_peer(group.nranks) and algo == "auto"):
        closed = jaxsplit.trace(fn, flat)
        shapes = [closed.jaxpr.outvars[i].aval for i in which]
        nbytes = sum(math.prod(s.shape) * 4 for s in shapes)
        # Small exchanges are not cut: the kernels average them in tens of microseconds,
        # less than the second part and its copies cost the host (the seed's 1.6 MB step
        # took 0.45 ms cut against 0.20 whole, docs/BENCHMARKS.md).
        if all(s.dtype == np.float32 for s in shapes) and nbytes >= SPLIT_MIN_BYTES:
            split = jaxsplit.Split(closed, which)
            if not split.early:
                split = None
    if split is None:
        outs = list(fn(*flat))
        for i, mean in zip(which, average([outs[i] for i in which], group, algo, max_blocks)):
            outs[i] = mean
        return outs
    attrs, _ = _attributes([jax.ShapeDtypeStruct(s.shape, s.dtype) for s in shapes], group,
                           algo, max_blocks, overlapped=True)
    offsets = dict(zip(which, attrs["offsets"]))
    # The first part is averaged while the last crosses the link.
    token, outs, parts = _send_in_parts(split, flat, attrs, offsets)
    token, outs = lax.optimization_barrier((token, outs))
    for part, kind in parts:
        means = _done(token, [outs[i] for i in part], attrs, in_place=True, part=kind,
                      offsets=_part_offsets(offsets, part))
        if kind == _DONE_FIRST:
            # Puts the last part's done after this one on XLA's stream, where the two would
            # otherwise go in any order.
            token, means = lax.optimization_barrier((token, means))
        for i, mean in zip(part, means):
            outs[i] = mean
    return outs


def average_gradients(fn, updated, which, group, *args, shadow=None, local=(), algo="auto",
                      max_blocks=None, plan=None, exact=True, wire=None, alike=False):
    """``fn(*args)``, a flat list of arrays, with its results at ``updated`` (a training
    step's new state) computed from the mean over every rank of what their update reads:
    DDP's average of the gradients, inside the step, with no pass over the parameters.

    ``fn``'s results at ``updated`` must come out of an elementwise update
    (pympgu.jaxsplit.Tail) that is affine in what it reads from the work before it (its
    gradients: SGD, with momentum, weight decay or L1 terms, is), and every rank must start
    from the same values of every argument but those at positions ``local`` (the
    minibatch), which the update must not read. Then every rank computes the same update
    of the same mean, the same bits, and that update is the mean of the ranks' own updates,
    up to rounding: what ``average_results(fn, updated)`` would give.

    The gradients computed first cross while ``fn`` computes the rest (the cut of
    average_results, jaxsplit.Split), and the update of the first part's arrays runs as
    soon as their mean is there, while the rest cross. Two ways (gradients_by_copies says
    which):

    - on up to SPLIT_MAX_RANKS ranks (a power of two) with ``shadow`` (shadow_array(group),
      passed into the jitted function as an argument) and ``algo="auto"``, every rank's
      gradients cross whole by DMA, straight into the peers' shared shadow, and XLA's own
      update reads them there, summed in rank order;
    - otherwise the group's kernel averages each part on the side stream (the first part's
      capped at BESIDE_BLOCKS blocks, beside XLA's work, unless ``max_blocks`` is given),
      sending 2 (R - 1) / R of the bytes, and the update reads the means it unpacks.

    Where neither applies (fewer bytes than ``SPLIT_MIN_BYTES``, without a ``wire``; an
    update that is not affine in its gradients or reads a ``local`` argument;
    ``PYMPGU_GRADIENTS=0``), it returns ``average_results(fn, which, group, *args)``: the
    results at ``which`` averaged after they are computed. ``plan``, gradient_plan's result
    for these arguments, saves tracing ``fn`` again.

    ``exact=False`` takes any elementwise update, at any size: an update not affine in its
    gradients (Adam's) then is not the mean of the ranks' updates but the update of their
    mean gradient, what DDP computes, the same on every rank. Sums of what crosses that
    the update reads (the norm of a clipped update, jaxsplit.Tail's ``statistics``) are then
    computed from the means too; on GPUs only where every rank compiles them to the same
    kernels, so that they sum in the same order: ``alike=True`` says that the jitted step
    takes ``compiler_options=alike_options()`` (else DETERMINISTIC_FLAG in XLA_FLAGS).

    ``wire='bfloat16'`` (or 'float16') sends the gradients rounded to it, half the bytes,
    as DDP's bf16_compress_hook does, at any size: every rank sums the ranks' rounded
    values in float32, in rank order (its own rounded too), so the update still reads the
    same mean on every rank (by the kernel: their mean, rounded to the wire). The shadow is
    then ``shadow_array(group, wire)``. Where the gradients do not cross, nothing is
    rounded: ``average_results`` averages the results in float32.
    """
    if hasattr(group, "xla_average_gradients"):  # an Exchanger: its own wire
        return group.xla_average_gradients(fn, updated, which, *args, shadow=shadow,
                                           local=local, exact=exact, alike=alike)
    import jax
    from jax import lax

    from . import jaxsplit
    flat = list(args)
    if plan is None:
        plan = gradient_plan(fn, updated, group, flat, local, shadow, algo, exact, wire, alike)
    tail = plan[0]
    if tail is None:
        return average_results(fn, which, group, *flat, algo=algo, max_blocks=max_blocks)
    n = len(tail.crossing)
    low = _wire(wire)
    crossing = [jax.ShapeDtypeStruct(v.aval.shape, low or v.aval.dtype) for v in tail.crossing]

    def before(*a):  # the work before the update, its gradients rounded to the wire's dtype
        outs = list(tail.evaluate_before(a))
        return [o.astype(low) for o in outs[:n]] + outs[n:] if low else outs

    # Each gradient crosses whole. Computed in row blocks, so that a large one's first block
    # crosses while XLA computes the next, the wide MLP's step took 0.76 ms against 0.67:
    # the update then reads the blocks' concatenation, which XLA's emitter for it split from
    # the weights' pass and put after the last wait (docs/BENCHMARKS.md, session 19).
    split = jaxsplit.Split(jaxsplit.trace(before, flat), range(n))
    part_attrs = None
    if gradients_by_copies(group, shadow, algo):
        if shadow.dtype != crossing[0].dtype:
            raise ValueError(f"average_gradients: the shadow is {shadow.dtype}, the wire "
                             f"{crossing[0].dtype}: pass shadow_array(group, wire)")
        attrs, _ = _attributes(crossing, group, algo, max_blocks, overlapped=True, pushed=True)
        offsets = attrs["offsets"]
        slot = _slot_elems(group, int(attrs["total"]), crossing[0].dtype.itemsize)

        def means(token, values, part, kind):  # the shadow's reads after the wait
            values, landed = lax.optimization_barrier((values, shadow))
            return [_rank_mean(v, landed, offsets[i], slot, group) for v, i in zip(values, part)]
    else:
        # Each part's arrays lie together in the buffer, the first part's first: its kernel
        # averages their stretch alone.
        order = [*split.early, *split.late] if split.early else list(range(n))
        attrs, _ = _attributes([crossing[i] for i in order], group, algo, max_blocks)
        offsets = np.empty(n, np.int64)
        offsets[order] = attrs["offsets"]
        part_attrs = functools.partial(_kernel_part, attrs, offsets, crossing, group, algo,
                                       max_blocks, split)

        def means(token, values, part, kind):
            # Unpacked. Read in place instead (the buffer passed into the step as a JAX
            # array, the reads held behind a done of the smallest array, since XLA drops a
            # wait that only a barrier reads), the wide MLP's step on 2 H200s took 0.872 ms
            # against 0.867 (docs/BENCHMARKS.md, session 27).
            means = _done(token, values, part_attrs(part), part=kind,
                          offsets=_part_offsets(offsets, part))
            return [m.astype(np.float32) for m in means] if low else means
    if split.early:
        token, outs, parts = _send_in_parts(split, flat, attrs, offsets, part_attrs)
    else:  # nothing worth cutting: every gradient crosses once the work before is done
        outs = before(*flat)
        token = _start(outs[:n], attrs, _WHOLE, attrs["offsets"])
        parts = [(list(range(n)), _DONE_WHOLE)]

    # fn's other results (a step's cost), computed before the first wait: XLA would
    # otherwise put them last, where the stream has nothing else to do, when it could run
    # them while it waits for the first part to land (the wide MLP's L2 term reads every
    # weight: 0.02 ms).
    others = [o for o in outs[n:] if hasattr(o, "shape")]

    def waiting(part, kind):
        def take(values, earlier):
            # XLA's stream waits for the part to land once its gradients exist (and fn's
            # other results, for the first), and, for the last part, once the first part's
            # update is queued, so that it runs while the last part crosses. The smallest
            # array passes through the wait, so that XLA keeps it.
            values = list(values)
            k = min(range(len(values)), key=lambda i: math.prod(values[i].shape))
            after = values + ([min(earlier, key=lambda e: math.prod(e.shape))] if earlier
                              else others)
            values[k] = _wait(token, after, attrs, k, part=kind)
            return means(token, values, part, kind)
        return part, take

    made = tail.evaluate_tail(flat, outs[:n], [waiting(part, kind) for part, kind in parts])
    rest = dict(zip(tail.rest(), outs[n:]))
    return [rest[k] if k in rest else made[k] for k in range(len(made))]


def _wire(wire):
    """The dtype gradients cross in for average_gradients' ``wire``, or None: their own."""
    if wire in (None, "float32"):
        return None
    if wire not in ("bfloat16", "float16"):
        raise ValueError(f"wire must be 'float32', 'bfloat16' or 'float16', got {wire!r}")
    import jax.numpy as jnp
    return jnp.dtype(wire)


def gradients_by_copies(group, shadow, algo):
    """Whether average_gradients sends every rank's whole gradients by DMA into the peers'
    shared shadow for XLA's update to sum, rather than averaging them with the group's
    kernel: on up to SPLIT_MAX_RANKS ranks, a power of two (_reads_shadow), given the
    shadow and 'auto'."""
    return bool(_reads_shadow(group.nranks) and shadow is not None and algo == "auto"
                and getattr(group, "shadow_offset", 0))


def _kernel_part(attrs, offsets, crossing, group, algo, max_blocks, split, part):
    """A part's attributes when the kernel averages the gradients (average_gradients): the
    algorithm for the bytes of its stretch of the buffer (``offsets``, in elements), and,
    for a first part that runs beside XLA's work on the rest, a grid capped at
    BESIDE_BLOCKS unless ``max_blocks`` is given."""
    from ._cuda import ALGORITHM_CODES
    last = max(part, key=lambda i: offsets[i])
    elements = int(offsets[last]) + math.prod(crossing[last].shape) - min(
        int(offsets[i]) for i in part)
    nbytes = elements * np.dtype(crossing[last].dtype).itemsize
    blocks = int(attrs["max_blocks"])
    if max_blocks is None and split.late and list(part) == list(split.early):
        blocks = min(blocks, BESIDE_BLOCKS)
    return dict(attrs, algo=np.int32(ALGORITHM_CODES[group.algorithm(nbytes, algo)]),
                max_blocks=np.int32(blocks))


def gradient_plan(fn, updated, group, args, local=(), shadow=None, algo="auto", exact=True,
                  wire=None, alike=False):
    """``(tail, None)`` when ``average_gradients`` takes ``fn``'s gradients on these flat
    ``args`` (pympgu.jaxsplit.Tail, the update it feeds), else ``(None, why not)``;
    ``exact``, ``wire`` and ``alike`` as average_gradients takes them. A half-precision
    wire takes them at any size: it is the only road on which it crosses inside XLA."""
    from . import jaxsplit
    if os.environ.get("PYMPGU_GRADIENTS", "1") == "0":
        return None, "PYMPGU_GRADIENTS=0"
    if algo == "gather":
        return None, "the gather algorithm averages parameters only"
    # Exact, the tail need only be affine in what crosses, and any work on gradients alone
    # may go before it; else what crosses must be the gradients themselves, and a norm of
    # them (a clipped update's) is the norm of their mean.
    tail = jaxsplit.Tail(jaxsplit.trace(fn, list(args), inline=True), list(updated),
                         finish=exact, statistics=not exact)
    if not tail.crossing:
        return None, "the results have no elementwise update"
    # A new value the update does not compute must be the same on every rank: an input
    # passed through, or a constant.
    computed = tail.computed_before(updated)
    if computed:
        return None, f"results {computed} are not computed by an elementwise update"
    if any(v.aval.dtype != np.float32 for v in tail.crossing):
        return None, "the update reads values other than float32 from before it"
    if tail.reads(local):
        return None, "the update reads a rank's own inputs (local=)"
    if not exact:
        if tail.finishing:
            return None, ("the update reads parts of its gradients, not the gradients "
                          f"({tail.finishing[0].primitive.name} of two)")
        if not deterministic_reductions(alike) and any(
                e.primitive.name in jaxsplit.REDUCTIONS for e in tail.tail):
            return None, ("the update reduces what crosses (a norm), which XLA's autotuning "
                          "may compile to other kernels, summing in other orders, on each "
                          "rank: jit the step with compiler_options=pympgu.xla."
                          "alike_options() and pass alike=True (pympgu.train does), or set "
                          f"XLA_FLAGS={DETERMINISTIC_FLAG}")
        # The mean gradient's update differs from the mean of the updates: take it at
        # every size, so that what a run computes does not depend on its model's size.
        return tail, None
    bad = tail.nonlinear()
    if bad is not None:
        return None, f"the update is not affine in its gradients ({bad.primitive.name})"
    nbytes = sum(math.prod(v.aval.shape) * 4 for v in tail.crossing)
    if nbytes < SPLIT_MIN_BYTES and _wire(wire) is None:
        return None, (f"{nbytes} bytes of gradients, under PYMPGU_SPLIT_MIN_BYTES="
                      f"{SPLIT_MIN_BYTES}")
    return tail, None
