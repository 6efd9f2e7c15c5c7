"""``python -m hvdlite.runner [run] ...``: same as the ``hvdlite`` command."""
import sys

from .launch import main

if __name__ == "__main__":
    sys.exit(main())
