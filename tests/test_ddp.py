"""pympgu.ddp's bookkeeping on the CPU, with stand-ins for torch and the PeerGroup: where
each bucket goes in the buffer, the order of its work, and the setup's refusals. The
gradients themselves are checked bit for bit on GPUs (tests/test_gpu_ddp.py)."""
import collections
import types

import pytest

from pympgu import ddp


class Param:
    def __init__(self, n, itemsize=4, requires_grad=True):
        self.n, self.itemsize, self.requires_grad = n, itemsize, requires_grad

    def numel(self):
        return self.n

    def element_size(self):
        return self.itemsize


def test_bucket_bytes_aligns_each_parameter_and_skips_frozen_ones():
    params = [Param(1), Param(64), Param(65, 2), Param(1000, requires_grad=False)]
    assert ddp.bucket_bytes(params) == 256 + 256 + 256
    assert ddp.bucket_bytes([Param(100, 4)]) == 512


class Grads:
    """A bucket's flat gradients, as much of a torch tensor as the hook reads."""

    def __init__(self, n, dtype="float32", itemsize=4):
        self.n, self.dtype, self.itemsize = n, f"torch.{dtype}", itemsize

    def numel(self):
        return self.n

    def element_size(self):
        return self.itemsize


class Bucket:
    def __init__(self, index, grads):
        self._index, self.grads = index, grads

    def index(self):
        return self._index

    def buffer(self):
        return self.grads


def fake_state(nbytes, log):
    """A PeerState of rank 0 of 2 whose group, torch and cuda only record what the hook
    asks of them, in order."""

    class View:
        def __init__(self, dtype, shape, offset):
            self.key = (dtype, shape, offset)

        def order_before(self, stream):
            log.append(("torch waits for the group", self.key, stream))

    class Mean:
        def __init__(self, view):
            self.view = view

        def copy_(self, grads):
            log.append(("copy in", self.view.key))

    class Group:
        stream = types.SimpleNamespace(wait_for=lambda producer: log.append(
            ("group waits for torch", producer)))

        def __init__(self):
            self.nbytes = nbytes

        def data(self, dtype, shape, offset):
            return View(dtype, shape, offset)

        def allreduce(self, n, dtype, algo, synchronize, offset):
            log.append(("allreduce", n, dtype, algo, synchronize, offset))

    class Future:
        def __init__(self, devices):
            pass

        def set_result(self, value):
            self.value = value

    torch = types.SimpleNamespace(
        futures=types.SimpleNamespace(Future=Future),
        from_dlpack=Mean,
        cuda=types.SimpleNamespace(current_stream=lambda device: types.SimpleNamespace(
            cuda_stream=1234)))
    state = ddp.PeerState.__new__(ddp.PeerState)
    state.torch, state.group = torch, Group()
    state.rank, state.nranks, state.device, state.method = 0, 2, "cuda:0", "auto"
    state.cursor, state.places = 0, {}
    state.host_ranks = [0, 1]
    return state


def test_each_bucket_keeps_its_place_and_its_work_is_ordered():
    log = []
    state = fake_state(4096, log)
    first = [Bucket(0, Grads(10)), Bucket(1, Grads(100, "bfloat16", 2))]
    means = [ddp.average_hook(state, b).value for b in first]
    assert [m.view.key for m in means] == [("float32", (10,), 0), ("bfloat16", (100,), 256)]
    assert log[:4] == [("copy in", ("float32", (10,), 0)),
                       ("group waits for torch", 1234),
                       ("allreduce", 10, "float32", "auto", False, 0),
                       ("torch waits for the group", ("float32", (10,), 0), 1234)]
    assert log[6] == ("allreduce", 100, "bfloat16", "auto", False, 256)
    # The next backward pass starts over at bucket 0, in the same places, views reused.
    again = ddp.average_hook(state, first[0]).value
    assert again is means[0] and log[-2] == ("allreduce", 10, "float32", "auto", False, 0)


def test_buckets_beyond_the_buffer_are_refused():
    state = fake_state(512, [])
    ddp.average_hook(state, Bucket(0, Grads(64)))
    with pytest.raises(ValueError, match="more than the 512 bytes"):
        ddp.average_hook(state, Bucket(1, Grads(65)))


def test_a_closed_state_refuses():
    state = fake_state(512, [])
    state.group = None
    with pytest.raises(RuntimeError, match="rank 0: the PeerState is closed"):
        ddp.average_hook(state, Bucket(0, Grads(4)))


def facts(**changed):
    base = {"handle": b"h", "device": 0, "nbytes": 4096, "method": "auto",
            "settings": "ll_max_bytes=1", "max_blocks": 8}
    return dict(base, **changed)


@pytest.mark.parametrize("rank1,match", [
    (facts(nbytes=8192), "size the buffer alike.*rank 0: 4096, rank 1: 8192"),
    (facts(method="push"), "use the same method"),
    (facts(settings="ll_max_bytes=2"), r"the same PYMPGU_\* settings.*ll_max_bytes=2")])
def test_ranks_set_up_otherwise_are_refused(rank1, match):
    state = fake_state(4096, [])
    with pytest.raises(ValueError, match=match):
        state._connect(None, [facts(), rank1])


def test_a_rank_that_could_not_set_up_is_named():
    with pytest.raises(RuntimeError, match="could set up its exchange; rank 1: CudaError: "
                                           "out of memory"):
        ddp._raise_any(None, [None, "CudaError: out of memory"], "set up its exchange")
    with pytest.raises(KeyError, match="its own"):  # a rank's own error comes first
        ddp._raise_any(KeyError("its own"), [None, "CudaError: out"], "set up its exchange")
    ddp._raise_any(None, [None, None], "set up its exchange")


def test_ranks_share_a_buffer_with_their_hosts_ranks():
    state = fake_state(4096, [])
    state.rank, state.nranks = 3, 4
    state._place_on_hosts(["a", "b", "a", "b"])
    assert (state.host_ranks, state.local, state.node, state.nnodes) == ([1, 3], 1, 1, 2)
    assert state.first_host_ranks == [0, 2]
    with pytest.raises(ValueError, match="every host must run as many ranks; ranks by host: "
                                         "a: 3, b: 1"):
        state._place_on_hosts(["a", "a", "b", "a"])


def test_only_float32_crosses_hosts():
    state = fake_state(4096, [])
    state.across = object()
    with pytest.raises(ValueError, match="across hosts pympgu averages float32 tensors, got "
                                         "bfloat16"):
        ddp.average_hook(state, Bucket(0, Grads(100, "bfloat16", 2)))


def test_gpus_without_peer_access_are_named():
    state = fake_state(4096, [])
    state.device = types.SimpleNamespace(index=0)
    cuda = types.SimpleNamespace(can_access_peer=lambda a, b: False)
    with pytest.raises(RuntimeError, match="GPU 0 has no peer access to rank 1's GPU 1"):
        state._connect(cuda, [facts(), facts(device=1)])


def test_connect_gives_every_rank_the_smallest_grid():
    state = fake_state(4096, [])
    state.device = types.SimpleNamespace(index=0)
    seen = {}
    state.group.connect = lambda handles, max_blocks: seen.update(h=handles, b=max_blocks)
    cuda = types.SimpleNamespace(can_access_peer=lambda a, b: True)
    state._connect(cuda, [facts(handle=b"0"), facts(handle=b"1", device=1, max_blocks=4)])
    assert seen == {"h": [b"0", b"1"], "b": 4}


# ---------------------------------------------------------------- ModelAverager


def test_layout_gives_each_dtype_one_span_of_aligned_places():
    offsets, regions, nbytes = ddp._layout([("float32", 10), ("bfloat16", 100),
                                            ("float32", 65)])
    assert offsets == [0, 768, 256]
    assert regions == [(0, 192, "float32"), (768, 128, "bfloat16")]
    assert nbytes == 1024


@pytest.mark.parametrize("shape,strides,dense", [
    ((2, 3, 4), (12, 4, 1), True),
    ((2, 3, 4, 5), (60, 1, 15, 3), True),    # channels-last
    ((3, 4), (1, 3), True),                  # transposed
    ((1, 4), (99, 1), True),                 # a size-1 dimension's stride is free
    ((3, 0), (5, 1), True),
    ((3, 4), (8, 1), False),                 # a slice: gaps
    ((3, 4), (0, 1), False),                 # expanded: overlaps
])
def test_dense_takes_tensors_that_cover_their_memory_once(shape, strides, dense):
    assert ddp._dense(shape, strides) is dense


def test_ranks_averaging_other_tensors_are_told_which():
    state = fake_state(4096, [])
    layout = [("parameter w", "float32", 10), ("parameter b", "float32", 2)]
    other = [layout[0], ("optimizer state 'momentum_buffer' of w", "float32", 10)]
    with pytest.raises(ValueError, match="average the same tensors.*rank 0: #1 "
                       r"\('parameter b'.*rank 1: #1 \(\"optimizer state"):
        state._connect(None, [facts(layout=layout), facts(layout=other)])
    with pytest.raises(ValueError, match="rank 0: 2 entries, rank 1: #2"):
        state._connect(None, [facts(layout=layout), facts(layout=layout + layout[:1])])


class Tensor:
    """As much of a torch tensor as ModelAverager.average reads: where it lives."""

    def __init__(self, ptr, log, shape=(4,), dtype="float32"):
        self.ptr, self.log, self.shape, self.dtype = ptr, log, shape, dtype

    def data_ptr(self):
        return self.ptr

    @property
    def data(self):
        return self

    @data.setter
    def data(self, other):
        self.log.append(("re-point", self.ptr, other.ptr))
        self.ptr = other.ptr

    def copy_(self, other):
        self.log.append(("copy", other.ptr, self.ptr))


def fake_averager(log):
    """A ModelAverager of rank 0 of 2, set up, over a parameter and its momentum."""

    class Group:
        stream = types.SimpleNamespace(wait_for=lambda producer: log.append(
            ("group waits", producer)))

        def allreduce(self, n, dtype, algo, synchronize, offset):
            log.append(("allreduce", n, dtype, offset))

    avg = ddp.ModelAverager.__new__(ddp.ModelAverager)
    avg.rank, avg.method, avg.group, avg.device = 0, "auto", Group(), "cuda:0"
    avg.ready, avg.closed = True, False
    weight = Tensor(1000, log)
    avg.optimizer = types.SimpleNamespace(state={weight: {"momentum": Tensor(2000, log)}})
    avg.names = ["parameter w", "optimizer state 'momentum' of w"]
    avg.fixed = [weight]
    avg.states = [(weight, "momentum")]
    avg.stated = 1
    avg.places = [Tensor(1000, log), Tensor(2000, log)]
    avg.ptrs = [1000, 2000]
    avg.regions = [(0, 128, "float32"), (512, 64, "bfloat16")]
    avg.view = types.SimpleNamespace(order_before=lambda s: log.append(("torch waits", s)))
    avg.torch = types.SimpleNamespace(cuda=types.SimpleNamespace(
        current_stream=lambda device: types.SimpleNamespace(cuda_stream=77)))
    return avg, weight


def test_model_average_is_the_kernels_alone_once_placed():
    log = []
    avg, _ = fake_averager(log)
    avg.average()
    assert log == [("group waits", 77),
                   ("allreduce", 128, "float32", 0), ("allreduce", 64, "bfloat16", 512),
                   ("torch waits", 77)]


def test_a_tensor_found_elsewhere_is_copied_back_into_its_place():
    log = []
    avg, weight = fake_averager(log)
    avg.optimizer.state[weight]["momentum"] = Tensor(5, log)  # as load_state_dict leaves it
    avg.average()
    assert log[:3] == [("copy", 5, 2000), ("re-point", 5, 2000), ("group waits", 77)]
    log.clear()
    avg.average()
    assert log[0] == ("group waits", 77)


def test_a_changed_optimizer_state_is_refused():
    log = []
    avg, weight = fake_averager(log)
    avg.optimizer.state[weight]["momentum"] = Tensor(5, log, shape=(5,))
    with pytest.raises(ValueError, match="momentum' of w is now"):
        avg.average()
    del avg.optimizer.state[weight]["momentum"]
    with pytest.raises(ValueError, match="momentum' of w is gone"):
        avg.average()
    avg.optimizer.state["another parameter"] = {"momentum": Tensor(6, log)}
    with pytest.raises(ValueError, match="state for 2 parameters, 1 at the first average"):
        avg.average()
    avg.closed = True
    with pytest.raises(RuntimeError, match="rank 0: the ModelAverager is closed"):
        avg.average()
    assert not [e for e in log if e[0] == "allreduce"]


def test_a_first_average_inside_a_capture_is_refused_before_any_setup():
    """It would meet the other ranks and allocate, neither of which a CUDA graph captures;
    once set up, averages inside a capture are the kernels alone."""
    log = []
    avg, _ = fake_averager(log)
    avg.ready = False
    avg.torch.cuda.is_current_stream_capturing = lambda: True
    avg._setup = lambda prepare: log.append("setup")
    with pytest.raises(RuntimeError, match="rank 0: the first average.*CUDA graph"):
        avg.average()
    assert log == []
    avg.ready = True
    avg.average()
    assert [e[0] for e in log] == ["group waits", "allreduce", "allreduce", "torch waits"]


def test_prepare_lays_out_the_tensors_and_refuses_what_it_cannot_average():
    """Each dtype one span of aligned places, in the averager's order; a float64 tensor and
    one with gaps are named."""

    CUDA0 = collections.namedtuple("Device", "type index")("cuda", 0)

    class Spec:
        def __init__(self, n, dtype, strides=(1,)):
            self.n, self.dtype, self.strides = n, f"torch.{dtype}", strides
            self.shape = (n,) if len(strides) == 1 else (n // 2, 2)
            self.device = CUDA0

        def numel(self):
            return self.n

        def stride(self):
            return self.strides

    def prepared(*tensors):
        avg = ddp.ModelAverager.__new__(ddp.ModelAverager)
        avg.rank, avg.names = 0, [f"parameter {k}" for k in range(len(tensors))]
        avg._collect = lambda: None
        avg.states, avg.fixed = [], list(tensors)
        return avg, avg._prepare()

    avg, (device, nbytes, shared) = prepared(Spec(10, "float32"), Spec(3, "bfloat16"),
                                             Spec(100, "float32"))
    assert avg.offsets == [0, 768, 256] and nbytes == 1024  # 100 floats take 512 bytes
    assert avg.regions == [(0, 192, "float32"), (768, 128, "bfloat16")]
    assert shared["layout"][1] == ("parameter 1", "bfloat16", 3)
    with pytest.raises(ValueError, match="parameter 1 is float64; pympgu averages"):
        prepared(Spec(10, "float32"), Spec(10, "float64"))
    with pytest.raises(ValueError, match="parameter 0 overlaps itself or has gaps"):
        prepared(Spec(10, "float32", strides=(4, 1)))


def test_close_gives_the_tensors_in_place_memory_of_their_own():
    log = []
    avg, weight = fake_averager(log)
    moved = Tensor(7, log)  # an optimizer tensor found elsewhere: left where it is
    avg.optimizer.state[weight]["momentum"] = moved
    Tensor.clone = lambda self, memory_format: Tensor(self.ptr + 1, log)
    closed = []
    avg.group.close = lambda: closed.append(True)
    avg.torch.cuda.synchronize = lambda device: log.append(("synchronize", device))
    avg.torch.preserve_format = "preserve"
    try:
        avg.close()
    finally:
        del Tensor.clone
    assert log == [("synchronize", "cuda:0"), ("re-point", 1000, 1001)]
    assert weight.ptr == 1001 and moved.ptr == 7 and closed == [True]
    assert avg.group is None and avg.places == [] and avg.closed
    with pytest.raises(RuntimeError, match="the ModelAverager is closed"):
        avg.average()


def test_close_skips_an_optimizer_tensor_that_is_gone():
    log = []
    avg, weight = fake_averager(log)
    del avg.optimizer.state[weight]["momentum"]
    Tensor.clone = lambda self, memory_format: Tensor(self.ptr + 1, log)
    avg.group.close = lambda: None
    avg.torch.cuda.synchronize = lambda device: None
    avg.torch.preserve_format = "preserve"
    try:
        avg.close()
    finally:
        del Tensor.clone
    assert log == [("re-point", 1000, 1001)]


@pytest.mark.parametrize("argv,message", [
    (["--gpus", "0"], "--gpus: give at least 2 ranks"),
    (["--every", "0"], "--every must be at least 1, got 0"),
    (["--hidden", "500", "0"], "--hidden must be at least 1, got 0"),
    (["--lr", "0"], "--lr must be positive, got 0.0"),
    (["--data-dir", "/no/such/dir"], "--data-dir: /no/such/dir: no such directory"),
    (["--batch-size", "5000"], "--batch-size 5000 on 2 ranks needs more than the 8000"),
])
def test_the_local_sgd_example_names_a_bad_flag_before_any_rank_starts(argv, message, capsys):
    import importlib.util
    import os
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                        "examples", "torch_local_sgd.py")
    spec = importlib.util.spec_from_file_location("torch_local_sgd", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)  # torch is imported by the ranks alone
    with pytest.raises(SystemExit) as info:
        example.main(argv)
    assert info.value.code == 2
    assert message in capsys.readouterr().err


def test_the_hook_passes_ddps_check_of_its_signature():
    """DDP's register_comm_hook refuses a return annotation other than the type
    torch.futures.Future[torch.Tensor] itself (a string among them); pympgu's hook has none."""
    import inspect
    sig = inspect.signature(ddp.average_hook)
    assert sig.return_annotation is inspect.Signature.empty
    assert len(sig.parameters) == 2
