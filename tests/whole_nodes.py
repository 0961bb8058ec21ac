"""``python -m pympgu.train`` whose nodes start every worker again when one is lost, as GPU
workers' nodes do (pympgu.runtime.launch decides it by the workers' kind): that road on CPU
workers, for machines without a GPU.

    python tests/whole_nodes.py --cpu 2 --nnodes 2 ... --min-workers 2 --restart-workers 2
"""
import importlib
import sys

from pympgu.training import cli

launching = importlib.import_module("pympgu.runtime.launch")  # (the module, not the call)


class _WholeNode(launching.NodeCoordinator):
    def __init__(self, *args):
        *args, (start, restarts, retired, _) = args
        super().__init__(*args, (start, restarts, retired, True))


if __name__ == "__main__":
    launching.NodeCoordinator = _WholeNode
    sys.exit(cli.main())
