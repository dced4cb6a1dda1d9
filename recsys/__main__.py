"""``python -m recsys train ...``: see ``python -m recsys train --help``."""

from recsys.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
