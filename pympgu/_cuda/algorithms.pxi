# 'auto''s choice of algorithm by buffer size: the thresholds come from pympgu.settings
# (docs/DECISIONS.md, "Algorithm thresholds"), read once when a PeerGroup is made.

LL_MAX_BYTES = PMG_LL_MAX_BYTES


def ll_max_bytes():
    """Largest buffer 'auto' averages with 'll' (one crossing of the link, no barrier;
    csrc/pympgu.h); above it, one-shot or two-shot. PYMPGU_LL_MAX_BYTES, at most
    LL_MAX_BYTES (0 turns 'll' off)."""
    return min(settings.get().ll_max_bytes, LL_MAX_BYTES)


def oneshot_max_bytes():
    """Largest buffer 'auto' sends one-shot; above it, two-shot (PYMPGU_ONESHOT_MAX_BYTES)."""
    return settings.get().oneshot_max_bytes


def push_min_bytes():
    """Smallest buffer 'auto' averages with 'push' (two-shot by stores) rather than
    'twoshot'; PeerGroups at least this large get a staging area by default
    (PYMPGU_PUSH_MIN_BYTES)."""
    return settings.get().push_min_bytes


def ce_min_bytes():
    """Smallest buffer 'auto' averages with 'ce' (two-shot, every byte by DMA) rather than
    'push', in a PeerGroup with a staging area (PYMPGU_CE_MIN_BYTES)."""
    return settings.get().ce_min_bytes


def ce_chunk_bytes():
    """Bytes of each of the last two pipelined chunks of a rank's slice in the 'ce'
    algorithm; each chunk before them is twice the one after it (ce_chunks;
    PYMPGU_CE_CHUNK_BYTES; every rank must use the same)."""
    return settings.get().ce_chunk_bytes


def ce_chunks(int nranks, size_t n, dtype, chunk_bytes=None):
    """The bounds, in elements from the start of a rank's slice, of the chunks that the 'ce'
    algorithm pipelines for n elements of dtype over nranks ranks: a list of chunks + 1
    offsets, the last the slice's length. chunk_bytes defaults to ce_chunk_bytes()."""
    cdef size_t bounds[PMG_CE_MAX_CHUNKS + 1]
    cdef int count = 0
    cdef size_t last = ce_chunk_bytes() if chunk_bytes is None else chunk_bytes
    status = pmg_ce_chunks(nranks, n, dtype_code(dtype), last, bounds, &count)
    if status:
        _raise(status, f"ce_chunks(nranks={nranks}, n={n}, chunk_bytes={last})")
    return [bounds[i] for i in range(count + 1)]


def _method_codes():
    """Each method's pmg_algo code, as the C table of methods names it (csrc/methods.cu),
    held against pympgu.methods: a build whose table is not the registry's fails here."""
    codes = {}
    cdef const char *name
    for code in range(64):
        name = pmg_method_name(code)
        if name != NULL:
            codes[name.decode()] = code
    if set(codes) != set(methods.KERNELS):
        raise ImportError(f"pympgu's compiled methods {sorted(codes)} are not pympgu.methods' "
                          f"{sorted(methods.KERNELS)}: rebuild pympgu (./build.sh)")
    codes.update({m.name: PMG_ALGO_GATHER for m in methods.REGISTRY.values() if m.gathers})
    return codes


ALGORITHMS = methods.KERNELS
# The C API's code of each method (pmg_algo), the XLA pair's gather among them.
ALGORITHM_CODES = _method_codes()
