"""Local SGD in PyTorch with pympgu's exchange: each GPU trains its own replica of an MLP
on its own minibatches, and every --every steps pympgu.ddp.ModelAverager averages the
replicas (parameters and momentum) in place, GPU to GPU.

    python examples/torch_local_sgd.py --gpus 0 1 --every 4 --data-dir fashion
    python examples/torch_local_sgd.py --gpus 0 0            # two ranks sharing one GPU
    python examples/torch_local_sgd.py --gpus 0 1 --graph    # steps replayed as CUDA graphs

The ranks draw disjoint minibatches as pympgu.train's workers do (pympgu.data), start from
the same initial values, and are averaged again at the end of every epoch, before rank 0
evaluates; each epoch's line says whether every rank then held the same bits. The
process group (gloo) carries the averager's setup only; pympgu's kernels move every value.

With --graph the steps up to the first average run as usual (they make the optimizer's
state, and that average sets the averager up); then a step and an average are each
captured in a CUDA graph, and replayed: one launch a step, as PyTorch's recipe for small
models whose host is slower than their GPU.
"""
import argparse
import hashlib
import os
import tempfile
import time
import types


class _Replica:
    """One rank's MLP, its SGD and pympgu's averager; with ``graph``, its step and average
    captured as CUDA graphs after the first average."""

    def __init__(self, args, ds, device):
        import torch

        import pympgu.ddp
        self.args, self.device, self.torch = args, device, torch
        torch.manual_seed(args.seed)  # every replica starts alike
        sizes = [ds.n_in, *args.hidden, ds.n_classes]
        layers = []
        for a, b in zip(sizes, sizes[1:]):
            layers += [torch.nn.Linear(a, b), torch.nn.ReLU()]
        self.model = torch.nn.Sequential(*layers[:-1]).to(device)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=args.lr, momentum=0.9)
        self.averager = pympgu.ddp.ModelAverager(self.model, self.opt)
        self.x, self.y = (torch.from_numpy(a).to(device) for a in ds.train)
        self.graphs = None
        # Captured work runs on a side stream, and so does all the training around it
        # (PyTorch's recipe: autograd waits across streams for a gradient accumulated on
        # another stream than its first backward's).
        self.side = torch.cuda.Stream() if args.graph else None
        if self.side is not None:
            self.side.wait_stream(torch.cuda.current_stream())

    def _train_step(self, idx):  # opt.zero_grad() before: a capture leaves it out
        loss = self.torch.nn.functional.cross_entropy(self.model(self.x[idx]),
                                                      self.y[idx].long())
        loss.backward()
        self.opt.step()
        return loss.detach()

    def _capture(self):
        """The step (on a static minibatch's indices) and the average, each a graph."""
        torch = self.torch
        g = types.SimpleNamespace(idx=torch.zeros(self.args.batch_size, dtype=torch.long,
                                                  device=self.device),
                                  step=torch.cuda.CUDAGraph(), average=torch.cuda.CUDAGraph())
        self.opt.zero_grad(set_to_none=True)  # backward makes them afresh at every replay
        with torch.cuda.graph(g.step, stream=self.side):
            g.loss = self._train_step(g.idx)
        with torch.cuda.graph(g.average, stream=self.side):
            self.averager.average()
        return g

    def step(self, idx):
        """One step on the minibatch ``idx``; its loss."""
        if self.graphs is None:
            self.opt.zero_grad()
            return self._train_step(idx)
        self.graphs.idx.copy_(idx)
        self.graphs.step.replay()
        return self.graphs.loss.clone()

    def average(self):
        if self.graphs is not None:
            self.graphs.average.replay()
        else:
            self.averager.average()
            self.graphs = self._capture() if self.args.graph else None

    def error(self, split):
        x, y = (self.torch.from_numpy(a).to(self.device) for a in split)
        with self.torch.no_grad():
            return (self.model(x).argmax(1) != y).float().mean().item() * 100

    def digest(self):
        digest = hashlib.sha256()
        for t in self.model.state_dict().values():
            digest.update(t.cpu().numpy().tobytes())
        return digest.hexdigest()


def _epoch(replica, ds, rank, epoch, step):
    """One epoch of ``replica``, averaged every --every steps and at its end; its line
    (every rank's digest compared) and the step count after it."""
    import torch
    import torch.distributed as dist

    from pympgu import data
    args = replica.args
    start, losses = time.perf_counter(), []
    with torch.cuda.stream(replica.side):  # no-op for None
        for idx in data.shard_batches(len(replica.y), args.batch_size, len(args.gpus), rank,
                                      args.seed, epoch):
            losses.append(replica.step(torch.from_numpy(idx).to(replica.device)))
            step += 1
            if step % args.every == 0:
                replica.average()
        replica.averager.average()  # the epoch's model: the replicas' mean
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    digests = [None] * len(args.gpus)
    dist.all_gather_object(digests, replica.digest())
    return {"epoch": epoch + 1, "loss": torch.stack(losses).mean().item(),
            "valid": replica.error(ds.valid), "test": replica.error(ds.test),
            "samples_per_s": len(losses) * args.batch_size * len(args.gpus) / seconds,
            "identical": len(set(digests)) == 1}, step


def _rank(rank, args, init_file, out):
    import torch
    import torch.distributed as dist

    from pympgu import data

    device = args.gpus[rank]
    torch.cuda.set_device(device)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=len(args.gpus))
    try:
        ds = data.load(args.data_dir)
        replica = _Replica(args, ds, device)
        history, step = [], 0
        try:
            for epoch in range(args.epochs):
                line, step = _epoch(replica, ds, rank, epoch, step)
                history.append(line)
                if rank == 0:
                    print(f"epoch {line['epoch']}: loss {line['loss']:.4f}, validation error "
                          f"{line['valid']:.2f}%, test error {line['test']:.2f}%, "
                          f"{line['samples_per_s']:.0f} samples/s, replicas "
                          f"{'identical' if line['identical'] else 'DIFFER'}", flush=True)
        finally:
            replica.averager.close()
        if rank == 0:
            out.put(history)
    finally:
        dist.destroy_process_group()


def build_parser():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpus", type=int, nargs="+", default=[0, 1],
                        help="one rank per entry; repeat a GPU to share it (default: 0 1)")
    parser.add_argument("--every", type=int, default=4,
                        help="average the replicas every this many steps (default: 4)")
    parser.add_argument("--data-dir", default=None,
                        help="a dataset pympgu.data.load reads (default: the embedded MNIST)")
    parser.add_argument("--hidden", type=int, nargs="+", default=[500],
                        help="hidden layer widths (default: 500)")
    parser.add_argument("--epochs", type=int, default=5, help="epochs (default: 5)")
    parser.add_argument("--batch-size", type=int, default=128,
                        help="minibatch per rank (default: 128)")
    parser.add_argument("--lr", type=float, default=0.05,
                        help="SGD's rate, momentum 0.9 (default: 0.05)")
    parser.add_argument("--graph", action="store_true",
                        help="after the first average, replay the step and the average as "
                             "CUDA graphs (default: off)")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed of the initial values and the minibatches (default: 0)")
    return parser


def main(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    if len(args.gpus) < 2:
        parser.error("--gpus: give at least 2 ranks")
    for flag, value in (("--every", args.every), ("--epochs", args.epochs),
                        ("--batch-size", args.batch_size), ("--hidden", min(args.hidden))):
        if value < 1:
            parser.error(f"{flag} must be at least 1, got {value}")
    if not args.lr > 0:
        parser.error(f"--lr must be positive, got {args.lr}")
    # Here, once, rather than as a traceback from every rank.
    from pympgu import data
    try:
        ds = data.load(args.data_dir)
    except data.DataError as e:
        parser.error(f"--data-dir: {e}")
    if not data.batches_per_epoch(len(ds.train[1]), args.batch_size, len(args.gpus)):
        parser.error(f"--batch-size {args.batch_size} on {len(args.gpus)} ranks needs more "
                     f"than the {len(ds.train[1])} training examples of {ds.name}")
    import torch.multiprocessing as mp
    out = mp.get_context("spawn").SimpleQueue()
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_rank, args=(args, os.path.join(tmp, "init"), out),
                           nprocs=len(args.gpus), start_method="spawn")
    history = out.get()
    if not all(h["identical"] for h in history):
        raise SystemExit("the replicas differed after an average")
    return history


if __name__ == "__main__":
    main()
