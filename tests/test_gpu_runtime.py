"""GPU workers exchanging through the whole runtime (launcher, ZMQ, Exchanger, IPC)."""
import pytest

from conftest import visible_gpus
from pympgu.runtime import WorkerFailed, launch
from pympgu.training.config import RunConfig, optimizer_defaults
from pympgu.training.launcher import run as train
from runtime_targets import average_rounds_gpu, part_rounds, wire_rounds

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]


def needs_xla():
    """Skip unless pympgu's XLA operations can run here (JAX with a GPU, built with them)."""
    pytest.importorskip("jax")
    from pympgu import xla
    ok, why = xla.available()
    if not ok:
        pytest.skip(why)


def devices(nranks):
    n = visible_gpus()
    return [r % n for r in range(nranks)]  # ranks share GPUs when there are fewer


def gpu_config(nranks=2, **over):
    """One epoch of exact per-step averaging on the embedded data, JAX workers on
    ``nranks`` GPUs (sharing them when there are fewer), with ``over`` changed."""
    return RunConfig(**dict(dict(backend="jax", epochs=1, devices=devices(nranks)), **over))


@pytest.mark.parametrize("nranks", [2, 4, 8])
def test_gpu_workers_exchange_through_runtime(nranks):
    pytest.importorskip("torch")
    results = launch(average_rounds_gpu, (4,), gpus=devices(nranks))
    assert len({r["digest"] for r in results}) == 1
    assert all(r["stats"]["exchanges"] == 4 for r in results)


def test_gpu_worker_failure_is_reported():
    pytest.importorskip("torch")
    with pytest.raises(WorkerFailed) as info:
        launch(average_rounds_gpu, ("not a number",), gpus=devices(2))
    assert "TypeError" in info.value.details


@pytest.mark.parametrize("nranks,wire,overlap", [(2, "bfloat16", True), (3, "float16", False)])
def test_gpu_workers_low_precision_wire(nranks, wire, overlap):
    pytest.importorskip("torch")
    results = launch(wire_rounds, (4, wire, overlap), gpus=devices(nranks))
    assert len({r["digest"] for r in results}) == 1
    assert all(r["stats"]["exchanges"] == 4 for r in results)


@pytest.mark.parametrize("nranks,wire,flat,p2p", [
    (2, None, False, True), (3, "bfloat16", True, True), (2, None, True, False)])
def test_gpu_workers_average_parts_of_the_layout(nranks, wire, flat, p2p, pympgu_env):
    """The momentum alone, then the parameters alone, in the buffer's first half
    (--overlap --sync-every K from Python); without peer access too (the copy method)."""
    pytest.importorskip("torch")
    if not p2p:
        pympgu_env(no_p2p=1)  # spawned workers inherit it
    results = launch(part_rounds, (7, wire, flat), gpus=devices(nranks))
    assert len({r["digest"] for r in results}) == 1
    assert all(r["stats"]["exchanges"] == 7 for r in results)


def test_gpu_workers_without_peer_access_fall_back(pympgu_env):
    """The copy method with host barriers, as GPUs without P2P use it (forced here)."""
    pytest.importorskip("torch")
    pympgu_env(no_p2p=1)  # spawned workers inherit it
    results = launch(average_rounds_gpu, (3,), gpus=devices(2))
    assert len({r["digest"] for r in results}) == 1


def test_gpu_workers_jax_without_host_waits():
    """JAX arrays in and out through DLPack's stream handshake, as the training loop does."""
    pytest.importorskip("jax")
    from runtime_targets import jax_rounds
    results = launch(jax_rounds, (4,), gpus=devices(2))
    assert len({r["digest"] for r in results}) == 1
    assert all(r["stats"]["exchanges"] == 4 for r in results)


@pytest.mark.parametrize("nranks,method,shadow,max_ranks", [
    (2, "auto", False, "8"), (2, "oneshot", False, "8"), (2, "twoshot", False, "8"),
    (2, "push", False, "8"), (2, "ce", False, "8"), (3, "auto", False, "8"),
    (2, "auto", True, "8"), (3, "auto", True, "8"), (4, "auto", True, "2")])
def test_gpu_exchange_inside_xla(nranks, method, shadow, max_ranks, pympgu_env):
    """pympgu's average as an XLA operation inside jit, plain, overlapped and as the results
    are computed, alternating with the Python path. With a shadow, peers push into it, and
    the results round is cut on 3 ranks too (PYMPGU_SPLIT_MAX_RANKS=8, above the default).
    On 4 ranks at the default, 'auto' overlaps with a kernel instead of gathering, and the
    correction comes after the done operation, not inside XLA's update (a power of two
    ranks, yet no shadow)."""
    needs_xla()
    pympgu_env(split_max_ranks=max_ranks)  # the spawned workers read it
    from xla_targets import xla_rounds
    results = launch(xla_rounds, (10, method, 1 << 23, shadow), gpus=devices(nranks))
    assert len({r["digest"] for r in results}) == 1
    assert all(r["closed_raises"] for r in results)
    in_update = shadow and nranks in (2, 4) and nranks <= int(max_ranks)
    assert all(r["corrected"].endswith("in the update") == in_update for r in results), results


@pytest.mark.parametrize("gradients,nranks,max_ranks,update,wire", [
    (True, 2, 2, "affine", None), (False, 2, 2, "affine", None),
    (True, 4, 4, "affine", None), (True, 4, 2, "affine", None),
    (True, 3, 2, "affine", None), (True, 2, 1, "affine", None),
    (True, 2, 2, "squared", None), (True, 3, 2, "squared", None),
    (True, 2, 2, "clipped", None), (True, 4, 2, "clipped", None),
    (True, 2, 2, "affine", "bfloat16"), (True, 3, 2, "affine", "bfloat16"),
    (True, 2, 2, "affine", "float16"), (True, 3, 2, "affine", "float16")])
def test_gpu_update_of_the_mean_gradient_inside_xla(gradients, nranks, max_ranks, update,
                                                    wire, pympgu_env):
    """StepExchange.average_gradients: the step cut in two, its update fed the ranks' mean
    gradient, bit for bit against numpy and the same on every rank; where the gradients
    are too few bytes to cross (PYMPGU_SPLIT_MIN_BYTES above them), the parameters' average
    after the update in its place. Up to PYMPGU_SPLIT_MAX_RANKS ranks the gradients cross
    into the shadow (on 4 ranks each rank pushes to three peers and the update sums four
    gradients in rank order); above it the kernel averages each part ('twoshot' for the
    first, capped beside the late work, 'push' for the last), on 3 ranks too, and the update
    reads the means. ``update``: 'squared', an update not affine in its gradients (as
    Adam's), taken with exact=False: it reads the square of the mean gradient; 'clipped'
    (--clip-norm) scales the gradients by the norm of their mean, which the update computes
    from what crossed. ``wire``: the gradients cross rounded to bfloat16 or float16 (into
    the shadow on 2 ranks, by the kernel on 3)."""
    needs_xla()
    from xla_targets import gradient_rounds
    pympgu_env(split_max_ranks=max_ranks,  # the spawned workers read both
               split_min_bytes=16 << 20 if gradients else 1 << 40)
    results = launch(gradient_rounds, (7, 1 << 23, update, wire), gpus=devices(nranks))
    assert len({r["digest"] for r in results}) == 1
    by_kernel = nranks > max_ranks
    for r in results:
        assert (r["why_not"] is None) == gradients, r["why_not"]
        assert r["road"].endswith(f"averaged by the kernel ({nranks} ranks)") == (
            by_kernel and gradients), r["road"]
        assert (f"sent in {wire}" in r["road"]) == bool(wire), r["road"]


@pytest.mark.parametrize("stream_barriers", [True, False])
def test_gpu_xla_timeline_and_barrier_stream(stream_barriers):
    """The cut exchange with its barriers as stream memory operations (the default) or as
    kernels (the fallback on drivers without them), checked bit for bit by xla_rounds, and
    the timeline of its last cut round (PeerGroup.record_timeline): every mark in the order
    its stream imposes."""
    needs_xla()
    from xla_targets import xla_rounds
    results = launch(xla_rounds, (10, "auto", 1 << 23, True, stream_barriers, True),
                     gpus=devices(2))
    assert len({r["digest"] for r in results}) == 1
    slack = 0.01  # ms: events on two streams, at the timer's resolution
    for r in results:
        t = r["timeline"]
        assert t["start"] == 0.0, t
        side = [t[k] for k in ("side_begin", "first_sent", "first_landed", "last_sent",
                               "landed")]
        on_xla = [t[k] for k in ("start", "last_start", "done", "averaged")]
        for order in (side, on_xla):
            assert all(b >= a - slack for a, b in zip(order, order[1:])), t
        assert t["side_begin"] >= -slack and t["averaged"] >= t["landed"] - slack, t
        # The barrier that tells XLA the first part has landed waits for the last start.
        assert t["first_landed"] >= t["last_start"] - slack, t


def test_gpu_stream_barrier_times_out_on_a_late_peer():
    """The XLA pair's stream barriers (the default) hold no SM and
    have no timeout of their own: the group's watchdog gives them the group's. A peer that
    never comes holds the exchange for that long, not for good, and the next exchange fails
    with an error that names it."""
    needs_xla()
    from runtime_targets import late_peer
    results = launch(late_peer, (2.0,), gpus=devices(2))
    first = results[0]
    assert 2.0 <= first["held_s"] < 20, first
    assert "barrier for rank 1, which died or stopped exchanging" in first["error"], first
    for r in results:  # the pages stay mapped, their names gone once every rank mapped them
        assert not r["page_while_open"] and not r["page_after_close"], r


@pytest.mark.parametrize("every", [1, 2])
def test_gpu_training_overlapped_inside_xla(every):
    """--overlap with JAX workers: the average runs inside the step's XLA call, beside its
    compute, its correction inside XLA's update, and learns as well as plain averaging on
    the same data and seed; run() checks that the replicas end identical. With
    --sync-every 2 the due step averages the whole state, momentum too."""
    needs_xla()
    cfg = gpu_config(sync_every=every, hidden=[64])
    plain = train(cfg)[-1]
    overlapped = train(cfg.replace(overlap=True))[-1]
    assert plain["exchange_share"] is None and overlapped["exchange_share"] is None  # fused
    assert overlapped["test_error"] < 0.25, overlapped  # chance is 0.9
    assert abs(overlapped["test_error"] - plain["test_error"]) <= 0.03, (plain, overlapped)


def test_gpu_training_overlapped_by_a_kernel_on_4_ranks():
    """--overlap --sync-every 2 on 4 ranks, above PYMPGU_SPLIT_MAX_RANKS: the average runs
    inside the step's XLA call as a kernel on the side stream (no shared shadow; the
    correction after the done operation) and learns as plain averaging does on the same
    data and seed; run() checks that the replicas end identical. Two epochs: on 4 ranks one
    epoch is half as many steps as on 2."""
    needs_xla()
    cfg = gpu_config(4, sync_every=2, epochs=2, hidden=[64])
    plain = train(cfg)[-1]
    overlapped = train(cfg.replace(overlap=True))[-1]
    assert plain["exchange_share"] is None and overlapped["exchange_share"] is None  # in XLA
    assert overlapped["test_error"] < 0.25, overlapped  # chance is 0.9
    assert abs(overlapped["test_error"] - plain["test_error"]) <= 0.03, (plain, overlapped)


@pytest.mark.parametrize("nesterov", [False, True])
def test_gpu_training_cut_inside_xla(pympgu_env, nesterov):
    """Exact averaging with the step cut in two, forced on a small MLP: its gradients cross
    while the first layer's is computed, and every rank's update reads their mean (SGD's,
    and Nesterov's, both affine in the gradients). Exact, so it learns as the uncut step
    (the parameters averaged after the update) does on the same data and seed (the same
    mean, rounded the same way up to summation order), and run() checks that the replicas
    end identical."""
    needs_xla()
    cfg = gpu_config(hidden=[256, 128], nesterov=nesterov)
    whole = train(cfg)[-1]
    pympgu_env(split_min_bytes=0)  # the spawned workers read it
    cut = train(cfg)[-1]
    assert cut["road"] == "the update of the mean gradients", cut
    assert "under PYMPGU_SPLIT_MIN_BYTES" in whole["road"], whole
    assert cut["test_error"] < 0.25, cut
    assert abs(cut["test_error"] - whole["test_error"]) <= 0.01, (whole, cut)


def example(name):
    """The path of examples/``name``."""
    import os
    return os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                        "examples", name)


def test_gpu_training_your_own_model(pympgu_env):
    """A model of the user's (examples/residual_mlp.py, --model) on 2 GPUs: its update is
    pympgu.models.Model's, so --sync-every 1 takes the gradients' road (forced for its
    small size by PYMPGU_SPLIT_MIN_BYTES=0) and learns as the parameters' average after the
    update (its road at the default size) does on the same data and seed; run() checks
    that the replicas end identical."""
    needs_xla()
    cfg = gpu_config(hidden=[128, 128, 128], model=f"{example('residual_mlp.py')}:ResidualMLP")
    averaged = train(cfg)[-1]
    pympgu_env(split_min_bytes=0)  # the spawned workers read it
    gradients = train(cfg)[-1]
    assert gradients["road"] == "the update of the mean gradients", gradients
    assert "under PYMPGU_SPLIT_MIN_BYTES" in averaged["road"], averaged
    assert gradients["test_error"] < 0.25, gradients  # chance is 0.9
    assert abs(gradients["test_error"] - averaged["test_error"]) <= 0.01, (averaged, gradients)


@pytest.mark.parametrize("name", ["lenet.py:LeNet", "strided.py:StridedConvNet"])
def test_gpu_training_convnet(pympgu_env, name):
    """examples/lenet.py, a convnet by pympgu.nnet's conv2d (XLA's convolution under the
    JAX backend), and examples/strided.py (padded convolutions of stride 2), on 2 GPUs: by
    the gradients' road (forced for their small size by PYMPGU_SPLIT_MIN_BYTES=0), the step
    cut where its last layers' gradients are ready, and with --overlap, the average beside
    the step. Both learn, and run() checks that the replicas end identical."""
    needs_xla()
    from pympgu import models
    path = example(name)
    cfg = gpu_config(model=path, hidden=list(models.load(path).default_hidden))
    pympgu_env(split_min_bytes=0)  # the spawned workers read it
    gradients = train(cfg)[-1]
    overlapped = train(cfg.replace(overlap=True))[-1]
    assert gradients["road"] == "the update of the mean gradients", gradients
    # One CPU run after its first epoch: LeNet 10.3%, the strided net 9.5%.
    assert gradients["test_error"] < 0.15 and overlapped["test_error"] < 0.15, \
        (gradients, overlapped)


def test_gpu_training_batch_norm(pympgu_env, tmp_path):
    """examples/resnet.py, whose batch norms normalise each rank's minibatch by its own
    statistics, on 2 GPUs by the gradients' road and with --overlap: both learn, run()
    checks that the replicas end identical, and the best checkpoint, evaluated on the CPU
    by pympgu.evaluate with the population statistics that the GPU estimated and saved,
    gives the test error the GPU run printed, within an example or two."""
    needs_xla()
    import json
    import subprocess
    import sys
    out = str(tmp_path / "run")
    cfg = gpu_config(epochs=2, model=example("resnet.py:ResNet"), hidden=[8, 8, 16, 16],
                     batch_size=32, lr=0.1)
    pympgu_env(split_min_bytes=0)  # the spawned workers read it
    gradients = train(cfg.replace(out=out))
    overlapped = train(cfg.replace(overlap=True))[-1]
    assert gradients[-1]["road"] == "the update of the mean gradients", gradients
    # CPU runs of this configuration: 60-65% after 2 epochs (a ResNet on 250 steps).
    assert gradients[-1]["test_error"] < 0.75 and overlapped["test_error"] < 0.75, \
        (gradients, overlapped)
    report = tmp_path / "eval.json"
    subprocess.run([sys.executable, "-m", "pympgu.evaluate", out, "--json", str(report)],
                   check=True, timeout=300, stdout=subprocess.DEVNULL)
    best = min(gradients, key=lambda h: h["valid_error"])
    assert abs(json.loads(report.read_text())["error"] - best["test_error"]) <= 0.002, best


@pytest.mark.parametrize("name", [None, "strided.py:StridedConvNet"])
def test_gpu_training_bfloat16(pympgu_env, name):
    """--compute-dtype bfloat16 on 2 GPUs, the MLP and a convnet: the step's products and
    convolutions read bfloat16 (pympgu.precision) and its mean gradients still take the
    gradients' road into the float32 update. It learns as float32 does on the same data
    and seed, within a point, and run() checks that the replicas end identical."""
    needs_xla()
    from pympgu import models
    cfg = gpu_config()
    if name:
        cfg = cfg.replace(model=example(name),
                          hidden=list(models.load(example(name)).default_hidden))
    pympgu_env(split_min_bytes=0)  # the spawned workers read it
    low = train(cfg.replace(compute_dtype="bfloat16"))[-1]
    full = train(cfg)[-1]
    assert low["road"] == "the update of the mean gradients", low
    assert low["test_error"] < 0.15, low  # the CPU's, after one epoch: 9 to 11%
    assert abs(low["test_error"] - full["test_error"]) <= 0.01, (low, full)


@pytest.mark.parametrize("optimizer,wire", [("sgd", "bfloat16"), ("adam", "bfloat16"),
                                            ("sgd", "float16")])
def test_gpu_training_half_precision_gradients(pympgu_env, optimizer, wire):
    """--exchange-dtype bfloat16 (or float16) at --sync-every 1 on 2 GPUs: the gradients
    cross rounded to it inside the step's XLA call (DDP's bf16_compress_hook) and every rank's
    update reads the same float32 sum of them, at any size of model (the float32 run
    takes the same road, forced for the MLP's small size). It learns as the float32 wire
    does on the same data and seed, within two points, and run() checks that the replicas
    end identical. With --sync-every 2 the wire's change crosses from Python, outside the
    step."""
    needs_xla()
    cfg = gpu_config(hidden=[256, 128], optimizer=optimizer,
                     lr=0.002 if optimizer == "adam" else RunConfig().lr)
    pympgu_env(split_min_bytes=0)  # the spawned workers read it
    low = train(cfg.replace(exchange_dtype=wire))[-1]
    full = train(cfg)[-1]
    assert low["road"] == f"the update of the mean gradients, sent in {wire}", low
    assert low["exchange_share"] is None, low  # inside the step
    assert low["test_error"] < 0.25, low  # chance is 0.9
    assert abs(low["test_error"] - full["test_error"]) <= 0.02, (low, full)
    every2 = train(cfg.replace(exchange_dtype=wire, sync_every=2))[-1]
    assert every2["road"].startswith(f"queued from Python after the step: the {wire} wire")
    assert every2["test_error"] < 0.25, every2


def mean_gradients_against_own_steps(cfg):
    """Trains ``cfg`` at --sync-every 1 twice: on 2 GPUs by the gradients' road, every
    rank's update reading the mean gradient as DDP's does, and on 2 CPU workers (JAX on
    the CPU), each rank taking its own step and the whole state averaged after it. Both
    must learn, within 3 points of each other, and run() checks that the replicas end
    identical."""
    ddp = train(cfg)[-1]
    averaged = train(cfg.replace(devices=(None, None)))[-1]
    assert ddp["road"] == "the update of the mean gradients", ddp
    assert averaged["road"].endswith("(CPU workers)"), averaged
    assert averaged["exchange_share"] is not None, averaged
    assert ddp["test_error"] < 0.25 and averaged["test_error"] < 0.25, (ddp, averaged)
    assert abs(ddp["test_error"] - averaged["test_error"]) <= 0.03, (ddp, averaged)


@pytest.mark.parametrize("optimizer", ["adam", "adamw"])
def test_gpu_training_adam(optimizer):
    """--optimizer adam (or adamw, its weights decayed) with a cosine schedule after a
    warm-up, on 2 GPUs: at --sync-every 1 the step takes the gradients' road at any size
    (the MLP here is far under PYMPGU_SPLIT_MIN_BYTES) and every rank takes Adam's step
    on the mean gradient, as DDP does. It learns as CPU workers do, each rank taking its
    own step and the whole state, both moments too, averaged after it, and run() checks
    that the replicas end identical."""
    needs_xla()
    cfg = gpu_config(hidden=[256, 128], optimizer=optimizer, schedule="cosine", warmup=0.25,
                     **dict(optimizer_defaults(optimizer), lr=0.002))
    mean_gradients_against_own_steps(cfg)


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_gpu_training_clipped(optimizer):
    """--clip-norm on 2 GPUs at --sync-every 1: the update scales the gradients by their
    norm, so it is not affine in them, and the step takes the gradients' road at any size
    (the MLP here is far under PYMPGU_SPLIT_MIN_BYTES): every rank clips the mean gradient
    by its norm, as DDP with clip_grad_norm_ does. It learns as CPU workers do, each rank
    clipping its own, and run() checks that the replicas end identical (every rank
    compiles the step alike: pympgu.xla.alike)."""
    needs_xla()
    cfg = gpu_config(hidden=[256, 128], optimizer=optimizer, clip_norm=0.5,
                     **optimizer_defaults(optimizer))
    mean_gradients_against_own_steps(cfg)


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_gpu_training_ema(pympgu_env, optimizer):
    """--ema on 2 GPUs at --sync-every 1: the moving average moves in the update, from the
    new parameters, so every rank computes it from the mean gradients with the rest of the
    state (SGD's update, the average's included, still affine in them). It learns as CPU
    workers do, each rank moving its own and the whole state, the average too, averaged
    after the update, evaluated by the average; run() checks that the replicas end
    identical."""
    needs_xla()
    # 0.9: one epoch here is 31 steps, after which 0.99's average would still hold 73% of
    # the first, untrained parameters.
    cfg = gpu_config(hidden=[256, 128], optimizer=optimizer, ema=0.9,
                     **optimizer_defaults(optimizer))
    # SGD's exact road starts at 16 MiB of gradients; this MLP's are 0.9 MB.
    pympgu_env(split_min_bytes=0)
    mean_gradients_against_own_steps(cfg)


@pytest.mark.parametrize("max_ranks", [4, 2])
def test_gpu_training_mean_gradients_on_4_ranks(max_ranks, pympgu_env):
    """--sync-every 1 on 4 ranks, the gradients' road taken by a small MLP
    (PYMPGU_SPLIT_MIN_BYTES=0), by DMA into the shadow (PYMPGU_SPLIT_MAX_RANKS=4) or by the
    kernel (the default): it learns as the parameters' average after the update (its road
    at the default size) does on the same data and seed, the run says which road each
    took, and run() checks that the replicas end identical. Two epochs: on 4 ranks one
    epoch is half as many steps as on 2 (4 CPU workers: 29% test error after one, 17%
    after two)."""
    needs_xla()
    cfg = gpu_config(4, epochs=2, hidden=[256, 128])
    pympgu_env(split_max_ranks=max_ranks)  # the spawned workers read them all
    averaged = train(cfg)[-1]
    pympgu_env(split_min_bytes=0)
    gradients = train(cfg)[-1]
    road = "the update of the mean gradients"
    if max_ranks == 2:
        road += ", averaged by the kernel (4 ranks)"
    assert gradients["road"] == road, gradients
    assert "under PYMPGU_SPLIT_MIN_BYTES" in averaged["road"], averaged
    assert gradients["test_error"] < 0.25, gradients
    assert abs(gradients["test_error"] - averaged["test_error"]) <= 0.01, (averaged, gradients)


@pytest.mark.parametrize("road", ["gradients", "results", "overlap"])
def test_gpu_training_dropout(road, pympgu_env):
    """--dropout 0.3 on 2 GPUs, each rank drawing its own masks inside the step's XLA call
    (the generator's key among the step's arguments, a rank's own as its minibatch is):
    by the gradients' road (forced for the MLP's small size), by the average after the
    update (the road at the default size), and with --overlap. Each learns, as the run
    without dropout does within 3 points after one epoch, and run() checks that the
    replicas end identical."""
    needs_xla()
    cfg = gpu_config(hidden=[256, 128], dropout=0.3)
    if road != "results":
        pympgu_env(split_min_bytes=0)  # the spawned workers read it
    dropped = train(cfg.replace(overlap=road == "overlap"))[-1]
    plain = train(cfg.replace(dropout=0.0))[-1]
    if road == "gradients":
        assert dropped["road"] == "the update of the mean gradients", dropped
    elif road == "results":
        assert "under PYMPGU_SPLIT_MIN_BYTES" in dropped["road"], dropped
    assert dropped["test_error"] < 0.25, dropped  # chance is 0.9
    assert dropped["loss"] != plain["loss"], (plain, dropped)  # it dropped
    assert abs(dropped["test_error"] - plain["test_error"]) <= 0.03, (plain, dropped)


def test_gpu_training_augmented(pympgu_env):
    """--flip --shift 2 on 2 GPUs: each rank varies its own images inside the step's XLA
    call (pympgu.nnet.augment's gather) by the gradients' road, learns, and run() checks
    that the replicas end identical."""
    needs_xla()
    cfg = gpu_config(hidden=[256, 128], flip=True, shift=2)
    pympgu_env(split_min_bytes=0)  # the spawned workers read it
    varied = train(cfg)[-1]
    assert varied["road"] == "the update of the mean gradients", varied
    assert varied["test_error"] < 0.4, varied  # chance is 0.9; mirrored digits are harder
