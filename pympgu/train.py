"""``python -m pympgu.train``: train one network on several GPUs or CPU workers.

The command lives in pympgu.training.cli (its --help says everything); this module keeps
the command's name.
"""
import sys

from .training.cli import main

if __name__ == "__main__":
    sys.exit(main())
