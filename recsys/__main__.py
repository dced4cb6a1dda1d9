"""``python -m recsys train ...``: see ``python -m recsys train --help``."""

import gc

from recsys.cli import main

if __name__ == "__main__":
    code = main()
    # the process ends here: its exit need not walk the heap torch and torchrec built (the
    # collections run at interpreter exit take about a second of CPU; files were closed by now)
    gc.freeze()
    raise SystemExit(code)
