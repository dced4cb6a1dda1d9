"""The commit protocol in milliseconds: ranks as threads of one process, a collective that meets
their calls, and a sharded stand-in for the store, so that verdicts, retries, rollbacks, fatal
paths and a shard dying during another's restore are tested beside the real-process runs.

The recovery parts are the real ones (``RecoveryManager``, ``CommitPoints``, ``Verdict``,
``ShardByShard``); only the restore itself (a server replaced, a file loaded) is scripted."""

from __future__ import annotations

import inspect
import threading

import numpy as np
import pytest

from embeddings import ShardUnavailableError
from recovery.errors import RecoveryError
from recovery.interface import NoRecovery, Recovery
from recovery.manager import RecoveryManager
from recovery.protocol import MAX_ATTEMPTS, Action, Collective, Verdict
from recovery.restore.strategies import Restorer, ShardByShard


class ThreadCollective:
    """Collectives among ``world`` threads: each call meets the other ranks' calls of it."""

    def __init__(self, world: int) -> None:
        self.world = world
        self.bar = threading.Barrier(world, timeout=10)
        self.slots: list = [None] * world

    def _meet(self, rank: int, value, reduce):
        self.slots[rank] = value
        self.bar.wait()
        out = reduce(self.slots)
        self.bar.wait()  # nobody writes its next value before everyone read this one
        return out

    def of(self, rank: int) -> Collective:
        return Collective(
            world_size=self.world,
            barrier=lambda: self.bar.wait(),
            max_flags=lambda a: self._meet(rank, np.asarray(a).copy(), lambda xs: np.maximum.reduce(xs)),
            broadcast_int=lambda v: self._meet(rank, v, lambda xs: xs[0]),
            sum_floats=lambda a: self._meet(rank, np.asarray(a).copy(), lambda xs: np.sum(xs, axis=0)),
        )


class ShardedStandIn:
    """What the protocol asks of a store after a recovery, recorded; ``touch`` fails a shard in
    ``down`` (one set for every rank: a shard is down for all)."""

    def __init__(self, num_shards: int, down: set) -> None:
        self.num_shards, self.row_cache, self.down = num_shards, None, down
        self.calls: list[tuple] = []
        self.stopped_learning = 0  # recoveries that voided a resumed trainer's listing of its shards

    def touch(self, shard: int) -> None:
        if shard in self.down:
            raise ShardUnavailableError(shard, f"127.0.0.1:{7000 + shard}", "connection refused")

    def stop_learning(self) -> None:
        self.stopped_learning += 1

    def reconnect(self, s: int) -> None:
        self.calls.append(("reconnect", s))

    def failover(self, s: int) -> None:
        self.calls.append(("failover", s))

    def reinstate_held(self, s: int) -> None:
        self.calls.append(("reinstate", s))

    def reload_held(self, s: int, base, newest, overlay) -> None:
        self.calls.append(("reload", s, base, newest))


class Scripted(Restorer):
    """Rank 0's restore, scripted: ``verdict(failed, step)`` or an exception; the shards are up
    again (unless ``revive`` is False)."""

    def __init__(self, verdict, down: set, revive: bool = True) -> None:
        self.verdict, self.down, self.revive, self.seen = verdict, down, revive, []

    def recover(self, failed, step, phase):
        self.seen.append((list(failed), step, phase))
        if self.revive:
            self.down.difference_update(failed)
        return self.verdict(failed, step)


def managers(world: int, num_shards: int = 4, strategy: str = "partial"):
    coll, down = ThreadCollective(world), set()
    out = []
    for rank in range(world):
        store = ShardedStandIn(num_shards, down)
        out.append(RecoveryManager(strategy, store, [], rank, 8, coll.of(rank)))
    return out


def on_ranks(mgrs, fn) -> list:
    """``fn(rank, mgr)`` on one thread per rank; -> each rank's result or exception."""
    results: list = [None] * len(mgrs)

    def run(rank: int) -> None:
        try:
            results[rank] = fn(rank, mgrs[rank])
        except Exception as e:  # noqa: BLE001 - returned for the test to assert on
            results[rank] = e

    threads = [threading.Thread(target=run, args=(r,)) for r in range(len(mgrs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads), "a rank hung"
    return results


def test_verdict_encoding_round_trips_and_merges_by_max():
    v = Verdict(rollback=None, as_of={0: -1, 2: 7}, redo={2}, restored={0: (-1, -1), 2: (5, 7)})
    a = v.encode(4)
    assert (a >= 0).all()
    assert Verdict.decode(np.maximum(a, np.zeros_like(a)), 4) == v
    r = Verdict.decode(Verdict(rollback=0, as_of={0: 0, 1: 0}, redo={0, 1}).encode(2), 2)
    assert r.rollback == 0 and r.outcome().action is Action.ROLLBACK and r.outcome().to_step == 0
    assert Verdict.decode(Verdict(fatal=True).encode(3), 3).fatal


def test_a_failure_one_rank_saw_is_recovered_by_all_and_the_phase_redone_there():
    mgrs = managers(3)
    down = mgrs[0].store.down
    script = Scripted(lambda failed, step: Verdict(as_of={s: step - 1 for s in failed}, redo=set(failed)), down)
    mgrs[0].restorer = script
    attempts: dict[int, list] = {r: [] for r in range(3)}
    down.add(1)

    def phase(rank, mgr):
        def fn(only):
            attempts[rank].append(only)
            if rank == 2:  # the only rank whose rows are on shard 1
                mgr.store.touch(1)

        return mgr.run_phase(10, "stage", fn)

    outs = on_ranks(mgrs, phase)
    assert all(o.action is Action.CONTINUE for o in outs)
    assert script.seen == [([1], 10, "stage")]
    assert all(attempts[r] == [None, (1,)] for r in range(3))
    for m in mgrs:  # every rank reconnected to the recovered shard and read its held rows back
        assert ("reconnect", 1) in m.store.calls and any(c[0] == "reload" and c[1] == 1 for c in m.store.calls)
        # and, first, voided what a listing of its shards would learn (rank 0 restores shards others list)
        assert m.store.stopped_learning == 1


def test_a_restore_as_of_the_phase_is_not_redone():
    mgrs = managers(2)
    down = mgrs[0].store.down
    mgrs[0].restorer = Scripted(lambda failed, step: Verdict(as_of={s: step for s in failed}), down)
    calls = {0: [], 1: []}
    down.add(3)

    def phase(rank, mgr):
        def fn(only):
            calls[rank].append(only)
            if rank == 0:
                mgr.store.touch(3)

        return mgr.run_phase(5, "update", fn)

    outs = on_ranks(mgrs, phase)
    assert [o.action for o in outs] == [Action.CONTINUE] * 2
    assert calls == {0: [None, ()], 1: [None, ()]}  # retried with nothing to redo


def test_a_rollback_reaches_every_rank_with_the_totals_of_its_step():
    mgrs = managers(3)
    mgrs[0].restorer = Scripted(
        lambda failed, step: Verdict(rollback=4, as_of=dict.fromkeys(range(4), 4)), mgrs[0].store.down
    )
    for m in mgrs:
        m.counter.add(np.array([1, 2, 3, 4]))
        m.counter.mark(4)
        m.counter.add(np.array([5, 5, 5, 5]))
    mgrs[1].store.down.add(0)

    outs = on_ranks(mgrs, lambda rank, m: m.run_phase(9, "update", lambda only: rank == 1 and m.store.touch(0)))
    assert all(o.rolled_back and o.to_step == 4 and o.recovered == (0, 1, 2, 3) for o in outs)
    assert all(m.counter.total.tolist() == [1, 2, 3, 4] for m in mgrs)
    for m in mgrs:  # every shard was restored from the checkpoint: every rank reconnects to all
        assert sorted(c[1] for c in m.store.calls if c[0] == "reconnect") == [0, 1, 2, 3]


def test_a_failed_restore_on_rank_0_ends_the_run_on_every_rank():
    mgrs = managers(3)

    def boom(failed, step):
        raise RecoveryError("no verified checkpoint in /ckpt")

    mgrs[0].restorer = Scripted(boom, mgrs[0].store.down)
    mgrs[2].store.down.add(2)
    outs = on_ranks(mgrs, lambda rank, m: m.run_phase(3, "eval", lambda only: rank == 2 and m.store.touch(2)))
    assert str(outs[0]) == "no verified checkpoint in /ckpt"
    for o in outs[1:]:
        assert isinstance(o, RecoveryError) and "failed on rank 0" in str(o) and "[2]" in str(o)


def test_a_shard_that_keeps_failing_ends_the_phase_after_max_attempts():
    mgrs = managers(2)
    down = mgrs[0].store.down
    # the replacement dies at once each time
    script = Scripted(lambda failed, step: Verdict(as_of={s: step - 1 for s in failed}, redo=set(failed)), down, False)
    mgrs[0].restorer = script
    down.add(0)
    outs = on_ranks(mgrs, lambda rank, m: m.run_phase(7, "update", lambda only: m.store.touch(0)))
    for o in outs:
        assert isinstance(o, RecoveryError) and f"after {MAX_ATTEMPTS} recoveries" in str(o)
    assert len(script.seen) == MAX_ATTEMPTS


def test_a_shard_dying_during_another_restore_is_recovered_in_the_same_round():
    mgrs = managers(2)
    order = []

    class DiesDuring(ShardByShard):
        def restore(self, shard, step):
            order.append(shard)
            if shard == 0 and order.count(0) == 1:
                raise ShardUnavailableError(2, "127.0.0.1:7002", "connection reset")
            rec = self.shard_restore.base_record("shard", shard, step)
            rec["restored_from_step"] = 3
            from recovery.restore.strategies import Restored

            return Restored(rec, 3, 3, 3)

    m0 = mgrs[0]
    m0.restorer = DiesDuring(m0.shard_restore, m0.ledger, m0.writer, m0.journal)
    mgrs[1].store.down.add(0)
    outs = on_ranks(mgrs, lambda rank, m: m.commit(6, "stage") if rank == 0 else _fail_then_commit(m, 0, 6))
    assert order == [0, 2, 0]  # the dying shard joined the round, the interrupted one was redone
    for o in outs:
        assert o.action is Action.RETRY and o.recovered == (0, 2) and o.redo == (0, 2)
    assert sorted(f["target"] for f in m0.failures) == [0, 2]


def _fail_then_commit(m, shard, step):
    m.guard(lambda: m.store.touch(shard))
    return m.commit(step, "stage")


def test_the_manager_and_the_local_baseline_meet_one_protocol():
    for impl in (RecoveryManager, NoRecovery):
        for name, member in inspect.getmembers(Recovery):
            if name.startswith("_"):
                continue
            assert hasattr(impl, name), f"{impl.__name__} lacks {name}"
            if inspect.isfunction(member):
                want = list(inspect.signature(member).parameters)
                got = list(inspect.signature(getattr(impl, name)).parameters)
                assert got == want, f"{impl.__name__}.{name}{got} != {want}"


def test_the_local_baseline_runs_a_phase_once_and_never_recovers():
    nr = NoRecovery()
    seen = []
    assert nr.run_phase(1, "stage", seen.append).action is Action.CONTINUE and seen == [None]
    assert nr.guard(lambda: 5) == (True, 5) and nr.window_steps == 1 and nr.failures == []
    with pytest.raises(TypeError):
        nr.apply({}, 1)
