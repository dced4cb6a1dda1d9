"""torchft's Lighthouse, run as ``python lighthouse_main.py OPTIONS`` (``recsys.quorum.replica.Lighthouse``).

torchft's own ``torchft_lighthouse`` script imports the ``torchft`` package, and with it torch:
seconds of CPU for a server that needs none of it. Here its native module alone is loaded from
the file ``RECSYS_TORCHFT_NATIVE`` names, and its ``lighthouse_main`` reads the options (the
process's arguments after this file's name)."""

import importlib.machinery
import importlib.util
import os
import sys

if __name__ == "__main__":
    path = os.environ["RECSYS_TORCHFT_NATIVE"]
    loader = importlib.machinery.ExtensionFileLoader("_torchft", path)
    spec = importlib.util.spec_from_file_location("_torchft", path, loader=loader)
    assert spec is not None
    native = importlib.util.module_from_spec(spec)
    loader.exec_module(native)
    sys.exit(native.lighthouse_main())
