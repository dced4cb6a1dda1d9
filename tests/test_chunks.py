"""The arithmetic depends on the chunks of each global batch, never on how many trainers share them
(``--chunks``, ``--dense-reduce chunks``): every chunk's gradients computed on their own and reduced
in chunk order. Real trainers over gloo and real redis-servers; the chunk-order reduction itself
also in one process."""

import os

import numpy as np
import pytest
import torch

from embeddings.shard_map import ShardMap
from embeddings.tables import TableSet, TableSpec
from recsys.clock import pin_trainer, trainer_cores, usable_cores
from recsys.config import ConfigError, RunConfig, TrainConfig
from recsys.group import TrainerGroup
from tests.conftest import train_cli

FLAGS = [
    "--steps", "12", "--batch-size", "192", "--shards", "2", "--rows-per-table", "1000", "--eval-every", "0",
    "--recovery", "log", "--checkpoint-every", "6", "--no-keep-model", "--embedding-dim", "8",
]  # fmt: skip


def test_three_trainers_one_trainer_of_three_chunks_and_two_trainers_of_three_end_bit_identical(tmp_path):
    from recsys.results.verify import verify

    runs = {
        name: train_cli(tmp_path / name, *FLAGS, *flags)
        for name, flags in (
            ("three", ["--trainers", "3"]),
            ("one", ["--trainers", "1", "--chunks", "3"]),
            ("two", ["--trainers", "2", "--chunks", "3", "--row-exchange", "scatter"]),  # owners sum the rows
        )
    }
    digests = {name: s["embedding_digest"] for name, s in runs.items()}
    assert len(set(digests.values())) == 1, digests
    assert len({s["final_auc"] for s in runs.values()}) == 1
    assert [s["trainers"] for s in runs.values()] == [3, 1, 2]
    # trainer 0's cores: its own share where the trainers each get one (--pin-trainers, the default)
    for name, w in (("three", 3), ("one", 1), ("two", 2)):
        assert runs[name]["trainer_cores"] == (trainer_cores(0, w) or usable_cores()), name
    # rank 0's collectives: the update's agreement and the dense gather (which carries the stage's
    # agreement and the rows' counts) every step, the rows' gather where they did not fit, the
    # checkpoints' and the run's end (12 steps: 4 a step at least); none with one trainer
    assert runs["one"]["collectives_ms"] is None
    for name in ("three", "two"):
        c = runs[name]["collectives_ms"]
        assert c["calls"] >= 4 and c["ms"] > 0, (name, c)
    code, line = verify(tmp_path / "two")
    assert code == 0, line
    # the logged loss is the mean over the step's chunks however they are shared (2 trainers of 3
    # chunks: one trainer's sum of two, the other's one, divided by 3)
    losses = {name: [r["loss"] for r in _records(tmp_path / name) if "loss" in r] for name in runs}
    assert len(losses["three"]) >= 2
    for name in ("one", "two"):
        assert losses[name] == pytest.approx(losses["three"], rel=1e-6), name


def _records(out) -> list[dict]:
    import json

    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]


def test_a_trainer_of_several_chunks_reads_them_on_one_read_ahead_thread():
    import os
    import threading

    from data.batches import READ_AHEAD_NICE, BatchReader, ChunkReader
    from data.synthetic import SyntheticConfig, SyntheticSource

    seen: set[str] = set()
    nices: list[int] = []

    def prepare(batch) -> None:  # on Linux a thread's priority is its own: the read-ahead's is nicer
        seen.add(threading.current_thread().name)
        nices.append(os.getpriority(os.PRIO_PROCESS, 0))

    source = SyntheticSource(SyntheticConfig(rows_per_table=(100,) * 26))
    reader = ChunkReader(source, 96, [0, 2], 3, read_ahead=True, prepare=prepare)
    plain = [BatchReader(SyntheticSource(source.cfg), 96, world_size=3, rank=c) for c in (0, 2)]
    try:
        for _ in range(4):
            got, want = next(reader), [next(r) for r in plain]
            for a, b in zip(got, want):
                assert torch.equal(a.labels, b.labels) and torch.equal(a.dense_features, b.dense_features)
    finally:
        reader.close()
    assert len(seen) == 1, seen  # one thread read every chunk ahead
    assert seen.pop().startswith("read-ahead")
    assert nices[0] == min(19, os.getpriority(os.PRIO_PROCESS, 0) + READ_AHEAD_NICE)


def test_a_read_ahead_that_steps_wait_for_runs_at_the_trainers_priority_from_then_on():
    import os
    import time

    from data.batches import LATE_STEPS, READ_AHEAD, READ_AHEAD_NICE, BatchReader
    from data.synthetic import SyntheticConfig, SyntheticSource

    nices: list[int] = []

    def prepare(batch) -> None:  # slower than the loop below: every step waits for its batch
        nices.append(os.getpriority(os.PRIO_PROCESS, 0))
        time.sleep(0.02)

    source = SyntheticSource(SyntheticConfig(rows_per_table=(100,) * 26))
    reader = BatchReader(source, 32, read_ahead=True, prepare=prepare)
    try:
        for _ in range(8):
            next(reader)
    finally:
        reader.close()
    base = os.getpriority(os.PRIO_PROCESS, 0)
    # the first batch is read by the step itself; the next LATE_STEPS on the nicer thread, which the
    # steps waited for, and the reads queued behind them then (a lone reader keeps READ_AHEAD batches
    # ahead: the nicer thread ends after them); the rest on a thread at the trainer's priority (the
    # last read ahead may be dropped by the close before it starts)
    nicer = LATE_STEPS + READ_AHEAD - 1
    assert nices[:nicer] == [min(19, base + READ_AHEAD_NICE)] * nicer, nices
    assert nices[nicer:] == [base] * (len(nices) - nicer) and len(nices) >= nicer + 3, nices


def test_ddp_allreduce_is_the_same_model_within_float_error_not_bit_for_bit(tmp_path):
    exact = train_cli(tmp_path / "exact", *FLAGS, "--trainers", "3")
    ddp = train_cli(tmp_path / "ddp", *FLAGS, "--trainers", "3", "--dense-reduce", "allreduce")
    assert ddp["embedding_digest"] != exact["embedding_digest"]
    assert abs(ddp["final_auc"] - exact["final_auc"]) < 0.002


def _grads(seed: int, n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=g) * 10 ** float(e) for e in torch.randint(-6, 6, (5,), generator=g)]


def test_reduce_dense_sums_in_chunk_order_and_divides_by_the_chunks():
    chunks = _grads(0, 1000)
    group = TrainerGroup(1, 0, num_chunks=5)
    assert group.chunks == [0, 1, 2, 3, 4] and group.reduces_dense
    p = torch.nn.Parameter(torch.zeros(10, 100))
    group.reduce_dense([p], chunks)
    want = chunks[0].clone()
    for c in chunks[1:]:
        want += c
    want /= 5
    assert torch.equal(p.grad.reshape(-1), want)
    backwards = chunks[4].clone()
    for c in reversed(chunks[:4]):
        backwards += c
    assert not torch.equal(backwards / 5, want)  # the order matters: the test can tell


def test_aggregate_puts_the_rows_of_several_chunks_in_chunk_order():
    tables = TableSet([TableSpec("t0", num_rows=100, dim=4)])
    shard_map = ShardMap(tables, 2)
    rng = np.random.default_rng(0)
    parts = []
    for _ in range(3):
        keys = np.unique(rng.integers(0, 100, 30)).astype(np.int64)
        parts.append((keys, torch.from_numpy(rng.standard_normal((len(keys), 4)).astype(np.float32))))
    update = TrainerGroup(1, 0, num_chunks=3).aggregate(parts, shard_map)
    every = np.unique(np.concatenate([k for k, _ in parts]))
    assert np.array_equal(update.keys, every)
    for i, key in enumerate(every[:10]):
        want = torch.zeros(4)
        for k, g in parts:
            at = np.flatnonzero(k == key)
            if len(at):
                want += g[int(at[0])]
        assert torch.equal(update.grads[i], want / 3)


@pytest.mark.parametrize(
    "train, message",
    [
        ({"chunks": 3, "trainers": 2, "batch_size": 96, "dense_reduce": "allreduce"}, "needs --dense-reduce chunks"),
        ({"chunks": 5, "batch_size": 64}, "batch_size=64: must be a multiple of chunks=5"),
        ({"dense_reduce": "ring"}, "dense_reduce='ring': must be chunks or allreduce"),
        ({"row_exchange": "ring"}, "row_exchange='ring': must be auto, gather or scatter"),
        (
            {"chunks": 2, "trainers": 3, "batch_size": 96},
            "chunks=2: must be 0 .one per trainer. or at least trainers=3",
        ),
    ],
)
def test_bad_chunk_settings_are_refused_in_one_line(train, message):
    with pytest.raises(ConfigError, match=message):
        RunConfig(train=TrainConfig(**train))


def test_several_chunks_a_trainer_are_refused_on_the_local_engine_and_under_train_through():
    from recsys.config import EmbeddingConfig, RecoveryConfig

    with pytest.raises(ConfigError, match="chunks=2: several chunks a trainer train on the Redis tier"):
        RunConfig(embeddings=EmbeddingConfig(embeddings="local"), train=TrainConfig(trainers=1, chunks=2))
    with pytest.raises(ConfigError, match="do not yet train through"):
        RunConfig(recovery=RecoveryConfig(train_through=True), train=TrainConfig(trainers=1, chunks=2))


_EXCHANGES = [("gather", True), ("gather", False), ("scatter", True), ("scatter", False)]


def _two_ranks(rank: int, store_path: str, out) -> None:
    """One of 2 real gloo processes: a step's dense gradients and rows reduced with the rows' counts
    gathered beside the dense gradients, then without, each with the rows gathered and scattered;
    -> (the results, collectives each way)."""
    import torch.distributed as dist

    from recsys.clock import Collectives

    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=2)
    tables = TableSet([TableSpec("t0", num_rows=100, dim=4)])
    shard_map = ShardMap(tables, 2)
    got = []
    for exchange, with_counts in _EXCHANGES:
        rng = np.random.default_rng(rank)  # the same draws each time
        # 2 chunks a trainer: the rows put in chunk order
        group = TrainerGroup(2, rank, num_chunks=4, row_exchange=exchange)
        steps = []
        # 4 steps of one group: the second sums more rows than the first's fit (a second gather of the
        # sums), the last has no row on trainer 0
        for draws in (20, 90, 30, 0):
            flats = _grads(rank + draws, 60)[:2]
            parts = []
            for _ in group.chunks:
                keys = np.unique(rng.integers(0, 100, draws + 7 * rank)).astype(np.int64)
                parts.append((keys, torch.from_numpy(rng.standard_normal((len(keys), 4)).astype(np.float32))))
            p = torch.nn.Parameter(torch.zeros(60))
            calls = Collectives.calls
            flags = np.zeros(3, np.int64)  # a commit point's: trainer 1 saw shard 2 fail in the second step
            flags[2] = int(rank == 1 and draws == 90)
            failed = group.reduce_dense([p], flats, parts if with_counts else None, flags)
            update = group.aggregate(parts, shard_map)
            steps.append(
                (
                    p.grad.numpy().copy(),
                    update.updated_keys,
                    update.updated_grads.numpy().copy(),
                    failed,
                    Collectives.calls - calls,
                )
            )
        got.append(steps)
    dist.destroy_process_group()
    out.put((rank, got))  # numpy arrays: torch's tensors would pass as file descriptors


def test_the_rows_counts_travel_with_the_dense_gradients_on_the_same_bits(tmp_path):
    """2 real gloo processes, 2 chunks each: the rows' counts gathered in the dense gradients'
    collective spare the counts' own two (the trainers' and the chunks'); the rows scattered to their
    owners, summed there and the sums gathered, give every bit the gather gives; a commit point's
    flags ride in the same gather (a stage's failure, ``CommitPoints.stage_ahead``)."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_two_ranks, args=(r, str(tmp_path / "store"), out)) for r in range(2)]
    for p in procs:
        p.start()
    results = dict(out.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    for rank in (0, 1):
        for step in range(4):
            (g1, k1, r1, _, _), *others = [variant[step] for variant in results[rank]]
            assert len(k1) > (5, 40, 60, 5)[step] and np.all(np.diff(k1) > 0)
            for g2, k2, r2, _, _ in others:
                assert np.array_equal(g1, g2) and np.array_equal(k1, k2) and np.array_equal(r1, r2)
            # the flags ride in the dense gather, in no collective of their own (the counts below)
            assert [variant[step][3] for variant in results[rank]] == [[2] if step == 1 else []] * len(_EXCHANGES)
        # gather: the dense gather carries the counts and as many rows as fitted the step before (none
        # on the first), the rest in a second; without the counts, the rows' gather, theirs and the
        # chunks' too; scatter: the dense gather, the all-to-all and the sums' gather (and the counts'),
        # a second gather of the sums where an owner summed more than the last step's fit
        calls = [[c for *_, c in variant] for variant in results[rank]]
        assert calls == [[2, 2, 1, 1], [4, 4, 4, 4], [3, 4, 3, 3], [4, 5, 4, 4]], calls
    assert np.array_equal(results[0][0][1][1], results[1][0][1][1])  # every trainer holds the same rows


def test_auto_scatters_the_rows_from_scatter_from_trainers_and_owners_share_the_hot_rows():
    from recsys.group import SCATTER_FROM, owners_of

    assert [TrainerGroup(w, 0).scatters for w in (1, SCATTER_FROM - 1, SCATTER_FROM, 64)] == [False, False, True, True]
    assert (
        TrainerGroup(2, 0, row_exchange="scatter").scatters and not TrainerGroup(64, 0, row_exchange="gather").scatters
    )
    assert not TrainerGroup(1, 0, row_exchange="scatter").scatters  # one trainer exchanges nothing
    with pytest.raises(ValueError, match="row_exchange='ring' must be one of auto, gather, scatter"):
        TrainerGroup(2, 0, row_exchange="ring")
    # the hot rows (small ids, every table) and ids of one stride spread evenly over the owners
    for ids in (np.arange(2000), np.arange(0, 64_000, 32)):
        keys = np.concatenate([ids + (t << 40) for t in range(26)]).astype(np.int64)
        for w in (2, 3, 8, 64):
            share = np.bincount(owners_of(keys, w), minlength=w) / len(keys)
            assert share.max() < 1.2 / w and share.min() > 0.8 / w, (w, share)


def test_trainers_get_disjoint_shares_of_the_cores_or_none():
    """Trainer i of W: the i-th W-th of the cores, none shared; none with one trainer or with more
    trainers than cores (the scheduler places them), nor for an index out of range."""
    assert trainer_cores(0, 2, [0, 1]) == [0] and trainer_cores(1, 2, [0, 1]) == [1]
    eight = list(range(8))
    shares = [trainer_cores(i, 3, eight) for i in range(3)]
    assert shares == [[0, 1], [2, 3], [4, 5]]  # 8 // 3 = 2 each; the last two cores are the servers'
    assert trainer_cores(0, 1, eight) is None  # one trainer: every core
    assert trainer_cores(0, 3, [0, 1]) is None  # more trainers than cores
    assert trainer_cores(2, 2, [0, 1]) is None and trainer_cores(-1, 2, [0, 1]) is None
    # the torch threads' split counts the host's cores, not a pinned trainer's share of them
    from recsys import clock
    from recsys.config import EmbeddingConfig
    from recsys.trainer import torch_threads

    saved = list(clock._HOST_CORES)
    try:
        clock._HOST_CORES[:] = range(16)  # as pin_trainer leaves it on a 16-core host
        cfg = RunConfig(embeddings=EmbeddingConfig(redis="local", shards=2), train=TrainConfig(trainers=2))
        assert torch_threads(cfg, 2) == 7  # (16 cores - 2 local servers) // 2 trainers, not (8 - 2) // 2
    finally:
        clock._HOST_CORES[:] = saved
    # --threads asking more torch threads than a trainer's cores: not pinned (they would spin on one core)
    before = os.sched_getaffinity(0)
    try:
        assert pin_trainer(0, len(before), threads=2) is None  # a share of one core each
        assert os.sched_getaffinity(0) == before
    finally:
        os.sched_setaffinity(0, before)
