"""The trainers of a run as one group: its rank and size, and every collective the run makes.

One ``TrainerGroup`` per trainer process owns the process group (gloo, set up by the launcher or
torchrun); the training loop, the embedding backend and recovery reach the other trainers only
through it: the dense gradients' reduction (``wrap``: DDP over the group), the row gradients'
aggregation (``aggregate``), the rows of shards away (``all_gather_keys``, ``all_reduce_sum``), the
commit points' flags and the run's totals (``collective()``, recovery's view of the same group).
With one trainer every collective is the identity.

Row gradients (sync semantics): each trainer's loss is the mean over its B samples, so the global
loss over the W*B samples is the mean of the trainers' losses and its gradient for a row is
``(1/W) * sum_r grad_r``. Every trainer all-gathers (table, row, grad) of all trainers (in the
dense gradients' all-gather), sums per row in chunk order, divides by the chunks, and applies only
the rows of the shards it owns (``--row-exchange scatter``: each row's gradient to the trainer that
owns its key, which sums it, then the sums all-gathered; the same bits): shard ``s`` is written by
trainer ``s % W`` alone (one writer per shard per step). Every trainer also learns the full set of
rows updated this step, which keeps its prefetched rows coherent.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from embeddings.shard_map import ShardMap
from recovery.protocol import Collective
from recsys.clock import Collectives

ROW_EXCHANGES = ("auto", "gather", "scatter")
SCATTER_FROM = 8
"""``--row-exchange auto``: the trainers from which the rows' gradients are scattered to their owners.
Below it every trainer gathers every chunk's rows: one collective less, and on paper fewer bytes below
4 trainers, 2-9% more at 4 (``bench_throughput.py --bytes``; the scatter ran 0.88x / 0.88x / 0.95x of
the gather at 2 / 3 / 4 trainers on the 2-core development host, docs/benchmarks.md)."""


def owners_of(keys: np.ndarray, world_size: int) -> np.ndarray:
    """The trainer that sums each packed key's gradients under the scatter exchange: a multiplicative
    hash of the key (hot rows spread whatever their ids' pattern), mod the trainers. [n] int64."""
    h = np.ascontiguousarray(keys, np.int64).view(np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    return ((h >> np.uint64(32)) % np.uint64(world_size)).astype(np.int64)


def _rows_bits(keys: torch.Tensor, grads: torch.Tensor, out: torch.Tensor) -> None:
    """(keys [n] int64, grads [n, dim] float32) into ``out`` [n, 2 + dim] int32, bits moved unconverted."""
    n = len(keys)
    if not n:  # an empty tensor may carry any stride, which no view of another element size takes
        return
    out[:, :2] = keys.contiguous().view(torch.int32).view(n, 2)
    out[:, 2:] = grads.contiguous().view(torch.int32)


def _bits_rows(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``_rows_bits`` undone: -> (keys [n] int64, grads [n, dim] float32)."""
    return rows[:, :2].contiguous().view(torch.int64).view(-1), rows[:, 2:].contiguous().view(torch.float32)


def unique_runs(keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.unique(keys, return_inverse=True)`` (sorted unique keys, each key's position among
    them), by a stable sort: the gathered keys are a few sorted runs (each chunk's unique keys), which
    a merge sort joins in one pass, 4-5x faster than torch's sort of 2 runs of 11k keys."""
    k = keys.numpy()
    if not len(k):
        return keys, torch.zeros(0, dtype=torch.int64)
    order = np.argsort(k, kind="stable")
    ordered = k[order]
    first = np.empty(len(k), bool)
    first[0] = True
    np.not_equal(ordered[1:], ordered[:-1], out=first[1:])
    inverse = np.empty(len(k), np.int64)
    inverse[order] = np.cumsum(first) - 1
    return torch.from_numpy(ordered[first]), torch.from_numpy(inverse)


@dataclass
class StepUpdate:
    """One step's sparse update, in packed row keys (``embeddings.rowkeys``), sorted."""

    keys: np.ndarray
    """Rows this trainer writes: [n] int64 keys."""
    grads: torch.Tensor
    """Their global gradients, [n, dim] float32."""
    shards: np.ndarray
    """Shard of each of ``keys``, [n] int64."""
    updated_keys: np.ndarray
    """Every row updated this step by any trainer, [m] int64 keys."""
    updated_shards: np.ndarray
    """Shard of each of ``updated_keys``."""
    updated_grads: torch.Tensor | None = None
    """The global gradients of ``updated_keys`` (the rows other trainers write too), [m, dim]."""


def flat_grads(params: list[torch.nn.Parameter]) -> torch.Tensor:
    """The parameters' gradients as one flat tensor (zeros where a parameter has none)."""
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params])


def run_group(train, world_size: int, rank: int) -> TrainerGroup:
    """The group of a run's trainer ``rank`` of ``world_size`` (``train``: its ``TrainConfig``)."""
    exact = train.dense_reduce == "chunks"
    return TrainerGroup(world_size, rank, train.chunks, exact=exact, row_exchange=train.row_exchange)


def _fit(top: int) -> int:
    """The rows a trainer's part of a gather holds next step, from the most any trainer had this step
    (every trainer learned every count: the same on each)."""
    return top + top // 8 + 16


def _gather_rest(comm, blocks: list[torch.Tensor], sizes: list[int], fit: int, cols: int, fill) -> list[torch.Tensor]:
    """``blocks``: each trainer's rows (``sizes`` of them) as far as ``fit`` held them; where some
    trainer had more, the rest of each in a second all-gather, appended. ``fill(out)`` writes this
    trainer's rows past ``fit`` into ``out``."""
    top = max(sizes)
    if top <= fit:
        return blocks
    rest = torch.empty((top - fit, cols), dtype=torch.int32)  # past a trainer's own rows: never read
    fill(rest)
    more = [torch.empty_like(rest) for _ in blocks]
    comm.all_gather(more, rest)
    return [torch.cat([b, m[: max(0, n - fit)]]) for b, m, n in zip(blocks, more, sizes)]


def _joined_grads(parts: list[tuple[np.ndarray, torch.Tensor]]) -> torch.Tensor:
    """The chunks' row gradients, one after the other, float32 [n, dim]."""
    return (torch.cat([g for _, g in parts]) if len(parts) > 1 else parts[0][1]).detach().to(torch.float32)


def _counts_of(chunk_keys: list[np.ndarray], scatters: bool, world_size: int) -> np.ndarray:
    """Each chunk's rows, [chunks, 1]; where they are scattered, its rows for each owner, [chunks, W]."""
    if not scatters:
        return np.array([[len(k)] for k in chunk_keys], np.int64).reshape(len(chunk_keys), 1)
    return np.stack([np.bincount(owners_of(k, world_size), minlength=world_size) for k in chunk_keys])


def _sum_rows(k: torch.Tensor, g: torch.Tensor, num_chunks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows in chunk order summed by key (each key's gradients added in chunk order: the same bits
    from any subset of the keys), divided by the chunks. -> (sorted unique keys, sums)."""
    uniq, inverse = unique_runs(k)
    summed = torch.zeros((len(uniq), g.shape[1]), dtype=torch.float32)
    summed.index_add_(0, inverse, g)
    if num_chunks > 1:
        summed /= num_chunks
    return uniq, summed


class TorchDist:
    """The collectives on torch's default process group (the launcher's or torchrun's)."""

    def barrier(self) -> None:
        Collectives.timed(dist.barrier)

    def all_reduce(self, t: torch.Tensor, op=dist.ReduceOp.SUM) -> None:
        Collectives.timed(lambda: dist.all_reduce(t, op=op))

    def broadcast(self, t: torch.Tensor, src: int) -> None:
        Collectives.timed(lambda: dist.broadcast(t, src=src))

    def all_gather(self, out: list[torch.Tensor], t: torch.Tensor) -> None:
        Collectives.timed(lambda: dist.all_gather(out, t))

    def all_to_all(self, out: torch.Tensor, t: torch.Tensor, out_splits: list[int], in_splits: list[int]) -> None:
        Collectives.timed(lambda: dist.all_to_all_single(out, t, out_splits, in_splits))


class TrainerGroup:
    """``num_chunks``: the fixed chunks of each global batch (0: one per trainer); chunk ``c`` is
    trained by trainer ``c % world_size``, until the chunks follow speed (``assign``). ``exact``:
    the dense gradients are gathered and summed in chunk order (``reduce_dense``), not all-reduced by DDP. ``comm``: where the collectives run
    (torch's default group; under ``--trainer-recovery replace`` the quorum's, ``recsys.quorum.replica``).

    ``own_chunk`` (``--dense-reduce allreduce`` under ``replace``, torchft's way): this trainer
    trains chunk ``own_chunk`` of the ``num_chunks`` alone, whatever the quorum; the chunks of
    trainers not in it are skipped, and each step's gradients are averaged over the chunks trained
    (all-reduced: within float error of the chunk order, not bit for bit)."""

    def __init__(
        self,
        world_size: int = 1,
        rank: int = 0,
        num_chunks: int = 0,
        exact: bool = True,
        comm=None,
        own_chunk: int | None = None,
        row_exchange: str = "auto",
    ) -> None:
        if row_exchange not in ROW_EXCHANGES:
            raise ValueError(f"row_exchange={row_exchange!r} must be one of {', '.join(ROW_EXCHANGES)}")
        self.world_size, self.rank = world_size, rank
        # the rows' gradients to their owners, summed there, the sums gathered (``_scatter_rows``)
        self.scatters = world_size > 1 and (
            row_exchange == "scatter" or (row_exchange == "auto" and world_size >= SCATTER_FROM)
        )
        self.comm = comm if comm is not None else TorchDist()
        self.num_chunks = num_chunks or world_size
        if self.num_chunks < world_size:
            raise ValueError(f"chunks={num_chunks}: fewer chunks than the {world_size} trainers")
        self.data_chunks = self.num_chunks
        """The chunks each global batch is cut into (the readers'); ``num_chunks``: those trained."""
        self._assigned: list[list[int]] | None = None  # chunks by rank where they follow speed (``assign``)
        # each trainer's chunks' rows, from ``reduce_dense``: per rank [its chunks, 1 or (scatter) W owners]
        self._row_counts: list[np.ndarray] | None = None
        self._sums_fit: int | None = None  # scatter: the rows an owner's sums are padded to (``_scatter_rows``)
        # gather: each trainer's rows in the dense gradients' collective, up to ``_rows_fit`` (``_gather_dense``)
        self._gathered: tuple[torch.Tensor, torch.Tensor] | None = None
        self._rows_fit = 0
        self.chunks = [c for c in range(self.num_chunks) if c % world_size == rank]  # this trainer's
        self.exact = exact or self.num_chunks != world_size  # alike on every trainer
        self.averages = own_chunk is not None
        if own_chunk is not None:
            self.chunks, self.num_chunks, self.exact = [own_chunk], world_size, False

    @property
    def solo(self) -> bool:
        return self.world_size == 1

    @property
    def reduces_dense(self) -> bool:
        """The dense gradients are reduced here (``reduce_dense``), not in DDP's backward."""
        return (self.exact and self.num_chunks > 1) or (self.averages and not self.solo)

    def chunks_of(self, rank: int) -> list[int]:
        if self._assigned is not None:
            return self._assigned[rank]
        return [c for c in range(self.num_chunks) if c % self.world_size == rank]

    @property
    def balances(self) -> bool:
        """Whether chunks may follow speed: several trainers, more chunks than trainers, reduced in
        chunk order (which trainer trains a chunk moves no bit)."""
        return not self.solo and self.exact and not self.averages and self.num_chunks > self.world_size

    def counts(self) -> list[int]:
        """How many chunks each trainer trains, by rank."""
        return [len(self.chunks_of(r)) for r in range(self.world_size)]

    def assign(self, counts: list[int]) -> None:
        """Each trainer (by rank) trains ``counts[r]`` chunks from the next step: consecutive chunks,
        rank 0's first. Every trainer assigns the same counts at the same step."""
        if len(counts) != self.world_size or sum(counts) != self.num_chunks or min(counts) < 1:
            raise ValueError(
                f"chunk counts {counts}: one of at least 1 per trainer of {self.world_size}, summing to {self.num_chunks}"
            )
        starts = np.concatenate([[0], np.cumsum(counts)]).tolist()
        self._assigned = [list(range(starts[r], starts[r + 1])) for r in range(self.world_size)]
        self.chunks = self._assigned[self.rank]

    def _most(self) -> int:
        return max(self.counts())

    def writes_shard(self, shard: int) -> bool:
        """Whether this trainer is the one writer of ``shard``."""
        return shard % self.world_size == self.rank

    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        """The model whose backward reduces its dense gradients over the group (DDP); the model
        itself where there is no group or the gradients are reduced in chunk order."""
        if self.solo or self.exact or self.averages:
            return model
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model)

    # -- the collectives ------------------------------------------------------------------------
    def barrier(self) -> None:
        if not self.solo:
            self.comm.barrier()

    def max_flags(self, a: np.ndarray) -> np.ndarray:
        if self.solo:
            return a
        t = torch.from_numpy(a.astype(np.int64))
        self.comm.all_reduce(t, dist.ReduceOp.MAX)
        return t.numpy()

    def broadcast_int(self, v: int) -> int:
        if self.solo:
            return v
        t = torch.tensor([v], dtype=torch.int64)
        self.comm.broadcast(t, 0)
        return int(t.item())

    def sum_floats(self, a: np.ndarray) -> np.ndarray:
        if self.solo:
            return a
        t = torch.from_numpy(a.astype(np.float64))
        self.comm.all_reduce(t)
        return t.numpy()

    def all_reduce_sum(self, a: np.ndarray) -> np.ndarray:
        """``a`` summed over the trainers, in its own dtype."""
        if self.solo:
            return a
        t = torch.from_numpy(np.ascontiguousarray(a))
        self.comm.all_reduce(t)
        return t.numpy()

    def mean(self, t: torch.Tensor) -> torch.Tensor:
        """The mean over every chunk of the step of a value each trainer gives as the sum over its
        chunks (the logged loss)."""
        t = t.detach().clone()
        if not self.solo:
            self.comm.all_reduce(t)
        return t / self.num_chunks

    def all_gather_keys(self, keys: np.ndarray) -> np.ndarray:
        """The sorted union of every trainer's packed keys (two collectives: the counts, the keys)."""
        if self.solo:
            return np.unique(keys)
        n = torch.tensor([len(keys)], dtype=torch.int64)
        counts = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world_size)]
        self.comm.all_gather(counts, n)
        most = max(int(c.item()) for c in counts)
        mine = torch.full((most,), -1, dtype=torch.int64)
        mine[: len(keys)] = torch.from_numpy(np.asarray(keys, np.int64))
        parts = [torch.empty(most, dtype=torch.int64) for _ in counts]
        self.comm.all_gather(parts, mine)
        every = torch.cat(parts).numpy()
        return np.unique(every[every >= 0])

    def all_gather_rows(
        self, keys: torch.Tensor, grads: torch.Tensor, known: list[list[int]] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Variable-length all-gather of (keys [n], grads [n, dim]); rank order preserved. ``known``:
        each trainer's chunks' row counts, gathered already (``reduce_dense``)."""
        if self.solo:
            return keys, grads
        world_size = self.world_size
        if known is not None:
            counts = [sum(c) for c in known]
        else:
            sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world_size)]
            self.comm.all_gather(sizes, torch.tensor([len(keys)], dtype=torch.int64))
            counts = [int(s.item()) for s in sizes]
        most, n = max(counts), len(keys)
        # one collective for both: each row its key's two 32-bit words, then its gradient's bits (int32
        # throughout: the bytes are moved, never converted)
        # (the padding rows are never read: no fill)
        pad = torch.empty((most, 2 + grads.shape[1]), dtype=torch.int32)
        _rows_bits(keys, grads, pad[:n])
        parts = [torch.empty_like(pad) for _ in range(world_size)]
        self.comm.all_gather(parts, pad)
        # each column block joined once, straight from the gathered rows (one copy each)
        k = torch.cat([p[:c, :2] for p, c in zip(parts, counts)]).view(torch.int64).view(-1)
        return k, torch.cat([p[:c, 2:] for p, c in zip(parts, counts)]).view(torch.float32)

    def reduce_dense(
        self,
        params: list[torch.nn.Parameter],
        flats: list[torch.Tensor],
        chunk_rows: list[tuple[np.ndarray, torch.Tensor]] | None = None,
        flags: np.ndarray | None = None,
    ) -> list[int]:
        """Every chunk's dense gradients (``flats``: this trainer's chunks', flattened, in its chunk
        order) gathered, summed in chunk order and divided by the chunks, into ``params``' grads:
        the same bits whichever trainers computed which chunks. ``own_chunk``: all-reduced instead,
        divided by the chunks trained. ``chunk_rows``: each of those chunks' row keys and gradients.
        Their counts (per owner where the rows are scattered) travel in the same collective (more
        columns, their bits), and where they are gathered the rows too, as many as fitted the step
        before (``_gather_dense``): ``aggregate`` then asks no one. ``flags``: a commit point's
        failed-shard flags (``CommitPoints.take_flags``; only where ``agrees_in_gather``), gathered
        too. -> the shards any trainer flagged ([] without ``flags``)."""
        mine = flats[0].unsqueeze(0) if len(flats) == 1 else torch.stack(flats)  # one chunk: no copy
        self._row_counts = self._gathered = None
        failed: list[int] = []
        if self.averages:
            rows = [mine.sum(0)]
            self.comm.all_reduce(rows[0])
        elif self.solo:
            rows = list(mine)
        else:
            float32 = mine.dtype == torch.float32
            parts, width, failed = self._gather_dense(mine, chunk_rows if float32 else None, flags if float32 else None)
            by_chunk = {c: parts[r][i, :width] for r in range(self.world_size) for i, c in enumerate(self.chunks_of(r))}
            rows = [by_chunk[c] for c in range(self.num_chunks)]
        # summed in chunk order, then divided by the chunks on the way into the grads: the bits of a
        # sum in place and a division, with two passes over the gradients fewer
        total = rows[0] if len(rows) == 1 else torch.add(rows[0], rows[1])
        for row in rows[2:]:
            total += row
        at = 0
        for p in params:
            n = p.numel()
            if p.grad is None:
                p.grad = torch.empty_like(p)
            torch.div(total[at : at + n].view_as(p), self.num_chunks, out=p.grad)
            at += n
        return failed

    def agrees_in_gather(self, params: list[torch.nn.Parameter]) -> bool:
        """Whether the dense gather (``reduce_dense``) can carry a commit point's flags: several
        trainers gathering float32 gradients in chunk order."""
        return self.reduces_dense and not self.solo and not self.averages and params[0].dtype == torch.float32

    def _gather_dense(
        self, mine: torch.Tensor, chunk_rows: list[tuple[np.ndarray, torch.Tensor]] | None, flags: np.ndarray | None
    ) -> tuple[list[torch.Tensor], int, list[int]]:
        """One all-gather of every trainer's chunks' dense gradients (``mine``: [chunks, width] float32),
        padded to the most chunks a trainer has, each chunk's row counts beside them (``_row_counts``)
        and the ``flags`` after them on the first; gathering rows, each trainer's rows too, up to
        ``_rows_fit`` (the rest in a second gather): ``_gathered``, what ``all_gather_rows`` would give.
        -> (each trainer's [most, width + counts + flags] rows, width, the shards any trainer flagged)."""
        most, width = self._most(), mine.shape[1]
        counts = None if chunk_rows is None else _counts_of([k for k, _ in chunk_rows], self.scatters, self.world_size)
        cc = 0 if counts is None else counts.shape[1]
        extra = cc + (0 if flags is None else len(flags))
        keys = grads = None
        fit = 0
        if counts is not None and not self.scatters:
            keys = torch.from_numpy(np.concatenate([k for k, _ in chunk_rows]))
            grads = _joined_grads(chunk_rows)
            fit = self._rows_fit
        dense, cols = most * (width + extra), 2 + (0 if grads is None else grads.shape[1])
        if mine.dtype != torch.float32:  # no counts nor rows beside them: gathered in their own dtype
            buf = torch.empty(dense, dtype=mine.dtype)
            pad = buf.view(most, width)
        else:  # the padding (chunks a trainer lacks, rows past its own) is never read: no fill
            buf = torch.empty(dense + fit * cols, dtype=torch.int32)
            pad = buf[:dense].view(torch.float32).view(most, width + extra)
        pad[: len(mine), :width] = mine
        if cc:
            pad[: len(mine), width : width + cc] = torch.from_numpy(counts.astype(np.int32)).view(torch.float32)
        if flags is not None:
            pad[0, width + cc :] = torch.from_numpy(flags.astype(np.int32)).view(torch.float32)
        if keys is not None:
            n = min(len(keys), fit)
            _rows_bits(keys[:n], grads[:n], buf[dense : dense + n * cols].view(n, cols))
        every = [torch.empty_like(buf) for _ in range(self.world_size)]
        self.comm.all_gather(every, buf)
        parts = [p[:dense].view(mine.dtype).view(most, width + extra) for p in every]
        if cc:
            self._row_counts = [
                parts[r][: len(self.chunks_of(r)), width : width + cc]
                .contiguous()
                .view(torch.int32)
                .numpy()
                .astype(np.int64)
                for r in range(self.world_size)
            ]
        failed: list[int] = []
        if flags is not None:
            seen = np.stack([p[0, width + cc :].contiguous().view(torch.int32).numpy() for p in parts]).max(0)
            failed = [int(s) for s in np.flatnonzero(seen)]
        if keys is not None:  # the rows that fitted, then the rest where some trainer had more
            sizes = [int(c.sum()) for c in self._row_counts]
            blocks = [p[dense : dense + min(n, fit) * cols].view(-1, cols) for p, n in zip(every, sizes)]
            left = max(0, len(keys) - fit)
            blocks = _gather_rest(
                self.comm, blocks, sizes, fit, cols, lambda out: _rows_bits(keys[fit:], grads[fit:], out[:left])
            )
            self._gathered = _bits_rows(torch.cat(blocks))
            self._rows_fit = _fit(max(sizes))
        return parts, width, failed

    def aggregate(self, parts: list[tuple[np.ndarray, torch.Tensor]], shard_map: ShardMap) -> StepUpdate:
        """This trainer's chunks' per-row gradients (per chunk, in its chunk order: packed keys [n],
        grads [n, dim]) summed over every chunk in chunk order, divided by the chunks."""
        keys = np.concatenate([k for k, _ in parts]) if len(parts) > 1 else parts[0][0]
        counts = [len(pk) for pk, _ in parts]
        known, self._row_counts = self._row_counts, None  # gathered with the dense gradients, if so
        if known is not None and known[self.rank].sum(1).tolist() != counts:
            raise RuntimeError(f"trainer {self.rank}: rows {known[self.rank].sum(1).tolist()} gathered, {counts} now")
        as_staged = False  # the sums' keys are this trainer's one forward's, as the stage looked them up
        if self.scatters:
            uniq, summed = self._scatter_rows(parts, keys, _joined_grads(parts), known)
        else:
            totals = None if known is None else [c[:, 0].tolist() for c in known]
            gathered, self._gathered = self._gathered, None  # gathered with the dense gradients, if so
            k, g = gathered or self.all_gather_rows(torch.from_numpy(keys), _joined_grads(parts), totals)
            if self.num_chunks > self.world_size:  # several chunks a trainer: the rows put in chunk order
                k, g = self._chunk_order(k, g, counts, totals)
            if self.num_chunks == 1 and (len(keys) < 2 or bool(np.all(keys[1:] > keys[:-1]))):
                uniq, summed, as_staged = k, g, self.solo  # one forward's rows: already sorted and unique
            else:
                uniq, summed = _sum_rows(k, g, self.num_chunks)
        # one forward's keys as the stage looked them up: the row cache finds the write's slots by them
        keys_all = keys if as_staged else uniq.numpy()
        shards = shard_map.shard_of_keys(keys_all)
        if self.solo:
            return StepUpdate(keys_all, summed, shards, keys_all, shards, summed)
        mine = np.flatnonzero(shards % self.world_size == self.rank)
        return StepUpdate(keys_all[mine], summed[torch.from_numpy(mine)], shards[mine], keys_all, shards, summed)

    def _scatter_rows(
        self, parts: list[tuple[np.ndarray, torch.Tensor]], keys: np.ndarray, grads: torch.Tensor, known
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The scatter exchange: each row's gradient to its owner (``owners_of``: one all-to-all), which
        sums its keys in chunk order, then every owner's sums to every trainer (one all-gather). A
        trainer sends its rows and the step's unique rows, whatever the trainers (the all-gather's
        bytes grow with them). -> (the step's sorted unique keys, their sums): the bits of the gather."""
        w, dim = self.world_size, grads.shape[1]
        own = owners_of(keys, w)
        cuts = np.cumsum([0] + [len(k) for k, _ in parts])
        mine = np.stack([np.bincount(own[a:b], minlength=w) for a, b in zip(cuts[:-1], cuts[1:])])
        if known is None:  # not gathered with the dense gradients (DDP reduces them): one all-gather
            most = self._most()
            pad = torch.zeros((most, w), dtype=torch.int64)
            pad[: len(parts)] = torch.from_numpy(mine)
            every = [torch.empty_like(pad) for _ in range(w)]
            self.comm.all_gather(every, pad)
            known = [every[r][: len(self.chunks_of(r))].numpy() for r in range(w)]
        elif not np.array_equal(known[self.rank], mine):
            raise RuntimeError(
                f"trainer {self.rank}: rows by owner {known[self.rank].tolist()} gathered, {mine.tolist()} now"
            )
        order = torch.from_numpy(np.argsort(own, kind="stable"))  # by owner, then chunk, then key
        send = torch.empty((len(keys), 2 + dim), dtype=torch.int32)
        _rows_bits(torch.from_numpy(keys)[order], grads[order], send)
        out_splits = [int(known[r][:, self.rank].sum()) for r in range(w)]
        recv = torch.empty((sum(out_splits), 2 + dim), dtype=torch.int32)
        self.comm.all_to_all(recv, send, out_splits, mine.sum(0).tolist())
        k, g = _bits_rows(recv)
        if self.num_chunks > w:  # each trainer's chunks in turn -> chunk 0's rows, chunk 1's, ...
            k, g = self._chunk_order(k, g, [], [c[:, self.rank].tolist() for c in known])
        uniq, summed = _sum_rows(k, g, self.num_chunks)
        mine_rows = torch.empty((len(uniq), 2 + dim), dtype=torch.int32)
        _rows_bits(uniq, summed, mine_rows)
        # every owner's sums, padded to what the most any owner summed last step allows (at most the
        # rows it received: never more than the gather's); a first row holds each owner's count
        received = max(int(sum(c[:, d].sum() for c in known)) for d in range(w))
        fit = received if self._sums_fit is None else min(received, self._sums_fit)
        pad = torch.empty((fit + 1, 2 + dim), dtype=torch.int32)  # past an owner's count: never read
        pad[0, 0] = len(uniq)
        pad[1 : 1 + min(fit, len(uniq))] = mine_rows[:fit]
        every = [torch.empty_like(pad) for _ in range(w)]
        self.comm.all_gather(every, pad)
        sizes = [int(p[0, 0]) for p in every]
        self._sums_fit = _fit(max(sizes))
        blocks = [p[1 : 1 + min(n, fit)] for p, n in zip(every, sizes)]
        left = max(0, len(uniq) - fit)
        blocks = _gather_rest(self.comm, blocks, sizes, fit, 2 + dim, lambda out: out[:left].copy_(mine_rows[fit:]))
        k_all, g_all = _bits_rows(torch.cat(blocks))
        at = np.argsort(k_all.numpy(), kind="stable")  # the owners' sorted runs, merged
        return k_all[torch.from_numpy(at)], g_all[torch.from_numpy(at)]

    def _chunk_order(
        self, k: torch.Tensor, g: torch.Tensor, counts: list[int], known: list[list[int]] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The gathered rows (each trainer's chunks in turn) as chunk 0's, chunk 1's, ... rows."""
        most = self._most()
        mine = torch.zeros(most, dtype=torch.int64)
        mine[: len(counts)] = torch.tensor(counts, dtype=torch.int64)
        if self.solo:
            every = [mine]
        elif known is not None:
            every = [torch.tensor(c, dtype=torch.int64) for c in known]
        else:
            every = [torch.empty_like(mine) for _ in range(self.world_size)]
            self.comm.all_gather(every, mine)
        spans: dict[int, tuple[int, int]] = {}
        at = 0
        for r in range(self.world_size):
            for i, c in enumerate(self.chunks_of(r)):
                n = int(every[r][i])
                spans[c] = (at, at + n)
                at += n
        order = torch.cat([torch.arange(*spans[c]) for c in range(self.num_chunks)])
        return k[order], g[order]

    def collective(self) -> Collective:
        """Recovery's view of the group: the few collectives its commit points need."""
        if self.solo:
            return Collective()
        return Collective(self.world_size, self.barrier, self.max_flags, self.broadcast_int, self.sum_floats)
