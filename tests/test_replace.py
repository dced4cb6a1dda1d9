"""A trainer's death stops no one (``--trainer-recovery replace``): real trainer processes at a torchft
quorum (a real Lighthouse, managers and gloo groups), real redis-servers, real SIGKILLs. The
survivors go on at a new quorum training the dead trainer's chunks; only it starts again, healed
from a live peer; under ``log`` the run ends bit-identical to the run without the death."""

import json
import os

import pytest

from recsys.results.verify import verify
from tests.conftest import train_cli

FLAGS = [
    "--steps", "40", "--batch-size", "192", "--shards", "2", "--rows-per-table", "1000", "--eval-every", "0",
    "--recovery", "log", "--checkpoint-every", "10", "--no-keep-model", "--embedding-dim", "8",
    # rows written every step: a replacement joins without taking the others back (in windows, the
    # default, a join goes back to the dense state: tests/test_windows_groups.py)
    "--write-every", "1",
]  # fmt: skip
LONG = ["--steps", "200"]  # the last --steps wins: the survivor alone trains for seconds, not one


def _recovery_log(out) -> str:
    return (out / "recovery.log").read_text()


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict:
    """The same run without a death (trainers restarted as a group, had one died: nothing to do)."""
    return train_cli(tmp_path_factory.mktemp("ref") / "run", *FLAGS, "--trainers", "2", "--trainer-recovery", "restart")


@pytest.fixture(scope="module")
def long_reference(tmp_path_factory) -> dict:
    """``reference`` over ``LONG`` steps: time for a replacement that comes late to rejoin."""
    return train_cli(tmp_path_factory.mktemp("long") / "run", *FLAGS, *LONG, "--trainers", "2")


def test_a_trainer_death_costs_the_others_a_regroup_and_the_run_ends_bit_identical(tmp_path, long_reference):
    out = tmp_path / "run"
    # the replacement comes 2 s later: the survivor goes on alone, then the newcomer heals from it
    s = train_cli(
        out,
        *FLAGS,
        *LONG,
        "--trainers",
        "2",
        "--inject",
        "trainer:1@step=12",
        "--restart-delay",
        "2",
        "--quorum-every",
        "3",
    )
    assert s["embedding_digest"] == long_reference["embedding_digest"]
    assert s["final_auc"] == long_reference["final_auc"]
    (rec,) = s["failures"]
    assert rec["strategy"] == "replace" and rec["target"] == 1 and rec["step"] == 12
    assert rec["samples_lost"] == 0 and rec["lost_updates"] == 0
    # the survivor lost the death's detection (the Lighthouse's 1 s heartbeat timeout) and the
    # regroup, not a restart of every process
    assert 0 < rec["waited_s"] < 6, rec
    assert rec["resumed_step"] <= 12 < rec["rejoin_step"] <= 200
    assert rec["rejoin_step"] % 3 == 0  # a quorum every 3rd step (--quorum-every 3): it joined at one
    assert rec["healed_from"] == "peer" and rec["heal_s"] >= 0
    assert rec["dense_equal_at_rejoin"] is True  # the newcomer's dense state is its peer's, bit for bit
    # at the quorum it resumed at, rank 0 listed the rows on its shards (a row not there is not read)
    assert s["rows_listed_at_resume"]["shards"] and s["rows_listed_at_resume"]["rows"] > 0
    log = _recovery_log(out)
    # the discarded step's rows were written (the kill comes after the dead trainer's writes) and
    # taken back by their undo records before the step ran again
    assert "shard 0 at step 12, rolled back" in log and "shard 1 at step 12, rolled back" in log
    code, line = verify(out)
    assert code == 0, line


def test_the_replacement_joins_at_the_survivors_quorum_and_two_of_three_can_die(tmp_path, reference):
    flags = [*FLAGS, "--trainers", "3", "--batch-size", "192"]
    ref = train_cli(tmp_path / "ref", *flags, "--trainer-recovery", "restart")
    s = train_cli(tmp_path / "run", *flags, "--inject", "trainer:1@step=9", "--inject", "trainer:2@step=9")
    assert s["embedding_digest"] == ref["embedding_digest"]
    recs = {r["target"]: r for r in s["failures"]}
    assert sorted(recs) == [1, 2]
    assert all(r["strategy"] == "replace" and r["samples_lost"] == 0 for r in recs.values())
    assert all(r["rejoin_step"] is not None for r in recs.values())


def test_allreduce_under_replace_skips_the_dead_trainers_chunk_and_counts_it_lost(tmp_path, reference):
    """torchft's way (``--dense-reduce allreduce``): each trainer trains its own chunk, the gradients
    averaged over the quorum's: without a death, the chunk-order run's model within float error.
    At a death the survivor skips the dead trainer's chunk until its replacement rejoins; the run
    counts exactly those samples lost, and its rows still rebuild from its logs."""
    flags = [*FLAGS, "--trainers", "2", "--dense-reduce", "allreduce"]
    ref = train_cli(tmp_path / "ref", *flags)
    assert ref["failures"] == [] and ref["samples_trained"] == 40 * 192 and ref["pls"] == 0
    assert abs(ref["final_auc"] - reference["final_auc"]) < 0.002, (ref["final_auc"], reference["final_auc"])
    out = tmp_path / "run"
    s = train_cli(out, *flags, "--inject", "trainer:1@step=12", "--restart-delay", "2")
    (rec,) = s["failures"]
    assert rec["strategy"] == "replace" and rec["chunk_samples_skipped_per_step"] == 96, rec
    # the survivor trains alone from resumed_step until the replacement rejoins (or to the end)
    until = 41 if rec["rejoin_step"] is None else rec["rejoin_step"]
    assert rec["resumed_step"] <= 12 < until, rec
    assert rec["samples_lost"] == (until - rec["resumed_step"]) * 96 > 0, rec
    assert rec["rejoin_step"] is None or rec["dense_equal_at_rejoin"] is True
    assert s["samples_trained"] == 40 * 192 - rec["samples_lost"]
    assert s["pls"] == pytest.approx(rec["samples_lost"] / (40 * 192))
    # the samples skipped cost what they cost (here 15 steps of one chunk in 40 cost 0.004 AUC)
    assert abs(s["final_auc"] - ref["final_auc"]) < 0.02, (s["final_auc"], ref["final_auc"])
    assert s["embedding_digest"] != ref["embedding_digest"]  # fewer samples: not the same rows
    code, line = verify(out)
    assert code == 0, line


def test_a_trainers_absence_is_counted_once_however_many_records_it_left(tmp_path):
    """Skipped chunks (``--dense-reduce allreduce``): a replacement killed before it joined leaves a
    second record of one absence; the rejoin closes both and counts the absence once, from the first
    record's step. A trainer that never rejoined is counted to the run's end; one back in a later
    quorum without a join (a resumed run's first) closes its records there."""
    from recovery.journal import Journal

    j = Journal(tmp_path, rank=0)
    j.chunk_skipped = 96
    for target, resumed in ((1, 10), (1, 15), (2, 30), (3, 5)):
        j.record(
            {"kind": "trainer", "target": target, "strategy": "replace", "rejoin_step": None, "resumed_step": resumed}
        )
    j.note_rejoin(1, 20, 0.1, True, True)
    j.note_rejoin(3, 8)  # back at a resumed run's first quorum: from the dense state
    j.close_absences(40)
    lost = [(r["target"], r["samples_lost"], r["rejoin_step"]) for r in j.failures]
    assert lost == [(1, 10 * 96, 20), (1, 0, 20), (2, 11 * 96, None), (3, 3 * 96, 8)]
    on_disk = [json.loads(x) for x in (tmp_path / "failures.jsonl").read_text().splitlines()]
    assert [r["samples_lost"] for r in on_disk] == [960, 0, 1056, 288]
    assert not j.absent(1) and j.absent(2) and on_disk[3]["healed_from"] == "dense state"


def test_replace_settings_are_checked_in_one_line():
    from recsys.config import ConfigError, EmbeddingConfig, RecoveryConfig, RunConfig, TrainConfig

    with pytest.raises(ConfigError, match="replace needs --trainers 2 or more"):
        RunConfig(recovery=RecoveryConfig(trainer_recovery="replace"), train=TrainConfig(trainers=1))
    with pytest.raises(ConfigError, match="replace needs --trainers 2 or more on the Redis tier"):
        RunConfig(
            recovery=RecoveryConfig(trainer_recovery="replace"),
            embeddings=EmbeddingConfig(embeddings="local"),
            train=TrainConfig(trainers=2),
        )
    with pytest.raises(ConfigError, match="trainer_recovery='swap': must be auto, replace or restart"):
        RecoveryConfig(trainer_recovery="swap")
    with pytest.raises(ConfigError, match="restart_delay=-1"):
        RecoveryConfig(restart_delay=-1)
    with pytest.raises(ConfigError, match="quorum_every=0: must be >= 1"):
        RecoveryConfig(quorum_every=0)
    assert RunConfig(train=TrainConfig(trainers=2)).replaces_trainers
    assert not RunConfig(train=TrainConfig(trainers=1)).replaces_trainers
    assert RunConfig(train=TrainConfig(trainers=2, dense_reduce="allreduce")).replaces_trainers


def test_the_failure_line_says_the_others_went_on():
    from recovery.journal import failure_line

    line = failure_line(
        {"kind": "trainer", "target": 1, "step": 12, "strategy": "replace", "waited_s": 1.3, "resumed_step": 12}
    )
    assert "trainer 1 at step 12: the other trainers went on from step 12 after 1.30 s" in line
    assert json.dumps(line)


def test_trainers_launched_as_separate_commands_meet_at_a_lighthouse_and_one_run_again_rejoins(tmp_path, reference):
    """Two commands, one trainer each (``--trainer-index``), on shards given by URL and a Lighthouse
    that runs already (``--lighthouse``), as on two machines. Trainer 1 dies at step 12; its
    scheduler (here, the test) runs the same command again: it joins the survivor's quorum, heals
    from it, and the run ends bit-identical to the run launched as one."""
    from embeddings import LocalShards
    from recsys.quorum.replica import Lighthouse
    from tests import procs
    from tests.conftest import track

    out = tmp_path / "run"
    with LocalShards(2) as sh:
        track(sh)
        lighthouse = Lighthouse(tmp_path / "lighthouse.log")
        try:
            common = ["-m", "recsys", "train", *FLAGS, "--trainers", "2", "--redis", ",".join(sh.urls)]
            common += ["--namespace", "separate", "--lighthouse", lighthouse.address, "--out", str(out)]
            first = procs.start([*common, "--trainer-index", "0"])
            second = procs.start([*common, "--trainer-index", "1", "--inject", "trainer:1@step=12"])
            assert second.wait(timeout=240) == -9, second.stderr.read()[-2000:]  # SIGKILL: it killed itself
            again = procs.start([*common, "--trainer-index", "1", "--inject", "trainer:1@step=12"])
            assert first.wait(timeout=240) == 0, first.stderr.read()[-3000:]
            assert again.wait(timeout=240) == 0, again.stderr.read()[-3000:]
            assert "Traceback" not in first.stderr.read() + again.stderr.read()
        finally:
            lighthouse.close()
    s = json.loads((out / "summary.json").read_text())
    assert s["embedding_digest"] == reference["embedding_digest"]
    (rec,) = s["failures"]
    assert rec["strategy"] == "replace" and rec["target"] == 1 and rec["rejoin_step"] is not None, rec
    assert rec["dense_equal_at_rejoin"] is True
    code, line = verify(out)
    assert code == 0, line


@pytest.mark.parametrize(
    "mix",
    [
        ["--inject", "shard:0@during=resume"],  # a shard dies while the trainers regroup and one heals
        ["--inject", "trainer:1@during=resume"],  # the replacement dies while it heals
    ],
    ids=["shard-dies-while-healing", "replacement-dies-while-healing"],
)
def test_a_second_failure_while_a_trainer_heals_still_ends_bit_identical(tmp_path, reference, mix):
    out = tmp_path / "run"
    s = train_cli(out, *FLAGS, "--trainers", "2", "--inject", "trainer:1@step=8", *mix)
    assert s["injections_not_fired"] == [], s["injected"]
    assert s["embedding_digest"] == reference["embedding_digest"], json.dumps(s["failures"])
    assert s["pls"] == 0.0 and all(f.get("lost_updates", 0) == 0 for f in s["failures"])
    assert [f["target"] for f in s["failures"] if f["kind"] == "trainer"][:1] == [1]
    code, line = verify(out)
    assert code == 0, line


def test_the_lighthouse_dying_stops_the_run_in_one_line_and_resume_finishes_it_bit_identical(tmp_path, reference):
    from tests import procs

    out = tmp_path / "run"
    args = ["-m", "recsys", "train", *FLAGS, "--trainers", "2", "--inject", "lighthouse@step=20", "--out", str(out)]
    proc = procs.run(args, timeout=240)
    lines = [x for x in proc.stderr.replace("\r", "\n").splitlines() if x.strip() and not x.startswith("train:")]
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert len(lines) == 1 and lines[0].startswith("error: the Lighthouse at 127.0.0.1:"), lines
    assert f"finish the run with --resume {out}" in lines[0]
    s = train_cli(out, "--resume", str(out))
    assert s["embedding_digest"] == reference["embedding_digest"]


def test_trainers_that_disagree_on_quorum_every_stop_at_their_first_quorum_in_one_line():
    """Trainers launched as separate commands each read ``--quorum-every`` and ``--row-exchange`` from
    their own command line: members that would meet at different steps, or exchange the rows in
    different collectives, are stopped at the quorum's first collective."""
    import numpy as np

    from recsys.config import RecoveryConfig, RunConfig, TrainConfig
    from recsys.quorum.regroup import agree
    from recsys.quorum.replica import Quorum

    class Quorum2:  # the quorum's MAX over two trainers: this one's vector and the other's
        def __init__(self, other=None, scatters: bool = False) -> None:
            self.other, self.sent, self.scatters = other, None, scatters

        def max_flags(self, v):
            self.sent = v.copy()
            return v if self.other is None else np.maximum(v, self.other)

    def cfg(k: int) -> RunConfig:
        return RunConfig(train=TrainConfig(trainers=2), recovery=RecoveryConfig(quorum_every=k))

    q = Quorum(7, (0, 1), 1, None, 0.0)
    theirs = Quorum2()
    agree(theirs, cfg(8), 0, (0, 1), q, True, False)
    same = agree(Quorum2(theirs.sent), cfg(8), 1, (0, 1), q, True, False)
    assert same[:7].tolist() == [0] * 7  # nobody left or joined, every member holds a state
    assert same[7:].tolist() == [os.getpid()] * 2  # each member's process (both of them here)
    with pytest.raises(RuntimeError, match=r"quorum 7 disagree on --quorum-every \(4 here; from 4 to 8\)"):
        agree(Quorum2(theirs.sent), cfg(4), 1, (0, 1), q, True, False)
    with pytest.raises(RuntimeError, match=r"quorum 7 disagree on --row-exchange \(here the rows are scattered\)"):
        agree(Quorum2(theirs.sent, scatters=True), cfg(8), 1, (0, 1), q, True, False)


def test_the_steps_between_quorums_commit_as_torchfts_should_commit_would_for_one_trainer():
    """A quorum step asks torchft's ``should_commit``; a step between decides the same thing in the
    trainer: committed only where the process group and the manager hold no error and the quorum
    has a member (a replica group of one trainer: what ``should_commit`` returns)."""
    from types import SimpleNamespace

    from recsys.quorum.replica import Replica

    calls = []
    state = {"pg": None, "manager": None, "members": 2, "torchft": True}
    replica = object.__new__(Replica)  # its decision alone: no manager started
    replica.pg = SimpleNamespace(errored=lambda: state["pg"])
    replica.manager = SimpleNamespace(
        errored=lambda: state["manager"],
        num_participants=lambda: state["members"],
        should_commit=lambda: calls.append("should_commit") or state["torchft"],
    )
    assert replica.commit(quorum_step=False) is True and calls == []  # no round trip between quorums
    state["torchft"] = False
    assert replica.commit(quorum_step=True) is False and calls == ["should_commit"]
    for key, bad in (("pg", RuntimeError("gloo")), ("manager", RuntimeError("quorum")), ("members", 0)):
        saved, state[key] = state[key], bad
        assert replica.commit(quorum_step=False) is False, key
        state[key] = saved
    assert replica.commit(quorum_step=False) is True and calls == ["should_commit"]
