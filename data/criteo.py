"""Criteo Kaggle / Terabyte readers and the memory-mappable binary layout.

Text format (Kaggle ``train.txt``, Terabyte ``day_0`` .. ``day_23``, optionally ``.gz``): one
sample per line, tab-separated: label (0/1), 13 integer features, 26 categorical features as
32-bit hex strings; an empty field is a missing value.

DLRM conventions: integer ``x -> log(max(x, 0) + 1)``, missing -> 0; categorical
``-> int(hex, 16) mod num_rows`` of its table, missing -> 0.

Binary layout (torchrec's Criteo npy layout): ``{name}_dense.npy`` float32 [n, 13] (already
log-transformed), ``{name}_sparse.npy`` int64 [n, 26] (raw 32-bit values; the modulus is applied
when read, so one preprocessing serves any table size), ``{name}_labels.npy`` int32 [n, 1].
"""

from __future__ import annotations

import gzip
import io
import os
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from data.errors import CorruptFileError, DataError, MalformedLineError

NUM_DENSE = 13
NUM_SPARSE = 26
NUM_COLUMNS = 1 + NUM_DENSE + NUM_SPARSE
DENSE_NAMES = [f"int_{i}" for i in range(NUM_DENSE)]
SPARSE_NAMES = [f"cat_{i}" for i in range(NUM_SPARSE)]
KAGGLE_DAYS = 7
TERABYTE_DAYS = 24


def _open_text(path: str | os.PathLike) -> io.TextIOBase:
    path = str(path)
    if path.endswith(".gz"):
        return io.TextIOWrapper(gzip.open(path, "rb"), encoding="ascii", newline="\n")
    return open(path, encoding="ascii", newline="\n")


def _numbered_lines(path: str, f) -> Iterator[tuple[int, str]]:
    """``enumerate(f, 1)`` that turns a truncated or corrupt gzip stream into one clear error."""
    lineno = 0
    try:
        for lineno, line in enumerate(f, start=1):  # noqa: B007 - lineno is reported below
            yield lineno, line
    except (EOFError, gzip.BadGzipFile, zlib.error) as e:
        raise CorruptFileError.at(path, lineno, e) from None


def parse_line(line: str, path: str, lineno: int) -> tuple[int, list[int], list[int]]:
    """One TSV line -> (label, 13 raw ints with missing = 0, 26 raw categorical values)."""
    fields = line.rstrip("\r\n").split("\t")
    if len(fields) != NUM_COLUMNS:
        raise MalformedLineError(path, lineno, f"{len(fields)} columns, expected {NUM_COLUMNS}")
    label = fields[0]
    if label not in ("0", "1"):
        raise MalformedLineError(path, lineno, f"label {label!r} is not 0 or 1")
    try:
        dense = [int(x) if x else 0 for x in fields[1 : 1 + NUM_DENSE]]
    except ValueError:
        col = next(i for i, x in enumerate(fields[1 : 1 + NUM_DENSE]) if x and not _is_int(x))
        raise MalformedLineError(
            path, lineno, f"integer feature I{col + 1} {fields[1 + col]!r} is not an integer"
        ) from None
    try:
        sparse = [int(x, 16) if x else 0 for x in fields[1 + NUM_DENSE :]]
    except ValueError:
        col = next(i for i, x in enumerate(fields[1 + NUM_DENSE :]) if x and not _is_hex(x))
        raise MalformedLineError(
            path, lineno, f"categorical feature C{col + 1} {fields[1 + NUM_DENSE + col]!r} is not a hex value"
        ) from None
    if any(v >= 1 << 32 or v < 0 for v in sparse):
        col = next(i for i, v in enumerate(sparse) if v >= 1 << 32 or v < 0)
        raise MalformedLineError(
            path, lineno, f"categorical feature C{col + 1} {fields[1 + NUM_DENSE + col]!r} exceeds 32 bits"
        )
    return int(label), dense, sparse


def _is_int(x: str) -> bool:
    try:
        int(x)
        return True
    except ValueError:
        return False


def _is_hex(x: str) -> bool:
    try:
        return int(x, 16) >= 0
    except ValueError:
        return False


def dense_transform(raw: np.ndarray) -> np.ndarray:
    """DLRM: log(max(x, 0) + 1) as float32."""
    return np.log1p(np.maximum(raw, 0).astype(np.float64)).astype(np.float32)


@dataclass
class RawChunk:
    dense: np.ndarray  # [n, 13] float32, log-transformed
    sparse: np.ndarray  # [n, 26] int64, raw 32-bit values
    labels: np.ndarray  # [n] int32


class CriteoTsvReader:
    """Streams Criteo TSV files in chunks of ``chunk_rows`` samples.

    ``skip_malformed=False`` (default): the first malformed line raises ``MalformedLineError``
    naming file and line. ``True``: such lines are skipped and counted in ``num_skipped``
    (the first few reasons are kept in ``skipped_examples``).
    """

    def __init__(self, paths: Sequence[str | os.PathLike], *, skip_malformed: bool = False, chunk_rows: int = 65536):
        self.paths = [str(p) for p in paths]
        for p in self.paths:
            if not os.path.isfile(p):
                raise DataError(f"Criteo file {p!r} does not exist")
        self.skip_malformed = skip_malformed
        self.chunk_rows = chunk_rows
        self.num_skipped = 0
        self.skipped_examples: list[str] = []

    def __iter__(self) -> Iterator[RawChunk]:
        for path in self.paths:
            yield from self._read(path)

    def _read(self, path: str) -> Iterator[RawChunk]:
        labels: list[int] = []
        dense: list[list[int]] = []
        sparse: list[list[int]] = []
        with _open_text(path) as f:
            for lineno, line in _numbered_lines(path, f):
                try:
                    lab, d, s = parse_line(line, path, lineno)
                except MalformedLineError as e:
                    if not self.skip_malformed:
                        raise
                    self.num_skipped += 1
                    if len(self.skipped_examples) < 5:
                        self.skipped_examples.append(str(e))
                    continue
                except UnicodeDecodeError as e:  # pragma: no cover - binary garbage
                    raise MalformedLineError(path, lineno, f"not ASCII text ({e})") from None
                labels.append(lab)
                dense.append(d)
                sparse.append(s)
                if len(labels) == self.chunk_rows:
                    yield self._chunk(labels, dense, sparse)
                    labels, dense, sparse = [], [], []
        if labels:
            yield self._chunk(labels, dense, sparse)

    @staticmethod
    def _chunk(labels, dense, sparse) -> RawChunk:
        return RawChunk(
            dense=dense_transform(np.array(dense, dtype=np.int64)),
            sparse=np.array(sparse, dtype=np.int64),
            labels=np.array(labels, dtype=np.int32),
        )


def count_lines(path: str | os.PathLike) -> int:
    n = 0
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rb") as f:
        try:
            while block := f.read(1 << 22):
                n += block.count(b"\n")
        except (EOFError, gzip.BadGzipFile, zlib.error) as e:
            raise CorruptFileError.at(path, n, e) from None
    return n


def _fsync_save(path: Path, arr: np.ndarray) -> None:
    tmp = path.with_suffix(".npy.tmp")
    with open(tmp, "wb") as f:
        np.save(f, arr)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def preprocess(
    src: str | os.PathLike,
    out_dir: str | os.PathLike,
    name: str,
    *,
    skip_malformed: bool = False,
    progress: bool = True,
) -> tuple[int, int]:
    """TSV -> ``{out_dir}/{name}_{dense,sparse,labels}.npy``. Returns (rows written, lines skipped).

    Two passes: count lines, then fill preallocated memory maps, so memory stays at one chunk.
    """
    from data.progress import progress as show_progress

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    capacity = count_lines(src)
    files = {k: out / f"{name}_{k}.npy.partial" for k in ("dense", "sparse", "labels")}
    maps = {
        "dense": np.lib.format.open_memmap(files["dense"], "w+", np.float32, (capacity, NUM_DENSE)),
        "sparse": np.lib.format.open_memmap(files["sparse"], "w+", np.int64, (capacity, NUM_SPARSE)),
        "labels": np.lib.format.open_memmap(files["labels"], "w+", np.int32, (capacity, 1)),
    }
    reader = CriteoTsvReader([src], skip_malformed=skip_malformed)
    n = 0
    with show_progress(total=capacity, desc=f"preprocess {Path(src).name}", unit="rows", disable=not progress) as bar:
        for chunk in reader:
            k = len(chunk.labels)
            maps["dense"][n : n + k] = chunk.dense
            maps["sparse"][n : n + k] = chunk.sparse
            maps["labels"][n : n + k, 0] = chunk.labels
            n += k
            bar.update(n + reader.num_skipped - bar.n)  # lines consumed so far
    for key, arr in maps.items():
        final = out / f"{name}_{key}.npy"
        if n == capacity:
            arr.flush()
            del arr
            with open(files[key], "rb+") as f:
                os.fsync(f.fileno())
            os.replace(files[key], final)
        else:  # skipped lines: copy the filled prefix
            _fsync_save(final, np.asarray(arr[:n]))
            del arr
            os.remove(files[key])
    maps.clear()
    return n, reader.num_skipped


@dataclass(frozen=True)
class BinaryCriteo:
    """Memory-mapped ``{name}_*.npy`` files of one preprocessed input; reads slices at memory speed."""

    dense: np.ndarray
    sparse: np.ndarray
    labels: np.ndarray

    @classmethod
    def open(cls, directory: str | os.PathLike, name: str) -> BinaryCriteo:
        d = Path(directory)
        arrays = {}
        for key in ("dense", "sparse", "labels"):
            path = d / f"{name}_{key}.npy"
            if not path.is_file():
                raise DataError(f"preprocessed file {str(path)!r} does not exist; run the preprocess step first")
            arrays[key] = np.load(path, mmap_mode="r", allow_pickle=False)
        n = len(arrays["labels"])
        if arrays["dense"].shape != (n, NUM_DENSE) or arrays["sparse"].shape != (n, NUM_SPARSE):
            raise DataError(
                f"{d}/{name}_*.npy: inconsistent shapes dense {arrays['dense'].shape}, "
                f"sparse {arrays['sparse'].shape}, labels {arrays['labels'].shape}"
            )
        return cls(**arrays)

    def __len__(self) -> int:
        return len(self.labels)


def day_bounds(num_rows: int, num_days: int) -> list[int]:
    """Row offsets of ``num_days`` near-equal days: day d is ``[b[d], b[d+1])``."""
    return [num_rows * d // num_days for d in range(num_days + 1)]


def kaggle_split(num_rows: int, split: str) -> tuple[int, int]:
    """DLRM split of Kaggle's train.txt into 7 days: train = days 0-5, day 6 halves = val, test."""
    b = day_bounds(num_rows, KAGGLE_DAYS)
    mid = (b[6] + b[7]) // 2
    ranges = {"train": (0, b[6]), "val": (b[6], mid), "test": (mid, b[7])}
    if split not in ranges:
        raise ValueError(f"split {split!r} must be one of {list(ranges)}")
    return ranges[split]


def last_day_split(num_rows: int, split: str) -> tuple[int, int]:
    """Terabyte day 23 (or any held-out day): first half val, second half test."""
    mid = num_rows // 2
    ranges = {"val": (0, mid), "test": (mid, num_rows)}
    if split not in ranges:
        raise ValueError(f"split {split!r} of the last day must be 'val' or 'test'")
    return ranges[split]
