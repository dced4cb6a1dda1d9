import json
import time

import numpy as np
import pytest
import redis
import torch

from embeddings import LocalShards, RedisStore, RowWiseAdagrad, TableSet, TableSpec
from recovery.accounting import Ledger, UpdateCounter, lost_samples, pls
from recovery.durable.checkpoint import Checkpointer, CheckpointHooks
from recovery.durable.identity import snapshot_mismatch
from recovery.durable.log import ShardLog, parse_fsync_policy
from recovery.durable.log_format import encode_record, scan
from recovery.errors import CorruptCheckpointError, InjectionSpecError, NoCheckpointError
from recovery.inject import Injection, corrupt_file, parse_injection
from recovery.manager import RecoveryManager
from recovery.protocol import Collective
from tests.conftest import track

TABLES = TableSet([TableSpec("a", 300, 4), TableSpec("b", 200, 4)])


def test_injection_specs_parse_and_bad_ones_are_named():
    assert parse_injection("shard:2@step=10") == Injection("shard", 2, 10)
    assert parse_injection("stall:0@step=5:2.5") == Injection("stall", 0, 5, 2.5)
    assert parse_injection("trainer:1@step=7") == Injection("trainer", 1, 7)
    assert parse_injection("corrupt-checkpoint:latest") == Injection("corrupt-checkpoint", None, None)
    assert str(parse_injection("corrupt-checkpoint:latest@step=4")) == "corrupt-checkpoint:latest@step=4"
    with pytest.raises(InjectionSpecError, match="--inject 'shard:x@step=1'"):
        parse_injection("shard:x@step=1")


def test_fsync_policy():
    assert parse_fsync_policy("always") == 0.0 and parse_fsync_policy("none") is None
    assert parse_fsync_policy("every:50") == 50.0
    with pytest.raises(ValueError, match="'every:0'"):
        parse_fsync_policy("every:0")


def test_log_round_trip_cuts_a_torn_tail_and_drops_covered_segments(tmp_path):
    log = ShardLog(tmp_path, 0, "always")
    log.open_segment(1)
    rng = np.random.default_rng(0)
    written = []
    for step in range(1, 6):
        ids = rng.choice(300, 20, replace=False)
        rows = rng.standard_normal((20, 5)).astype(np.float32)
        log.append_step(step, [(0, ids, rows)])
        written.append((step, ids, rows))
    log.close()
    seg = log.segments()[0]
    whole = seg.stat().st_size
    with open(seg, "ab") as f:  # a torn record: a header and half a payload
        f.write(encode_record(6, 0, np.arange(10), np.ones((10, 5), np.float32))[:60])
    log2 = ShardLog(tmp_path, 0)
    log2.open_segment(1)  # reopening cuts the tail
    assert seg.stat().st_size == whole and log2.num_cut_bytes == 60
    got = list(log2.records(after_step=2))
    assert [r.step for r in got] == [3, 4, 5]
    for r, (step, ids, rows) in zip(got, written[2:]):
        assert r.step == step and np.array_equal(r.ids, ids) and np.array_equal(r.rows, rows)
    # a flipped byte in the middle: the records from there on do not verify
    data = bytearray(seg.read_bytes())
    data[len(data) // 2] ^= 0xFF
    seg.write_bytes(bytes(data))
    records, end = scan(seg)
    assert 0 < len(records) < 5 and end < len(data)
    # segments wholly before a checkpoint go
    log2.open_segment(11)
    log2.append_step(11, [(1, np.arange(3), np.zeros((3, 5), np.float32))])
    assert len(log2.segments()) == 2
    assert log2.drop_before(10) == [seg] and len(log2.segments()) == 1
    log2.close()


def test_log_reads_only_segments_that_can_hold_later_steps_and_truncation_drops_later_segments(tmp_path):
    log = ShardLog(tmp_path, 0)
    row = np.ones((1, 3), np.float32)
    for first, steps in ((1, range(1, 11)), (11, range(11, 21)), (21, range(21, 26))):
        log.open_segment(first)
        for step in steps:
            log.append_step(step, [(0, np.array([step]), row * step)])
    log.close()
    s1, s11, s21 = log.segments()
    with open(s1, "ab") as f:  # planted: a covered segment is not even read, so this never shows
        f.write(encode_record(99, 0, np.array([99]), row))
    assert [r.step for r in log.records(after_step=12)] == list(range(13, 26))
    assert [r.step for r in log.records(after_step=10)] == list(range(11, 26))
    assert [float(r.rows[0, 0]) for r in log.records(after_step=20, up_to_step=22)] == [21.0, 22.0]
    # back to step 15: the segment of steps 21.. goes (records of 16.. are written to seg 11 again, and a
    # reader must not skip seg 11 for an empty later one)
    log.truncate_after(15)
    assert log.segments() == [s1, s11]
    log.open_segment(11)
    for step in range(16, 24):
        log.append_step(step, [(0, np.array([step]), row * -step)])
    log.close()
    assert [(r.step, float(r.rows[0, 0])) for r in log.records(after_step=21)] == [(22, -22.0), (23, -23.0)]


def test_a_step_appended_right_after_a_queued_segment_switch_lands_in_the_new_segment(tmp_path):
    """At a checkpoint the switch to a new segment is queued behind the records in flight and the
    writer goes on at once: its next append must neither see the log closed mid-switch nor land in
    the old segment."""

    class SlowDisk(ShardLog):  # opening a segment takes a while: the switch is still running at the append
        def _open(self, first_step):
            time.sleep(0.02)
            super()._open(first_step)

    log = SlowDisk(tmp_path, 0, "always")
    log.open_segment(1)
    row = np.ones((1, 3), np.float32)
    for step in range(1, 121):
        log.append_step(step, [(0, np.array([step]), row * step)], wait=False)
        time.sleep(0.002)  # a step's compute
        if step % 3 == 0:
            log.open_segment(step + 1)  # queued: the records of ``step`` are still being written
    log.close()
    segs = log.segments()
    assert [ShardLog.first_step(s) for s in segs] == [1, *range(4, 122, 3)]
    for seg, nxt in zip(segs, [*segs[1:], None]):
        steps = [r.step for r in scan(seg)[0]]
        last = ShardLog.first_step(nxt) - 1 if nxt is not None else 120
        assert steps == list(range(ShardLog.first_step(seg), last + 1))


def test_the_ledger_counts_what_no_earlier_restore_counted_and_keeps_it_across_a_restart():
    """Shard 0 restored as of 20 at step 25, then as of 10 at step 28 (20 corrupt): the second loss
    is steps 11-20 and 25-27, not 21-24 again; a ledger rebuilt from the journal or from its state
    counts the same. Step k updates k rows of shard 0 and 1 of shard 1."""

    def trained(ledger: Ledger, steps) -> None:
        for k in steps:
            ledger.count(np.array([0] * k + [1]), k)
            if k % 10 == 0:
                ledger.counter.mark(k)

    def upd(a: int, b: int) -> int:  # shard 0's updates of steps a+1..b
        return sum(range(a + 1, b + 1))

    led = Ledger(2, batch_size=4)
    trained(led, range(1, 25))
    first: dict = {"target": 0}
    led.partial(first, 0, 20, 24, 0, [])
    assert first["lost_updates"] == upd(20, 24)
    trained(led, range(25, 28))
    copies = [Ledger(2, batch_size=4) for _ in range(2)]
    copies[0].counter.load(led.counter.state())
    copies[0].recent = dict(led.recent)
    copies[0].from_journal([first])
    copies[1].load_state(json.loads(json.dumps(led.state())))
    copies[1].recent = dict(led.recent)
    for ledger in (led, *copies):
        second: dict = {"target": 0}
        ledger.partial(second, 0, 10, 27, 0, [])
        assert second["lost_updates"] == upd(10, 20) + upd(24, 27)
        everything = second["lost_updates"] + 13  # shard 1: one update in each of those 13 steps
        assert second["lost_samples"] == pytest.approx(13 * 4 * second["lost_updates"] / everything, abs=1e-3)
    third: dict = {"target": 0}
    led.partial(third, 0, 20, 27, 0, [])  # nothing of steps 21-27 is left to lose
    assert third["lost_updates"] == 0 and third["lost_samples"] == 0.0


def test_update_counter_and_pls():
    c = UpdateCounter(3)
    c.add(np.array([5, 3, 2]))
    c.mark(10)
    c.add(np.array([1, 6, 3]))
    assert c.since(10).tolist() == [1, 6, 3] and c.since(0).tolist() == [6, 9, 5]
    assert lost_samples(1000, 6, 10) == 600.0 and lost_samples(1000, 0, 0) == 0.0
    assert pls([600.0, 150.0], 10_000) == 0.075


@pytest.fixture
def rig(tmp_path, namespace):
    """3 real shards, a store, a checkpointer and a log per shard: a trainer without a model."""
    with LocalShards(3) as sh:
        track(sh)
        store = RedisStore(sh.urls, TABLES, RowWiseAdagrad(lr=0.1), namespace=namespace, timeout_s=1.0)
        ckpt = Checkpointer(tmp_path / "ckpt", 3, sh.specs, store, run=namespace)
        logs = {s: ShardLog(tmp_path / "logs", s) for s in range(3)}
        for log in logs.values():
            log.open_segment(1)
        yield sh, store, ckpt, logs
        store.close()


def make_manager(strategy, store, sh, ckpt, logs, **more):
    return RecoveryManager(
        strategy=strategy,
        store=store,
        shards=sh.specs,
        rank=0,
        batch_size=64,
        collective=Collective(),
        checkpointer=ckpt,
        logs=logs,
        **more,
    )


def train_steps(mgr, store, first, last, rng):
    for step in range(first, last + 1):
        grads = {}
        updated = {}
        for t in TABLES:
            ids = rng.choice(t.num_rows, 40, replace=False)
            grads[t.name] = (ids, rng.standard_normal((40, t.dim)).astype(np.float32))
            updated[t.name] = np.sort(ids)
        mgr.apply(grads, step)
        assert mgr.detector.sync() == []
        mgr.count_updates(updated)


def all_rows(store):
    return {t.name: store.read_rows(t.name, np.arange(t.num_rows)) for t in TABLES}


def shard_mask(store, t, s):
    return store.shard_map.shard_of(store.tables.index(t.name), np.arange(t.num_rows)) == s


def checkpoint(mgr, ckpt, step, namespace):
    mgr.counter.mark(step)
    ckpt.save(step, {"x": __import__("torch").zeros(1)}, {"step": step, "namespace": namespace})
    ckpt.wait()
    for log in mgr.logs.values():
        log.open_segment(step + 1)


def test_partial_recovery_restores_only_the_failed_shard_and_counts_lost_updates(rig, namespace):
    sh, store, ckpt, logs = rig
    mgr = make_manager("partial", store, sh, ckpt, logs)
    rng = np.random.default_rng(1)
    train_steps(mgr, store, 1, 5, rng)
    checkpoint(mgr, ckpt, 5, namespace)
    at_ckpt = all_rows(store)
    train_steps(mgr, store, 6, 9, rng)
    before = all_rows(store)
    sh.kill(1)
    ok, _ = mgr.guard(lambda: store.pull("a", np.arange(300)))
    assert not ok and mgr.detector.sync() == [1]
    assert mgr.recover_outcome([1], 10, "pull").to_step is None
    after = all_rows(store)
    for t in TABLES:
        m = shard_mask(store, t, 1)
        np.testing.assert_array_equal(after[t.name][~m], before[t.name][~m])  # others untouched
        np.testing.assert_array_equal(after[t.name][m], at_ckpt[t.name][m])  # failed one = checkpoint
        assert not np.array_equal(before[t.name][m], at_ckpt[t.name][m])  # there was something to lose
    # the updates actually lost: every (row, step) the shard's log holds after the checkpoint
    actual = sum(len(r.ids) for r in logs[1].records(after_step=5, up_to_step=9))
    rec = mgr.failures[0]
    assert rec["lost_updates"] == actual > 0
    assert rec["restored_from_step"] == 5 and rec["kind"] == "shard" and rec["target"] == 1
    share = mgr.counter.since(5)[1] / mgr.counter.since(5).sum()
    assert rec["lost_samples"] == pytest.approx(4 * 64 * share, abs=1e-3)
    assert store.applied_steps()[1] == 5


def test_log_recovery_replays_to_the_exact_rows(rig, namespace):
    sh, store, ckpt, logs = rig
    mgr = make_manager("log", store, sh, ckpt, logs)
    rng = np.random.default_rng(2)
    train_steps(mgr, store, 1, 4, rng)
    checkpoint(mgr, ckpt, 4, namespace)
    train_steps(mgr, store, 5, 8, rng)
    before = all_rows(store)
    # a torn tail on the failed shard's log (a crash mid-append) is cut and the rest replays
    with open(logs[2].segments()[-1], "ab") as f:
        f.write(b"\x31\x43\x45\x52garbage")
    sh.kill(2)
    mgr.guard(lambda: store.pull("b", np.arange(200)))
    assert mgr.recover_outcome(mgr.detector.sync(), 9, "pull").to_step is None
    after = all_rows(store)
    for t in TABLES:
        np.testing.assert_array_equal(after[t.name], before[t.name])
    assert mgr.failures[0]["lost_updates"] == 0 and store.applied_steps()[2] == 8


def test_a_fresh_start_assumes_nothing_of_a_shard_that_is_already_dead(rig):
    """Another rank may already be in a phase that killed a shard when this one starts: its fresh
    start knows the live shards empty and leaves the dead one to be read (and recovered)."""
    sh, store, _, _ = rig
    store.hold_rows({0, 1, 2}, 1 << 20)
    sh.kill(1)
    store.assume_fresh()
    assert store.row_cache._fresh == {0, 2}


def test_a_fresh_start_after_a_restart_takes_the_first_write_back(rig):
    """A trainer restarted before its first dense state became the restart point starts afresh:
    step 1's rows already on the shards (or a write of them cut short: marker still unset) go back
    by their undo records, so step 1 is not applied twice; a shard that never applied one is left."""
    sh, store, _, logs = rig
    mgr = make_manager("partial", store, sh, None, logs)
    initial = all_rows(store)
    train_steps(mgr, store, 1, 1, np.random.default_rng(7))
    assert store.applied_steps() == [1, 1, 1] and not np.array_equal(all_rows(store)["a"], initial["a"])
    store.call(2, lambda c: c.delete(store.meta_key("applied", 2)))  # shard 2's write cut short before its marker
    store.call(1, lambda c: c.delete(store.meta_key("applied", 1), store.meta_key("undo", 1)))
    mgr.fresh_start()
    # shard 1: no marker and no undo record, nothing says a write was made there: nothing is undone
    after = all_rows(store)
    for t in TABLES:
        keep = shard_mask(store, t, 1)
        np.testing.assert_array_equal(after[t.name][~keep], initial[t.name][~keep])
        assert not np.array_equal(after[t.name][keep], initial[t.name][keep])
    assert store.applied_steps() == [0, None, 0]
    mgr.close()


def held_shard_restored(rig, namespace, strategy: str, seed: int):
    """A writer holding every shard's rows trains 7 steps (a checkpoint at 4), then shard 1 is killed
    and restored under ``strategy``. -> (manager, store, every row before the kill, held generation
    before the kill)."""
    sh, store, ckpt, logs = rig
    store.hold_rows({0, 1, 2}, 1 << 30)
    store.assume_fresh()
    mgr = make_manager(strategy, store, sh, ckpt, logs)
    rng = np.random.default_rng(seed)
    train_steps(mgr, store, 1, 4, rng)
    checkpoint(mgr, ckpt, 4, namespace)
    train_steps(mgr, store, 5, 7, rng)
    before, generation = all_rows(store), store.row_cache.generation
    sh.kill(1)
    with store.from_redis():
        ok, _ = mgr.guard(lambda: store.pull("a", np.arange(300)))
    assert not ok and mgr.recover_outcome(mgr.detector.sync(), 8, "pull").to_step is None
    return mgr, store, before, generation


def held_and_tier(store):
    """Every row as the writer holds it, and as the shards hold it."""
    held = all_rows(store)
    with store.from_redis():
        return held, all_rows(store)


def test_a_restore_forgets_only_its_shards_held_rows_and_reads_them_back(rig, namespace):
    """After a partial restore of one shard (to the checkpoint of step 4, at step 8), the writer holds
    every row again, as the shards hold it: the other shards' rows were kept; of the restored
    shard's, those last written by step 4 are held again, those first written after it are known
    never written, and only the rest (written both before and after) are read back."""
    _, store, _, kept = held_shard_restored(rig, namespace, "partial", 4)
    assert store.row_cache.generation > kept and store.reload_s > 0
    assert min(store.reload_kept, store.reload_absent, store.reload_read) > 0, vars(store)
    assert all(store.row_cache.restores.unknown(s) == {} for s in range(3))  # nothing left to read from Redis
    held, tier = held_and_tier(store)
    for t in TABLES:
        np.testing.assert_array_equal(held[t.name], tier[t.name])


def test_a_log_replay_to_the_writers_last_step_keeps_its_held_rows_without_a_read(rig, namespace):
    """A log replay brings the shard back to exactly what its writer wrote: the rows it held there
    are held again with no read from Redis, and equal what the shard now holds."""
    mgr, store, before, _ = held_shard_restored(rig, namespace, "log", 5)
    assert store.reload_s == 0 and all(store.row_cache.restores.unknown(s) == {} for s in range(3))
    held, tier = held_and_tier(store)
    for t in TABLES:
        np.testing.assert_array_equal(held[t.name], before[t.name])
        np.testing.assert_array_equal(tier[t.name], before[t.name])
    # the held rows go on serving updates: the next steps' rows match the tier's
    train_steps(mgr, store, 8, 9, np.random.default_rng(6))
    held, tier = held_and_tier(store)
    for t in TABLES:
        np.testing.assert_array_equal(held[t.name], tier[t.name])


def test_a_write_behind_that_failed_but_reached_the_log_is_not_redone(rig, namespace):
    """One trainer writing behind: a step's records go to the logs when its write is handed over. A
    shard that dies under that write and is seen by the next step's read is replayed from its log
    up to that step, so the write is not redone on it (redone, its update would be applied twice)."""
    sh, store, ckpt, logs = rig
    store.hold_rows({0, 1, 2}, 1 << 30)
    store.assume_fresh()
    mgr = make_manager("log", store, sh, ckpt, logs, write_behind=True)
    rng = np.random.default_rng(3)

    def step(n: int) -> None:
        grads = {}
        for t in TABLES:
            grads[t.name] = (
                rng.choice(t.num_rows, 40, replace=False),
                rng.standard_normal((40, t.dim)).astype(np.float32),
            )
        assert not mgr.commit_behind(n).rolled_back
        mgr.apply(grads, n, behind=True)

    for n in range(1, 5):
        step(n)
    assert not mgr.commit_behind(5).rolled_back
    checkpoint(mgr, ckpt, 4, namespace)
    for n in range(5, 8):
        step(n)
    assert not mgr.commit_behind(8).rolled_back
    sh.kill(2)
    step(8)  # its write fails on shard 2 in the background; its records are in the logs
    expected = all_rows(store)  # the held rows: every row as of step 8
    with store.from_redis():
        out = mgr.run_phase(9, "stage", lambda only: store.pull("a", np.arange(300)))
    assert out.action.name == "CONTINUE" and mgr.failures[0]["target"] == 2
    with store.from_redis():
        after = all_rows(store)
    for t in TABLES:
        np.testing.assert_array_equal(after[t.name], expected[t.name])
    assert store.applied_steps()[2] == 8
    assert store.reload_s == 0  # replayed to the writer's last step: its held rows stay, no read back
    held = all_rows(store)
    for t in TABLES:
        np.testing.assert_array_equal(held[t.name], expected[t.name])


def test_corrupt_checkpoint_is_detected_never_loaded_and_restore_falls_back(rig, namespace):
    sh, store, ckpt, logs = rig
    mgr = make_manager("partial", store, sh, ckpt, logs)
    rng = np.random.default_rng(3)
    train_steps(mgr, store, 1, 3, rng)
    checkpoint(mgr, ckpt, 3, namespace)
    at_3 = all_rows(store)
    train_steps(mgr, store, 4, 6, rng)
    checkpoint(mgr, ckpt, 6, namespace)
    corrupt_file(ckpt.candidates()[0].shard_file(0))
    with pytest.raises(CorruptCheckpointError, match=r"step 6: .*shard0.rdb has SHA-256"):
        ckpt.candidates()[0].verify()
    sh.kill(0)
    mgr.guard(lambda: store.pull("a", np.arange(300)))
    mgr.recover_outcome(mgr.detector.sync(), 7, "pull")
    rec = mgr.failures[0]
    assert rec["restored_from_step"] == 3 and "shard0.rdb" in rec["corrupt_checkpoints"][0]
    after = all_rows(store)
    for t in TABLES:
        m = shard_mask(store, t, 0)
        np.testing.assert_array_equal(after[t.name][m], at_3[t.name][m])
    # with every checkpoint corrupt there is nothing to load
    assert [c.step for c in ckpt.candidates()] == [6, 3]
    corrupt_file(ckpt.candidates()[1].shard_file(0))
    with pytest.raises(NoCheckpointError, match="no complete, verified checkpoint"):
        ckpt.latest_verified()


def test_over_the_protocol_a_corrupt_or_truncated_snapshot_is_passed_over_before_the_server_gets_it(rig, namespace):
    """A shard given by URL: the newest snapshot's bytes fail the CRC-64 its file ends with (the one
    its manifest recorded) before any payload is sent, and a truncated one fails the manifest's
    record at once; the older checkpoint is restored, exactly."""
    sh, store, ckpt, logs = rig
    mgr = make_manager("partial", store, sh, ckpt, logs)
    mgr.shard_restore.local = {}  # every shard is one the run did not start: restored over the protocol
    rng = np.random.default_rng(4)
    train_steps(mgr, store, 1, 3, rng)
    checkpoint(mgr, ckpt, 3, namespace)
    at_3 = all_rows(store)
    train_steps(mgr, store, 4, 6, rng)
    checkpoint(mgr, ckpt, 6, namespace)
    assert ckpt.candidates()[0].rdb_checksums.keys() >= {"shard0.rdb", "shard1.rdb"}
    corrupt_file(ckpt.candidates()[0].shard_file(0))
    with open(ckpt.candidates()[0].shard_file(1), "r+b") as f:  # cut short
        f.truncate(f.seek(0, 2) - 100)
    for s in (0, 1):  # a node with two shards fails; its supervisor brings them back empty
        sh.kill(s)
        sh.spec(s).rdb_path.unlink(missing_ok=True)
        sh.restart(s)
        mgr.detected(s, time.time())
    client = redis.Redis.from_url(sh.urls[0])
    mgr.recover_outcome([0, 1], 7, "pull")
    recs = {f["target"]: f for f in mgr.failures}
    assert recs[0]["restored_from_step"] == 3 and "shard0.rdb has SHA-256" in recs[0]["corrupt_checkpoints"][0]
    assert (
        recs[1]["restored_from_step"] == 3
        and "shard1.rdb does not end with the CRC-64" in recs[1]["corrupt_checkpoints"][0]
    )
    stats = client.info("commandstats")
    # one sync, of the older snapshot (its keys, each once): the corrupt file started none
    assert "cmdstat_restore" not in stats and stats["cmdstat_replicaof"]["calls"] == 2 and client.dbsize() > 0
    after = all_rows(store)
    for t in TABLES:
        for s in (0, 1):
            m = shard_mask(store, t, s)
            np.testing.assert_array_equal(after[t.name][m], at_3[t.name][m])


def test_unfinished_or_foreign_checkpoints_do_not_count(rig, namespace, tmp_path):
    sh, store, ckpt, logs = rig
    ckpt.save(1, {"x": __import__("torch").zeros(1)}, {"step": 1, "namespace": namespace})
    ckpt.wait()
    (ckpt.dir / "step_0000000009").mkdir()  # no manifest
    other = ckpt.dir / "step_0000000008"
    other.mkdir()
    (other / "manifest.json").write_text(json.dumps({"step": 8, "files": {}, "meta": {"namespace": "someone-else"}}))
    assert [c.step for c in ckpt.candidates()] == [1]
    c = ckpt.latest_verified()
    assert c.step == 1 and set(c.files) >= {"shard0.rdb", "shard1.rdb", "shard2.rdb", "meta.json"}
    assert any(k.startswith("dense/") for k in c.files)
    assert redis.Redis.from_url(sh.url(0)).info("persistence")["rdb_saves"] >= 1


def run_priority_schedule(strategy, sh, tmp_path, namespace, seed=7):
    """Steps 1-3, checkpoint, steps 4-7, priority save (mfu/ssu), steps 8-9, shard 1 killed, recovered."""
    from recovery.saves.priority import MFUTracker, PrioritySaver, SSUTracker

    store = RedisStore(sh.urls, TABLES, RowWiseAdagrad(lr=0.1), namespace=namespace, timeout_s=1.0)
    store.hold_rows({0, 1, 2}, 1 << 30)  # the writer of every shard, as one trainer is
    store.assume_fresh()
    ckpt = Checkpointer(tmp_path / f"ckpt-{namespace}", 2, sh.specs, store, run=namespace)
    saver = None
    if strategy != "partial":
        tracker = MFUTracker(store) if strategy == "partial-mfu" else SSUTracker(store, 0.3, 500, seed)
        saver = PrioritySaver(tmp_path / f"prio-{namespace}", store, tracker, 60)
    mgr = RecoveryManager(
        strategy=strategy,
        store=store,
        shards=sh.specs,
        rank=0,
        batch_size=64,
        collective=Collective(),
        checkpointer=ckpt,
        priority=saver,
    )
    rng = np.random.default_rng(seed)

    def steps(first, last):
        for step in range(first, last + 1):
            grads, updated = {}, {}
            for t in TABLES:  # Zipf-skewed ids: a few rows get most updates
                ids = np.unique(np.minimum(rng.zipf(1.3, 60) - 1, t.num_rows - 1))
                grads[t.name] = (ids, rng.standard_normal((len(ids), t.dim)).astype(np.float32))
                updated[t.name] = ids
            mgr.apply(grads, step)
            assert mgr.detector.sync() == []
            mgr.count_updates(updated)

    steps(1, 3)
    mgr.saves.on_checkpoint(3)
    ckpt.save(3, {"x": __import__("torch").zeros(1)}, {"step": 3, "namespace": namespace})
    ckpt.wait()
    steps(4, 7)
    at_save = all_rows(store)
    if saver is not None:
        saver.save(7)
    steps(8, 9)
    sh.kill(1)
    with store.from_redis():  # held rows would serve the pull without a word to the dead shard
        mgr.guard(lambda: store.pull("a", np.arange(300)))
    mgr.recover_outcome(mgr.detector.sync(), 10, "pull")
    with store.from_redis():
        after = all_rows(store)
    held = all_rows(store), (store.reload_kept, store.reload_absent, store.reload_read)
    store.clear()
    store.close()
    sh.restart(1)
    return mgr.failures[0], at_save, after, saver, held


@pytest.mark.parametrize("strategy", ["partial-mfu", "partial-ssu"])
def test_priority_saves_are_overlaid_and_cut_the_loss(rig, tmp_path, namespace, strategy):
    sh = rig[0]
    plain, _, _, _, _ = run_priority_schedule("partial", sh, tmp_path, namespace + "p")
    rec, at_save, after, saver, (held, counts) = run_priority_schedule(strategy, sh, tmp_path, namespace + "q")
    # the writer holds what the shards hold, having read back only rows changed since the save or
    # written both before and after the checkpoint: the overlaid rows it held at the save are kept
    for t in TABLES:
        np.testing.assert_array_equal(held[t.name], after[t.name])
    assert counts[0] > 0 and counts[2] < sum(counts), counts
    # the restored shard holds the priority-saved rows as they were at the save
    chosen = saver.saved_rows[1]
    assert sum(len(ids) for _, ids in chosen) > 0
    for t, ids in chosen:
        name = TABLES.specs[t].name
        np.testing.assert_array_equal(after[name][ids], at_save[name][ids])
    # same schedule, same updates: the saved ones are no longer lost
    assert rec["saved_updates"] > 0
    assert rec["lost_updates"] == plain["lost_updates"] - rec["saved_updates"]
    assert rec["lost_samples"] < plain["lost_samples"]


def test_injection_specs_at_moments_phases_and_nodes():
    assert parse_injection("shard:1@t=12.5") == Injection("shard", 1, None, 0.0, 12.5)
    assert parse_injection("stall:2@t=3:1.5") == Injection("stall", 2, None, 1.5, 3.0)
    assert parse_injection("node:1@step=40") == Injection("node", 1, 40)
    assert parse_injection("shard:0@during=checkpoint").during == "checkpoint"
    assert str(parse_injection("node:0@t=7")) == "node:0@t=7"
    assert parse_injection("node:1@t=1").shards(world_size=2, num_shards=5) == [1, 3]
    with pytest.raises(InjectionSpecError, match="during=PHASE is for shard kills"):
        parse_injection("trainer:0@during=eval")
    with pytest.raises(InjectionSpecError, match="during=checkpoint"):
        parse_injection("shard:0@during=lunch")


def test_a_priority_budget_beyond_the_trackers_capacity_is_refused_by_name():
    from recsys.config import ConfigError, RecoveryConfig

    with pytest.raises(ConfigError, match=r"priority_budget=9000: .*mfu_capacity \(8192\).*--mfu-capacity"):
        RecoveryConfig(recovery="partial-mfu", checkpoint_every=10, priority_budget=9000)
    with pytest.raises(ConfigError, match=r"priority_budget=200: .*ssu_capacity \(100\).*--ssu-capacity"):
        RecoveryConfig(recovery="partial-ssu", checkpoint_every=10, priority_budget=200, ssu_capacity=100)
    assert RecoveryConfig(recovery="partial-mfu", checkpoint_every=10, priority_budget=9000, mfu_capacity=9000)


def test_trainer_and_node_failures_without_restarts_are_refused_by_name():
    from recsys.config import ConfigError, RecoveryConfig

    for spec in ("trainer:1@step=5", "node:0@t=3"):
        with pytest.raises(ConfigError, match=rf"inject={spec!r}: a trainer failure needs --max-restarts >= 1"):
            RecoveryConfig(inject=[spec], max_restarts=0)
    assert RecoveryConfig(inject=["node:0@t=3"]).max_restarts > 0  # restarts are on by default


def test_mfu_sketch_finds_the_true_top_rows_of_a_zipf_stream():
    from recovery.saves.priority import SpaceSaving

    rng = np.random.default_rng(11)
    sketch = SpaceSaving(capacity=500)
    true = np.zeros(200_000, np.int64)
    for _ in range(300):  # steps: each updates a row at most once (unique ids), like a trainer's step
        ids = np.unique(np.minimum(rng.zipf(1.2, 2000) - 1, len(true) - 1))
        np.add.at(true, ids, 1)
        sketch.add(ids)
    assert len(sketch.keys) <= 2 * 500  # bounded memory, whatever the table's rows
    top_true = set(np.argsort(-true, kind="stable")[:100].tolist())
    keys, counts = sketch.top(100)
    assert len(set(keys.tolist()) & top_true) >= 95
    # counts over-estimate by at most the floor
    assert np.all(counts >= true[keys]) and np.all(counts - true[keys] <= sketch.floor)


def test_a_prepared_priority_save_picks_its_rows_on_the_writer_thread_and_saves_what_a_direct_one_does(rig, tmp_path):
    import threading

    from embeddings import rowkeys
    from recovery.saves.priority import MFUTracker, PrioritySaver

    sh, store, _, _ = rig
    rng = np.random.default_rng(8)
    savers = [PrioritySaver(tmp_path / f"p{i}", store, MFUTracker(store, 64), 40) for i in range(2)]
    for _ in range(30):  # Zipf-skewed updates of every table, the same stream for both savers
        keys = np.unique(
            np.concatenate(
                [
                    rowkeys.pack(t, np.minimum(rng.zipf(1.3, 80) - 1, spec.num_rows - 1))
                    for t, spec in enumerate(TABLES.specs)
                ]
            )
        )
        for sv in savers:
            sv.observe(keys, store.shard_map.shard_of_keys(keys))
    threads = []
    select = savers[0]._select
    savers[0]._select = lambda *a: (threads.append(threading.current_thread().name), select(*a))[1]
    savers[0].prepare()  # a step ahead of the save: merged and picked on the writer thread
    assert savers[0].save(5) == savers[1].save(5) == 40 * len(savers[1].saved_rows) > 0
    assert threads and all(name.startswith("priority") for name in threads)
    for s, rows in savers[1].saved_rows.items():
        mine = savers[0].saved_rows[s]
        assert [t for t, _ in mine] == [t for t, _ in rows]
        for (_, a), (_, b) in zip(mine, rows):
            np.testing.assert_array_equal(a, b)
    for sv in savers:
        sv.wait()
    for f in sorted((tmp_path / "p1").glob("shard*.bin")):
        assert (tmp_path / "p0" / f.name).read_bytes() == f.read_bytes()
    for sv in savers:
        sv.close()


def test_incremental_flushes_and_the_checkpoint_restore_rows_exactly_as_of_the_last_flush(rig, namespace, tmp_path):
    from recovery.saves.incremental import Flusher

    sh, store, ckpt, logs = rig
    store.hold_rows({0, 1, 2}, 1 << 30)  # the flush copies the rows its writer holds
    flusher = Flusher(tmp_path / "incr", store, {0, 1, 2})
    mgr = make_manager("incremental", store, sh, ckpt, {}, flusher=flusher)
    rng = np.random.default_rng(5)
    train_steps(mgr, store, 1, 3, rng)
    mgr.saves.on_checkpoint(3)
    ckpt.save(3, {"x": __import__("torch").zeros(1)}, {"step": 3, "namespace": namespace})
    ckpt.wait()
    train_steps(mgr, store, 4, 5, rng)
    assert mgr.saves.flush(5) > 0
    train_steps(mgr, store, 6, 8, rng)
    assert mgr.saves.flush(8) > 0
    with store.from_redis():
        at_flush = all_rows(store)
    train_steps(mgr, store, 9, 10, rng)
    before = all_rows(store)
    # an earlier run's flush of a later step, left in the folder: never overlaid
    stale = tmp_path / "incr" / "shard1" / "flush_0000000040.bin"
    flusher.writer.wait()  # flushes are written in the background: step 8's is on disk before it is copied
    stale.write_bytes((tmp_path / "incr" / "shard1" / "flush_0000000008.bin").read_bytes())
    sh.kill(1)
    mgr.guard(lambda: store.call(1, lambda c: c.ping()))  # held rows are read without Redis
    assert mgr.recover_outcome(mgr.detector.sync(), 11, "pull").to_step is None
    with store.from_redis():
        after = all_rows(store)
    for t in TABLES:
        m = shard_mask(store, t, 1)
        np.testing.assert_array_equal(after[t.name][m], at_flush[t.name][m])  # as of the flush, exactly
        np.testing.assert_array_equal(after[t.name][~m], before[t.name][~m])
        assert not np.array_equal(after[t.name][m], before[t.name][m])
    rec = mgr.failures[0]
    assert rec["restored_from_step"] == 3 and rec["flushed_to_step"] == 8
    # lost: exactly the shard's updates of steps 9 and 10
    assert rec["lost_updates"] == int((mgr.counter.total - mgr.counter.at_step[8])[1]) > 0
    assert store.applied_steps()[1] == 8
    # a flush is written once per dirty row: bytes per flush far below the updates it covers
    files = sorted((tmp_path / "incr" / "shard1").glob("flush_*.bin"))
    assert [int(f.stem.split("_")[1]) for f in files] == [5, 8, 40]
    mgr.fresh_start()  # a new run in the same folders: the earlier run's flushes go
    assert not list((tmp_path / "incr").glob("shard*/flush_*.bin"))
    mgr.close()


def test_priority_saves_of_later_steps_are_neither_overlaid_nor_kept(tmp_path):
    """A priority save from beyond the failure (an earlier run's, or of steps a restart took back) is
    not overlaid, and ``drop_after`` (fresh start, restart) removes it."""
    from recovery.durable import rowfiles
    from recovery.saves import priority

    d = tmp_path / "priority"
    d.mkdir()
    rows = np.ones((2, 9), np.float32)
    for shard, step in ((0, 30), (1, 12)):
        (d / f"shard{shard}.bin").write_bytes(rowfiles.encode(step, 5, [(0, np.array([1, 2]), rows)], [8]))

    class NoStore:  # an overlay that applies nothing never touches the store
        def write_shard(self, *a, **k):
            raise AssertionError("overlaid a save from beyond the failure")

        lay_rows = write_shard

    assert priority.overlay(d, NoStore(), 0, after_step=10, upto=20) == (0, 0, 10)
    assert priority.drop_after(d, 20) == 1
    assert sorted(p.name for p in d.iterdir()) == ["shard1.bin"]


def test_a_dense_save_becomes_the_state_only_once_committed_and_a_commit_drops_older_saves(tmp_path):
    """Per-step dense state: a save is a copy written to a temp file of its step at once; the file
    holds it only once its step is committed (its rows on the shards). A step never committed (its
    write failed and a rollback passed it) is dropped by a later commit, and never loaded."""
    from recovery.durable.dense import DenseSaver

    (tmp_path / "dense_latest.pt.9.tmp").write_bytes(b"left by a killed writer")
    saver = DenseSaver(tmp_path, "ns")
    assert not (tmp_path / "dense_latest.pt.9.tmp").exists()
    w = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    state = {
        "dense": {"model": {"w": w, "b": torch.tensor(1.5)}, "optim": {"state": {0: {"step": torch.tensor(3.0)}}}},
        "run": {"step": 1, "reader": {"position": 1024}, "pair": (1, 2), "ids": torch.arange(3)},
    }
    saver.save(1, lambda: state)
    w += 10  # the next step trains on: the save of step 1 holds the values it had
    saver.wait()
    assert saver.load() is None  # written, not committed: not the dense state yet
    saver.committer(1)()
    got = saver.load()
    assert got["step"] == 1 and torch.equal(got["dense"]["model"]["w"], torch.arange(6.0).reshape(2, 3))
    assert got["dense"]["model"]["b"].shape == () and float(got["dense"]["model"]["b"]) == 1.5
    assert got["run"]["pair"] == (1, 2) and torch.equal(got["run"]["ids"], torch.arange(3))
    assert float(got["dense"]["optim"]["state"][0]["step"]) == 3.0
    saver.save(2, lambda: state)  # step 2's rows never all reach their shards: never committed
    saver.save(3, lambda: state)
    assert saver.committer(4) is None  # no save of step 4
    saver.wait()
    assert saver.load()["step"] == 1 and (tmp_path / "dense_latest.pt.2.tmp").exists()
    saver.committer(3)()
    got = saver.load()
    assert got["step"] == 3 and torch.equal(got["dense"]["model"]["w"], w) and saver.num_saves == 2
    assert not list(tmp_path.glob("*.tmp")) and saver.committer(2) is None
    saver.save(4, lambda: state)
    saver.discard()  # the run ends with step 4 not committed
    assert saver.load()["step"] == 3 and not list(tmp_path.glob("*.tmp"))
    # the optimizer gains state: new dicts, whose layout is walked again (not the one kept from before)
    grown = {"model": state["dense"]["model"], "optim": {"state": {0: {"step": torch.tensor(4.0), "sum": w * 2}}}}
    saver.save(5, lambda: {**state, "dense": grown})
    saver.committer(5)()
    got = saver.load()["dense"]
    assert torch.equal(got["optim"]["state"][0]["sum"], w * 2) and float(got["optim"]["state"][0]["step"]) == 4.0
    assert torch.equal(got["model"]["w"], w)


def test_a_snapshot_of_another_shard_is_refused_in_one_line_and_no_checkpoint_kept(rig, namespace, tmp_path):
    """A setup where shard 1's snapshot file is shard 0's (two servers given one dump file): the
    checkpoint's identity check names the file, and the checkpoint gets no manifest. A kept one
    records what it checked; a restore refuses a snapshot that is not its shard's."""
    import dataclasses
    import shutil

    sh, store, _, _ = rig
    ids = np.arange(100)
    store.write_rows("a", ids, np.ones((100, 5), np.float32))  # rows on every shard
    lines: list[str] = []
    wrong = [sh.specs[0], dataclasses.replace(sh.specs[1], workdir=sh.specs[0].workdir), sh.specs[2]]
    bad = Checkpointer(tmp_path / "bad", 2, wrong, store, run=namespace, hooks=CheckpointHooks(warn=lines.append))
    bad.save(5, {"x": torch.zeros(1)}, {"step": 5, "namespace": namespace})
    bad.wait()
    assert bad.candidates() == [] and len(lines) == 1, lines
    assert lines[0].startswith("warning: checkpoint at step 5 abandoned: ") and "shard1.rdb" in lines[0], lines
    assert "is the snapshot of shard(s) [0]" in lines[0] and "not of shard 1" in lines[0], lines

    good = Checkpointer(tmp_path / "good", 2, sh.specs, store, run=namespace, hooks=CheckpointHooks(warn=lines.append))
    good.save(6, {"x": torch.zeros(1)}, {"step": 6, "namespace": namespace})
    good.wait()
    (c,) = good.candidates()
    assert c.identity["shard1.rdb"] == {"shard": 1, "namespace": namespace, "applied": None} and len(lines) == 1
    c.check_shard(1, namespace)
    # a manifest that recorded no identity (an older one): the file itself is read
    shutil.copy(c.shard_file(0), c.shard_file(1))
    c.identity.clear()
    with pytest.raises(CorruptCheckpointError, match=r"shard1.rdb is the snapshot of shard\(s\) \[0\]"):
        c.check_shard(1, namespace)
    c.check_shard(0, "another")  # no identity key of that namespace: an older checkpoint's file passes
    assert "holds no identity key of namespace 'another'" in snapshot_mismatch(c.shard_file(0), "another", 0)


def test_a_fresh_start_of_the_same_run_keeps_its_deaths_and_a_new_run_clears_them(tmp_path):
    from recovery.durable import layout
    from recovery.journal import Journal

    def run(run_id):
        layout.run_file(tmp_path).write_text(json.dumps({"namespace": "n", "run_id": run_id}))

    death = {"kind": "trainer", "rank": 1, "step": 22, "time": time.time() - 1.0}
    j = Journal(tmp_path, 0)
    assert not j.clear()  # no run.json: an earlier run's files go, nothing names the run
    run("A")
    assert not j.clear()  # the run's first fresh start names it
    layout.trainer_failures_file(tmp_path).write_text(json.dumps(death) + "\n")
    layout.failures_file(tmp_path).write_text(json.dumps({"kind": "shard", "target": 0, "step": 5}) + "\n")
    assert j.clear()  # the same run started again: its deaths stay, the attempt's other records go
    assert layout.trainer_failures_file(tmp_path).exists() and not layout.failures_file(tmp_path).exists()
    j.record_trainer_failures(0, time.time(), 0, 0)
    (f,) = j.failures
    assert (f["kind"], f["target"], f["step"], f["replayed_steps"], f["rejoin_step"]) == ("trainer", 1, 22, 22, 1)
    j.record_trainer_failures(0, time.time(), 0, 0)  # once only
    assert len(j.failures) == 1
    run("B")  # a new run in the folder: nothing of A's stays
    assert not j.clear() and not layout.trainer_failures_file(tmp_path).exists()
    assert json.loads(layout.journal_run_file(tmp_path).read_text())["run_id"] == "B"
