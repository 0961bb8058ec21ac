"""The PyTorch side of the training benchmark: each model's twin in PyTorch, and DDP's ranks
timing the same steps (eager, in a CUDA graph, and with pympgu.ddp's hook)."""
import os
import time
import traceback

# The PyTorch baselines, name: (each step captured in a CUDA graph, DDP's communication
# hook; None: its own all-reduce). Eager DDP is how most scripts run it; in a CUDA graph it
# is fastest for a small model whose host is slower than its GPU. 'DDP-bf16' sends bfloat16
# gradients (the counterpart of 'sync1-bf16'); 'DDP-pympgu' averages the buckets with
# pympgu.ddp's hook in place of NCCL.
DDP_SYSTEMS = {"DDP": (False, None), "DDP-graph": (True, None),
               "DDP-bf16": (False, "bf16_compress"), "DDP-pympgu": (False, "pympgu"),
               "DDP-pympgu-graph": (True, "pympgu")}


def ddp_systems(variants, graphs=True, hook=False):
    """The DDP_SYSTEMS a run of ``variants`` times: eager DDP, and with ``graphs`` DDP in a
    CUDA graph; DDP-bf16 beside 'sync1-bf16'; with ``hook``, DDP with pympgu's hook, eager
    and (with ``graphs``) in a graph."""
    systems = ["DDP", "DDP-graph"] if graphs else ["DDP"]
    if "sync1-bf16" in variants:
        systems.append("DDP-bf16")
    if hook:
        systems += ["DDP-pympgu", "DDP-pympgu-graph"] if graphs else ["DDP-pympgu"]
    return tuple(systems)


# How DDP's twin lays out a convolution's images: channels last by default, the layout a
# PyTorch user tuning for speed picks (PyTorch's performance guide), or its default NCHW.
DDP_LAYOUTS = ("channels-last", "nchw")
# Eager DDP steps queued behind a held GPU to time them on the GPU alone: few enough that
# their kernels fit CUDA's launch queue (about 40 a step), so the host never waits.
GPU_TIMED_STEPS = 10


def has_torch_twin(cfg):
    """Whether cfg's model has a PyTorch twin for the DDP rows: the MLP has; a model of one's
    own has if its class defines ``torch_twin(n_in, hidden, n_out)`` (examples/lenet.py)."""
    if cfg.model is None:
        return True
    from ..models import load
    return callable(getattr(load(cfg.model), "torch_twin", None))


def torch_twin(cfg, n_in, n_out):
    """cfg's model in PyTorch (a torch.nn.Module on the CPU taking flat inputs (batch,
    n_in)): the MLP's tanh layers, or what a model of one's own gives (has_torch_twin)."""
    import torch
    if cfg.model is not None:
        from ..models import load
        return load(cfg.model).torch_twin(n_in, list(cfg.hidden), n_out)
    sizes = [n_in, *cfg.hidden, n_out]
    layers = []
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
        layers.append(torch.nn.Linear(a, b))
        if i < len(sizes) - 2:
            layers.append(torch.nn.Tanh())
    return torch.nn.Sequential(*layers)


def lay_out(model, layout):
    """Lay out the convolutions of ``model`` (a torch module) as ``layout`` (DDP_LAYOUTS)
    says; returns ``layout``, or None for a model without convolutions."""
    import torch
    convs = [m for m in model.modules() if isinstance(m, torch.nn.Conv2d)]
    if not convs:
        return None
    if layout == "channels-last":
        # The layout cuDNN's fastest convolutions take on tensor cores: the filters stored
        # so, and each convolution's input made so, which costs a copy at the first and
        # nothing after.
        model.to(memory_format=torch.channels_last)
        for conv in convs:
            conv.register_forward_pre_hook(
                lambda _, args: (args[0].contiguous(memory_format=torch.channels_last),
                                 *args[1:]))
    return layout


def ddp_rank(rank, world, devices, cfg, layout, hook, n_in, n_out, steps, warmup, init_file,
             graph=False):
    """One DDP rank: the same model (torch_twin), batch and optimiser in PyTorch; rank 0
    returns timings.
    With ``graph``, the whole step (forward, backward with DDP's all-reduces, optimiser) is
    captured once in a CUDA graph and replayed, PyTorch's recipe for a step whose host is
    slower than its GPU: one launch a step, so the GPU sets the pace."""
    import torch
    import torch.distributed as dist
    device = devices[rank]
    on = "cpu" if device is None else "cuda"  # CPU workers' DDP: gloo carries the gradients
    cuda = _Cuda(torch if device is not None else None)
    if device is not None:
        torch.cuda.set_device(device)
    else:  # each rank its own cores, as pympgu's CPU workers (pympgu.runtime.cores)
        from ..runtime import cores
        mine = cores.pin(world, rank)
        if mine is not None:
            torch.set_num_threads(len(mine))
    # JAX multiplies float32 matrices in TF32 on these GPUs by default; torch does not.
    # Give DDP the same precision, or the comparison measures the precision, not the system.
    torch.set_float32_matmul_precision("high")
    # Ranks sharing a GPU (DDP-pympgu alone, measure) set up through gloo: NCCL refuses them.
    backend = "nccl" if device is not None and len(set(devices)) == len(devices) else "gloo"
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank,
                            world_size=world)
    hook_state = None
    try:
        # Capture needs DDP built and warmed up on a stream other than the default one, and
        # at least 11 eager steps first (DDP settles its buckets in the first ones).
        side = torch.cuda.Stream() if graph else None
        if side is not None:
            side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # no-op for None
            model = torch_twin(cfg, n_in, n_out).to(on)
            layout = lay_out(model, layout)
            ddp = torch.nn.parallel.DistributedDataParallel(
                model, device_ids=None if device is None else [device])
            hook = hook
            if hook == "bf16_compress":  # DDP-bf16
                from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
                ddp.register_comm_hook(None, default_hooks.bf16_compress_hook)
            elif hook == "pympgu":  # DDP-pympgu
                from .. import ddp as pympgu_ddp
                hook_state = pympgu_ddp.register(ddp)
            # The weights, as pympgu penalises them; biases (one dimension) are not.
            weights = [p for p in model.parameters() if p.dim() > 1]
            biases = [p for p in model.parameters() if p.dim() <= 1]
            # pympgu's cost has l2 * sum(W^2), whose gradient is 2 * l2 * W: weight decay 2 * l2
            # (Adam's, too, is added to the gradient); AdamW's is its own, decoupled.
            adamw = cfg.optimizer == "adamw"
            groups = [{"params": weights,
                       "weight_decay": cfg.weight_decay if adamw else 2 * cfg.l2},
                      {"params": biases, "weight_decay": 0.0}]
            if adamw:
                opt = torch.optim.AdamW(groups, lr=cfg.lr, eps=1e-8, capturable=graph,
                                        betas=(cfg.momentum, cfg.beta2))
            elif cfg.optimizer == "adam":
                # Its step count on the GPU (capturable) where the step is a graph replayed.
                opt = torch.optim.Adam(groups, lr=cfg.lr, eps=1e-8, capturable=graph,
                                       betas=(cfg.momentum, cfg.beta2))
            else:
                opt = torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.momentum)
            # The default generator: a captured graph draws new indices at each replay.
            torch.manual_seed(rank)
            ntrain = 8000
            x_all = torch.randn(ntrain, n_in, device=on)
            y_all = torch.randint(0, n_out, (ntrain,), device=on)

            low = cfg.compute_dtype != "float32"
            # --ema: the parameters' moving average, moved after each step by one fused
            # lerp over them all, as timm's ModelEmaV3 does (capturable, unlike
            # AveragedModel's update, which asks the host whether it is the first).
            ema = cfg.ema
            average = [p.detach().clone() for p in model.parameters()] if ema else []

            def body():
                idx = torch.randint(0, ntrain, (cfg.batch_size,), device=on)
                # pympgu's --compute-dtype bfloat16 in PyTorch's idiom: autocast, which
                # multiplies in bfloat16 (and keeps the products' results so).
                with torch.autocast(on, dtype=torch.bfloat16, enabled=low):
                    loss = torch.nn.functional.cross_entropy(ddp(x_all[idx]), y_all[idx])
                loss.backward()
                if cfg.clip_norm:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip_norm)
                opt.step()
                if ema:
                    with torch.no_grad():
                        torch._foreach_lerp_(average, list(model.parameters()), 1.0 - ema)

            def eager():
                opt.zero_grad(set_to_none=True)
                body()

            for _ in range(max(warmup, 11) if graph else warmup):
                eager()
        step = eager
        if graph:
            torch.cuda.current_stream().wait_stream(side)
            captured = torch.cuda.CUDAGraph()
            # Captured with no gradients, backward writes them afresh at each replay.
            opt.zero_grad(set_to_none=True)
            # On the warm-up's stream: a gradient accumulated on another stream than the
            # one its parameter's first backward ran on makes autograd wait across streams.
            with torch.cuda.graph(captured, stream=side, capture_error_mode="thread_local"):
                body()
            step = captured.replay
            for _ in range(warmup):
                step()
        cuda.synchronize()
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        # PyTorch returns before the GPU is done, as JAX does: a loop as long as the whole
        # means the host sets DDP's pace, not the GPU (or that the launch queue filled).
        issued = time.perf_counter() - t0
        cuda.synchronize()
        wall = time.perf_counter() - t0
        out = {"samples_per_s": world * cfg.batch_size * steps / wall,
               "ms_per_step": 1e3 * wall / steps, "host_ms": 1e3 * issued / steps,
               "tf32": bool(torch.backends.cuda.matmul.allow_tf32),
               "layout": layout}
        if not graph and device is not None:
            # What the GPUs alone take a step: a sleeping kernel holds each GPU while the
            # host queues a few steps behind it, and events time them back to back. That is
            # DDP's step if its host kept up.
            dist.barrier()
            torch.cuda.synchronize()
            torch.cuda._sleep(int(2e8))  # about 0.1 s at H200's clock; the queueing takes ~0.02
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            for _ in range(GPU_TIMED_STEPS):
                step()
            end.record()
            end.synchronize()
            out["gpu_ms"] = begin.elapsed_time(end) / GPU_TIMED_STEPS
        return out
    finally:
        if hook_state is not None:
            hook_state.close()
        # After NCCL work captured in a CUDA graph, destroy_process_group hangs in
        # ncclCommDestroy (pytorch/pytorch#115388): _ddp_entry ends such a rank without it.
        if not graph:
            dist.destroy_process_group()


class _Cuda:
    """torch.cuda's synchronize, or nothing for CPU ranks (their work is done on return)."""

    def __init__(self, torch):
        self.torch = torch

    def synchronize(self):
        if self.torch is not None:
            self.torch.cuda.synchronize()


# How long a DDP run may go without a word from every rank (a run takes about 15 s).
DDP_TIMEOUT_S = 120


def _ddp_entry(rank, conn, args, stall_s):
    import faulthandler
    # A rank stuck in NCCL or CUDA says nothing: print where every thread is before the
    # parent gives up on it.
    faulthandler.dump_traceback_later(stall_s)
    try:
        conn.send(("result", ddp_rank(rank, *args)))
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        raise SystemExit(1)
    finally:
        faulthandler.cancel_dump_traceback_later()
    if args[-1]:  # graph: no teardown of its process group (ddp_rank); os._exit skips the
        # interpreter's, which may reach the same NCCL call, and the parent reaps the process.
        conn.close()
        os._exit(0)


def run_ddp(devices, cfg, n_in, n_out, steps, warmup, graph=False, layout=None, hook=None,
            timeout=DDP_TIMEOUT_S):
    """DDP over devices in spawned processes (``graph``: each step a CUDA graph); rank 0's
    timings. The first rank to fail, die or stall past ``timeout`` seconds raises at once
    (its peers would wait for it in NCCL forever), and every child is reaped."""
    import multiprocessing as mp
    import multiprocessing.connection
    import tempfile
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="pympgu-ddp-") as tmp:
        args = (len(devices), devices, cfg, layout or DDP_LAYOUTS[0], hook, n_in, n_out, steps,
                warmup, os.path.join(tmp, "init"), graph)
        pipes, procs, ok = [], [], False
        try:
            for rank in range(len(devices)):
                a, b = ctx.Pipe()
                p = ctx.Process(target=_ddp_entry, args=(rank, b, args, max(1, timeout - 10)),
                                daemon=True)
                p.start()
                pipes.append(a)
                procs.append(p)
            results, deadline = {}, time.monotonic() + timeout
            pending = {pipe: rank for rank, pipe in enumerate(pipes)}
            while pending:
                ready = mp.connection.wait(list(pending), max(0.0, deadline - time.monotonic()))
                if not ready:
                    raise RuntimeError(f"DDP ranks {sorted(pending.values())} said nothing "
                                       f"for {timeout} s")
                for pipe in ready:
                    rank = pending.pop(pipe)
                    try:
                        kind, value = pipe.recv()
                    except EOFError:
                        raise RuntimeError(f"DDP rank {rank} died (exit code "
                                           f"{procs[rank].exitcode})") from None
                    if kind == "error":
                        raise RuntimeError(f"DDP rank {rank} failed:\n{value}")
                    results[rank] = value
            ok = True
            return results[0]
        finally:
            for p in procs:
                p.join(30 if ok else 0)
                if p.is_alive():
                    p.kill()
                    p.join(5)
