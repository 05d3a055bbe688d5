"""``python -m hstu_cute``: see :mod:`hstu_cute.cli`."""

import sys

from .cli import main

# Guarded: warmup's worker processes (multiprocessing "spawn") import the parent's main module.
if __name__ == "__main__":
    sys.exit(main())
