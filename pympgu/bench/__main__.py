"""``python -m pympgu.bench``: the exchange benchmark, or ``train`` for the training one."""
import sys

from . import main

sys.exit(main())
