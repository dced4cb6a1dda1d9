"""Redis's CRC-64 (Jones) of a whole snapshot file, on every core.

``anycrc`` (pinned) computes it with carry-less multiplies, but holds the GIL while it does: two
shards restored at once check their files one after the other, and one file uses one core. Its
extension also exports the C functions it wraps (``crc_params``, ``crc_calc``); called through
``ctypes`` they run without the GIL. ``crc64(buf)`` cuts a large buffer into one part per core,
computes each part's CRC on its own thread and joins them with ``anycrc``'s ``combine``.

The C path is taken only after it gave the model's check value and the same CRC as ``anycrc``'s
own call on a test buffer at import; anywhere else (another ``anycrc`` build, no symbol) the
buffer goes through ``anycrc`` as one call, with the same result.
"""

from __future__ import annotations

import ctypes
import os
import threading
from pathlib import Path

import anycrc
import numpy as np
from anycrc.models import models

CRC64 = anycrc.Model("CRC64-REDIS")  # Redis's CRC-64 (Jones): DUMP payloads and RDB files end with it
_PART = 16 << 20  # the least bytes a thread takes


class _Params(ctypes.Structure):
    # anycrc's ``params_t`` (its width, polynomial, folding constants and tables: about 2.6 KB),
    # returned by value into this buffer, which is larger than it
    _fields_ = [("raw", ctypes.c_uint8 * 8192)]


def _c_path():
    """(crc_calc, its params) where the C functions give the right CRC, else None."""
    width, poly, init, refin, refout, xorout, check = models["CRC64-REDIS"]
    try:
        lib = ctypes.CDLL(str(Path(anycrc.__file__).with_name("crc.abi3.so")))
        lib.crc_params.restype = _Params
        lib.crc_params.argtypes = [
            ctypes.c_uint8,
            ctypes.c_uint64,
            ctypes.c_uint64,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_uint64,
            ctypes.c_uint64,
            ctypes.POINTER(ctypes.c_uint8),
        ]
        lib.crc_calc.restype = ctypes.c_uint64
        lib.crc_calc.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_void_p, ctypes.c_uint64]
        error = ctypes.c_uint8(0)
        params = lib.crc_params(width, poly, init, refin, refout, xorout, check, ctypes.byref(error))
    except (OSError, AttributeError):
        return None
    probe = np.frombuffer(np.random.default_rng(0).bytes(1 << 16), np.uint8)
    if error.value or lib.crc_calc(ctypes.byref(params), init, probe.ctypes.data, len(probe)) != CRC64.calc(probe):
        return None
    return lib.crc_calc, params


_C = _c_path()


def crc64(buf) -> int:
    """The CRC-64 Redis ends its files and ``DUMP`` payloads with, of any bytes-like ``buf``; a
    large one on every core (see the module's text)."""
    n = len(buf)
    parts = min(os.cpu_count() or 1, n // _PART)
    if _C is None or parts < 2:
        return CRC64.calc(buf)
    calc, params = _C
    arr = np.frombuffer(buf, np.uint8)
    bounds = [n * i // parts for i in range(parts + 1)]
    out = [0] * parts

    def part(i: int) -> None:
        lo, hi = bounds[i], bounds[i + 1]
        out[i] = calc(ctypes.byref(params), 0, arr.ctypes.data + lo, hi - lo)

    threads = [threading.Thread(target=part, args=(i,), name="crc64") for i in range(1, parts)]
    for t in threads:
        t.start()
    part(0)
    for t in threads:
        t.join()
    crc = out[0]
    for i in range(1, parts):
        crc = CRC64.combine(crc, out[i], bounds[i + 1] - bounds[i])
    return crc
