"""``python -m pympgu``: what this installation can do here, and the commands.

It says whether CUDA works (and CUDA's reason when not), which GPUs can read each other's
memory, whether the exchange can run inside a training step's XLA call, which NCCL the
exchange between nodes would use, and whether torch is there for pympgu.ddp. Without the
XLA operation (pympgu built without jaxlib's headers, as an isolated ``pip install .``
builds it) GPU training queues its exchanges from Python, at about half the wide MLP's
speed, so this is the first thing to look at after installing.
"""
import sys

COMMANDS = """commands:
  python -m pympgu.train --help         train a network on several GPUs (or CPU workers)
  python -m pympgu.evaluate --help      a trained run's errors, class by class
  python -m pympgu.bench --help         the exchange against NCCL and the seed's copy method
  python -m pympgu.bench train --help   training speed against PyTorch DDP"""


def report():
    """The lines ``python -m pympgu`` prints."""
    import pympgu
    from pympgu import cuda
    lines = [f"pympgu {pympgu.__version__} ({pympgu.__file__})"]
    ok, value = cuda.availability()
    if ok:
        names = ", ".join(f"{d}: {cuda.device_name(d)}" for d in range(value))
        lines.append(f"  CUDA: {value} GPU(s) ({names}); runtime "
                     f"{_version(cuda.runtime_version())}, driver "
                     f"{_version(cuda.driver_version())}")
        pairs = [(a, b) for a in range(value) for b in range(value) if a != b]
        if pairs:
            blocked = [f"{a}->{b}" for a, b in pairs if not cuda.can_access_peer(a, b)]
            lines.append("  peer access: " + (
                "every pair" if not blocked else
                f"not {', '.join(blocked)} (ranks on such a pair exchange by the copy method, "
                "through the host)"))
    else:
        lines.append(f"  CUDA: not usable: {value} (training runs on CPU workers)")
    lines.append("  exchange inside the training step's XLA call: " + _xla_state(ok))
    lines.append("  NCCL, between nodes: " + _nccl_state())
    lines.append("  PyTorch, DDP's hook and ModelAverager (pympgu.ddp): " + _torch_state())
    lines.append(COMMANDS)
    return lines


def _xla_state(gpu_ok):
    """Whether the XLA operation was built in, and, with a GPU, whether JAX can run it."""
    from pympgu import cuda, xla
    try:
        built = cuda.xla_handler() is not None
    except cuda.CudaError:  # built without CUDA: availability() said why
        return "no (no CUDA)"
    if not built:
        return ("no: pympgu was built without jaxlib's XLA FFI headers; install jax, then "
                "rebuild without build isolation (./build.sh, or pip install "
                "--no-build-isolation .)")
    if not gpu_ok:
        return "built in; it needs a GPU"
    ok, why = xla.available()
    return "yes" if ok else f"no: {why}"


def _nccl_state():
    """Which NCCL the exchange between nodes would load, or why none."""
    from pympgu import cuda
    try:
        path = cuda.nccl_load()
        v = cuda.nccl_version()
    except cuda.CudaError as e:
        return "no CUDA" if e.name == "pmgErrorNoCuda" else f"not usable: {e.message}"
    return f"{v // 10000}.{v // 100 % 100}.{v % 100} ({path})"


def _torch_state():
    """Whether torch is there for pympgu.ddp, found without importing it (seconds)."""
    import importlib.util
    if importlib.util.find_spec("torch") is None:
        return "needs torch (not installed)"
    return "torch installed; see the README, \"In PyTorch\""


def _version(v):
    return f"{v // 1000}.{v % 1000 // 10}" if v else "none"


def main():
    print("\n".join(report()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
