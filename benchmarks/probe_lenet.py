"""PyTorch's and plain JAX's time for a step of examples/lenet.py's network on one GPU, the
references for pympgu's own (python -m pympgu.bench train --gpus 0 --model
examples/lenet.py:LeNet).

    python3 benchmarks/probe_lenet.py [--batch 1024] [--steps 300] [--jax-only]
    python3 benchmarks/probe_lenet.py --model examples/resnet.py:ResNet   # its torch_twin

The same layers (two 5x5 convolutions of 20 and 50 filters, each followed by 2x2 max pooling
and tanh, a tanh layer of 500 units, softmax cross-entropy), SGD with momentum 0.9, on a
resident batch: eager, then with cuDNN's autotuner (cudnn.benchmark), then that step
captured in a CUDA graph (one launch a step). Prints
ms per step. TF32 is as PyTorch leaves it (cuDNN's convolutions may use it, matrix products
not), as a user would run it; the first line says so. Plain JAX: the same step written
with lax.conv_general_dilated, pooling by lax.reduce_window and then as pympgu.nnet pools,
jitted, its state donated; with the host's time to issue the steps, which is the step's
own where the host sets the pace (at batch 128).
"""
import argparse
import time


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--jax-only", action="store_true", help="plain JAX's rows alone")
    ap.add_argument("--model", metavar="FILE.py:CLASS",
                    help="the PyTorch rows of another model's torch_twin (python -m "
                         "pympgu.bench train's), at its default_hidden, on 1x28x28 images, "
                         "then on channels-last tensors; no JAX rows")
    args = ap.parse_args()
    if args.jax_only:
        return jax_rows(args)
    import torch
    torch.manual_seed(0)
    if args.model:
        from pympgu.models import load
        cls = load(args.model)
        net = cls.torch_twin(784, list(cls.default_hidden), 10).cuda()
        x = torch.randn(args.batch, 784, device="cuda")
    else:
        net = torch.nn.Sequential(
            torch.nn.Conv2d(1, 20, 5), torch.nn.MaxPool2d(2), torch.nn.Tanh(),
            torch.nn.Conv2d(20, 50, 5), torch.nn.MaxPool2d(2), torch.nn.Tanh(),
            torch.nn.Flatten(), torch.nn.Linear(800, 500), torch.nn.Tanh(),
            torch.nn.Linear(500, 10)).cuda()
        x = torch.randn(args.batch, 1, 28, 28, device="cuda")
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9, weight_decay=2e-4)
    y = torch.randint(0, 10, (args.batch,), device="cuda")
    loss_fn = torch.nn.CrossEntropyLoss()

    def step():
        opt.zero_grad(set_to_none=False)
        loss = loss_fn(net(x), y)
        loss.backward()
        opt.step()
        return loss

    def timed(fn):
        for _ in range(20):
            fn()
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(args.steps):
            fn()
        torch.cuda.synchronize()
        return (time.perf_counter() - t) / args.steps * 1e3

    print(f"torch {torch.__version__}, cudnn.allow_tf32 {torch.backends.cudnn.allow_tf32}, "
          f"matmul tf32 {torch.backends.cuda.matmul.allow_tf32}, batch {args.batch}")
    print(f"eager:      {timed(step):.3f} ms/step")
    # cuDNN's autotuner is off by default; a user who knows it turns it on.
    torch.backends.cudnn.benchmark = True
    print(f"eager, cudnn.benchmark: {timed(step):.3f} ms/step")

    def captured(fn):  # PyTorch's recipe: warm up on a side stream, then capture
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(3):
                fn()
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        return graph

    graph = captured(step)
    print(f"CUDA graph, cudnn.benchmark: {timed(graph.replay):.3f} ms/step")
    if args.model:
        # The same network and state on channels-last tensors (NHWC in memory), the layout
        # cuDNN's fastest convolutions on tensor cores take; the inputs converted once
        # a step, after the flat rows are unflattened.
        class ChannelsLast(torch.nn.Module):
            def forward(self, h):
                return h.contiguous(memory_format=torch.channels_last)

        net.insert(1, ChannelsLast())
        net.to(memory_format=torch.channels_last)
        print(f"eager, channels last, cudnn.benchmark: {timed(step):.3f} ms/step")
        graph = captured(step)
        print(f"CUDA graph, channels last, cudnn.benchmark: {timed(graph.replay):.3f} ms/step")
    else:
        jax_rows(args)


def jax_rows(args):
    for pool in ("reduce_window", "reshape"):
        ms, issued = plain_jax(args.batch, args.steps, pool)
        print(f"plain JAX, {pool} pooling: {ms:.3f} ms/step (issued in {issued:.3f})")


def plain_jax(batch, steps, pool):
    """(ms per step, ms of the host's per step to issue it) of the jitted JAX step, pooling
    by lax.reduce_window (JAX's own way) or by a reshape and max (pympgu.nnet.max_pool_2d's)."""
    import jax
    import jax.numpy as jnp
    from jax import lax
    import numpy as np
    rng = np.random.default_rng(0)

    def u(shape, fan_in):
        return jnp.asarray(rng.uniform(-1, 1, shape) / np.sqrt(fan_in), jnp.float32)
    params = [u((20, 1, 5, 5), 25), jnp.zeros(20), u((50, 20, 5, 5), 500), jnp.zeros(50),
              u((800, 500), 800), jnp.zeros(500), jnp.zeros((500, 10)), jnp.zeros(10)]
    vel = [jnp.zeros_like(p) for p in params]
    x = jnp.asarray(rng.standard_normal((batch, 1, 28, 28)), jnp.float32)
    y = jax.nn.one_hot(jnp.asarray(rng.integers(0, 10, batch)), 10)

    def loss(params):
        h = x
        for w, b in (params[0:2], params[2:4]):
            h = lax.conv_general_dilated(h, w, (1, 1), "VALID",
                                         dimension_numbers=("NCHW", "OIHW", "NCHW"))
            if pool == "reshape":
                n, c, r, s = h.shape
                h = h.reshape(n, c, r // 2, 2, s // 2, 2).max(axis=(3, 5))
            else:
                h = lax.reduce_window(h, -jnp.inf, lax.max, (1, 1, 2, 2), (1, 1, 2, 2), "VALID")
            h = jnp.tanh(h + b[None, :, None, None])
        h = jnp.tanh(h.reshape(batch, -1) @ params[4] + params[5])
        logits = h @ params[6] + params[7]
        l2 = sum(jnp.sum(w * w) for w in params[0::2])
        return -jnp.mean(jnp.sum(y * jax.nn.log_softmax(logits), axis=1)) + 1e-4 * l2

    def sgd(params, vel):
        g = jax.grad(loss)(params)
        vel = [0.9 * v - 0.05 * gi for v, gi in zip(vel, g)]
        return [p + v for p, v in zip(params, vel)], vel
    step = jax.jit(sgd, donate_argnums=(0, 1))
    for _ in range(20):
        params, vel = step(params, vel)
    jax.block_until_ready(params)
    t = time.perf_counter()
    for _ in range(steps):
        params, vel = step(params, vel)
    issued = time.perf_counter() - t
    jax.block_until_ready(params)
    return (time.perf_counter() - t) / steps * 1e3, issued / steps * 1e3


if __name__ == "__main__":
    main()
