#!/usr/bin/env python
"""Same as ``python -m recsys bench-recovery``; see ``--help``."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from recsys.cli import main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(main(["bench-recovery", *sys.argv[1:]]))
