"""Averaging a PyTorch model's replicas: torch.distributed's model averaging against
pympgu.ddp.ModelAverager, on the same model, in the same run.

    python3 benchmarks/torch_average.py --gpus 0 1            # NCCL against pympgu
    python3 benchmarks/torch_average.py --gpus 0 0 --calls 5  # ranks sharing a GPU: gloo,
                                                               # a check that it runs, no more

Each rank makes an MLP per --models entry (and SGD with momentum, stepped once so that its
momentum exists) and, alternating in --rounds rounds, times --calls averages back to back
of the parameters, then of the parameters and the momentum:
``torch.distributed.algorithms.model_averaging.utils.average_parameters`` (what torch's
``PeriodicModelAverager`` calls: the tensors copied into one flat tensor, divided,
all-reduced, and each pointed into it) and ``ModelAverager.average()`` (the tensors live in the shared buffer: the kernels
alone). A time is the host's from the first call to the end of the last one's GPU work,
over the calls, the slowest rank's; the table gives each round's median, and pympgu's
host time in its calls (queued work only: where ranks share a GPU, the one number that
means anything).
"""
import argparse
import os
import statistics
import tempfile
import time

MODELS = {"seed": [784, 500, 10], "wide": [784, 4096, 4096, 10],
          "deep": [784] + [256] * 64 + [10]}  # 130 tensors: where the host's share shows


def _rank(rank, gpus, init_file, args, out):
    import torch
    import torch.distributed as dist
    from torch.distributed.algorithms.model_averaging.utils import average_parameters

    import pympgu.ddp

    device = gpus[rank]
    torch.cuda.set_device(device)
    backend = "nccl" if len(set(gpus)) == len(gpus) else "gloo"  # NCCL refuses shared GPUs
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank,
                            world_size=len(gpus))
    try:
        rows = []
        for name in args.models:
            sizes = MODELS[name]
            layers = []
            for a, b in zip(sizes, sizes[1:]):
                layers += [torch.nn.Linear(a, b), torch.nn.ReLU()]
            model = torch.nn.Sequential(*layers[:-1]).to(device)
            opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
            model(torch.randn(8, sizes[0], device=device)).sum().backward()
            opt.step()
            for with_state in (False, True):
                averager = pympgu.ddp.ModelAverager(model, opt if with_state else None)
                averager.average()  # its setup
                tensors = list(model.parameters())
                if with_state:
                    tensors += [opt.state[p]["momentum_buffer"] for p in model.parameters()]

                def timed(average, who):
                    for _ in range(args.warmup):
                        average()
                    torch.cuda.synchronize()
                    dist.barrier()
                    start, host = time.perf_counter(), 0.0
                    for _ in range(args.calls):
                        t = time.perf_counter()
                        average()
                        host += time.perf_counter() - t
                    torch.cuda.synchronize()
                    times[who].append((time.perf_counter() - start) / args.calls * 1e3)
                    times[who + " host"].append(host / args.calls * 1e3)

                times = {"torch": [], "pympgu": [], "torch host": [], "pympgu host": []}
                for _ in range(args.rounds):
                    timed(lambda: average_parameters(iter(tensors), None), "torch")
                    timed(averager.average, "pympgu")
                averager.close()
                nbytes = sum(t.numel() * t.element_size() for t in tensors)
                rows.append((name, with_state, len(tensors), nbytes, times))
        gathered = [None] * len(gpus)
        dist.all_gather_object(gathered, rows)
        if rank == 0:
            out.put((backend, gathered))
    finally:
        dist.destroy_process_group()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpus", type=int, nargs="+", default=[0, 1],
                        help="one rank per entry; repeat a GPU to share it (default: 0 1)")
    parser.add_argument("--models", nargs="+", choices=sorted(MODELS), default=["seed", "wide"],
                        help="MLPs to average: seed 784-500-10, wide 784-4096-4096-10, "
                        "deep 784, 64 layers of 256, 10 (default: seed wide)")
    parser.add_argument("--calls", type=int, default=50, help="averages timed back to back")
    parser.add_argument("--warmup", type=int, default=5, help="averages before the timing")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds")
    args = parser.parse_args(argv)
    if len(args.gpus) < 2:
        parser.error("--gpus: give at least 2 ranks")
    import torch.multiprocessing as mp
    ctx = mp.get_context("spawn")
    out = ctx.SimpleQueue()
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_rank, args=(args.gpus, os.path.join(tmp, "init"), args, out),
                           nprocs=len(args.gpus), start_method="spawn")
    backend, gathered = out.get()
    print(f"{len(args.gpus)} ranks on GPUs {args.gpus}; torch.distributed over {backend}; "
          f"ms per average, the median of {args.rounds} rounds of {args.calls} calls "
          "(slowest rank)")
    print("| model | averaged | MB | torch average_parameters | pympgu ModelAverager | ratio "
          "| pympgu's host |")
    print("|---|---|---|---|---|---|---|")
    for k, (name, with_state, count, nbytes, _) in enumerate(gathered[0]):
        med = {}
        for who in ("torch", "pympgu", "pympgu host"):
            rounds = zip(*(rows[k][4][who] for rows in gathered))
            med[who] = statistics.median(max(r) for r in rounds)
        what = "parameters and momentum" if with_state else "parameters"
        print(f"| {name} | {what} ({count} tensors) | {nbytes / 1e6:.1f} | {med['torch']:.3f} "
              f"| {med['pympgu']:.3f} | {med['torch'] / med['pympgu']:.2f} "
              f"| {med['pympgu host']:.3f} |")


if __name__ == "__main__":
    main()
