"""Runtime faults end in one clear line on the terminal, a non-zero exit status and no traceback;
the traceback goes to the run folder. Real processes: the CLI, real redis-servers, real files."""

import gzip
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from data.synthetic import SyntheticConfig, write_tsv
from embeddings import LocalShards
from embeddings.servers.launcher import free_port
from tests import procs
from tests.conftest import track, train_cli

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["--steps", "5", "--rows-per-table", "500", "--batch-size", "64", "--embedding-dim", "8"]
SMALL += ["--eval-every", "0", "--eval-samples", "512", "--trainers", "1"]
SMALL += ["--write-every", "1"]  # each step's rows on their shards: a fault is met at its own step


def cli(tmp_path: Path, *flags: str, timeout: float = 180) -> subprocess.CompletedProcess:
    return procs.run(["-m", "recsys", "train", *SMALL, "--out", str(tmp_path / "run"), *flags], timeout=timeout)


def one_error_line(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode != 0, proc.stdout[-2000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    lines = [x for x in proc.stderr.replace("\r", "\n").splitlines() if x.strip() and not x.startswith("train:")]
    assert len(lines) == 1, lines
    assert lines[0].startswith("error: ")
    return lines[0]


@pytest.fixture(scope="module")
def plain_shard():
    with LocalShards(1) as sh:
        track(sh)
        yield sh


def test_unreachable_redis_url_is_named_before_any_trainer_starts(tmp_path):
    port = free_port()
    line = one_error_line(cli(tmp_path, "--redis", f"redis://127.0.0.1:{port}"))
    assert f"shard 0 at redis://127.0.0.1:{port}" in line and "connection refused" in line
    assert "cannot restore" not in line  # not mistaken for a recovery failure


def test_wrong_password_is_named_as_such(tmp_path):
    with LocalShards(1, password="right-pw") as sh:
        track(sh)
        port = sh.ports[0]
        line = one_error_line(cli(tmp_path, "--redis", f"redis://:wrong-pw@127.0.0.1:{port}"))
    assert f"shard 0 at redis://127.0.0.1:{port}" in line and "rejected the credentials" in line
    assert "wrong-pw" not in line  # the password never reaches the terminal


def test_tls_spoken_to_a_plain_server_is_named_as_such(tmp_path, plain_shard):
    port = plain_shard.ports[0]
    line = one_error_line(cli(tmp_path, "--redis", f"rediss://127.0.0.1:{port}", "--timeout", "2"))
    assert f"shard 0 at rediss://127.0.0.1:{port}" in line and "TLS" in line and "redis://" in line


def test_a_truncated_gzip_file_names_the_file_and_the_line(tmp_path):
    tsv = tmp_path / "train.txt"
    write_tsv(SyntheticConfig(), tsv, 3000)
    gz = tmp_path / "train.txt.gz"
    with gzip.open(gz, "wb") as f:
        f.write(tsv.read_bytes())
    data = gz.read_bytes()
    gz.write_bytes(data[: len(data) // 2])  # a download cut short
    line = one_error_line(cli(tmp_path, "--data", f"criteo-kaggle:{gz}", "--embeddings", "local"))
    assert str(gz) in line and "truncated or damaged" in line and "after line" in line


def test_an_error_inside_a_trainer_process_is_one_line_with_the_traceback_kept(tmp_path):
    # every checkpoint corrupt, then a shard fails under full recovery: nothing to restore from
    proc = cli(
        tmp_path,
        "--trainers",
        "2",
        "--steps",
        "12",
        "--recovery",
        "full",
        "--checkpoint-every",
        "5",
        "--keep-checkpoints",
        "1",
        "--inject",
        "corrupt-checkpoint:latest",
        "--inject",
        "shard:1@step=8",
    )
    line = one_error_line(proc)
    assert "trainer0" in line and "recovery" in line and "no verified checkpoint" in line
    log = (tmp_path / "run" / "errors" / "trainer0.log").read_text()
    assert "Traceback" in log and "RecoveryError" in log


def test_a_trainer_killed_once_too_often_ends_in_one_line(tmp_path):
    proc = cli(
        tmp_path,
        "--trainer-recovery",
        "restart",
        "--trainers",
        "2",
        "--steps",
        "12",
        "--max-restarts",
        "1",
        "--inject",
        "trainer:1@step=4",
        "--inject",
        "trainer:0@step=8",
    )
    lines = [x for x in proc.stderr.replace("\r", "\n").splitlines() if x.strip() and not x.startswith("train:")]
    assert "Traceback" not in proc.stderr and proc.returncode == 1, proc.stderr[-3000:]
    assert lines[0] == "trainer rank 1 died (SIGKILL); restarting the trainer group (1/1)"  # progress, not an error
    # once the group trains again: what the death cost (every trainer waited; the steps redone)
    assert re.fullmatch(
        r"failure: trainer 1 at step 4: restart of the trainer group, every trainer waited [0-9.]+ s, "
        r"trained again from step [34] \([01] steps redone\), 0 samples lost",
        lines[1],
    ), lines
    assert lines[2:] == ["error: trainer rank 0 died (SIGKILL) after 1 restart(s) of 1 (all used)"]


def test_under_replace_a_trainer_killed_past_the_replacements_leaves_the_others_training(tmp_path):
    """--trainer-recovery replace, one replacement allowed, trainer 1 then trainer 0 killed: the
    first is replaced; past the replacements the survivor trains on alone (every chunk its own)
    and the run ends well, each death in its lines."""
    flags = ["--trainers", "2", "--steps", "12", "--max-restarts", "1"]
    proc = cli(tmp_path, *flags, "--inject", "trainer:1@step=4", "--inject", "trainer:0@step=8")
    lines = [x for x in proc.stderr.replace("\r", "\n").splitlines() if x.strip() and not x.startswith("train:")]
    assert "Traceback" not in proc.stderr and proc.returncode == 0, proc.stderr[-3000:]
    assert lines[0] == "trainer 1 died (SIGKILL); the others go on, its replacement starts (1/1)"
    assert re.fullmatch(
        r"failure: trainer 1 at step 4: the other trainers went on from step [34] after [0-9.]+ s "
        r"\([01] steps redone\), 0 samples lost; a replacement heals from them",
        lines[1],
    ), lines
    assert "trainer 0 died (SIGKILL); the others go on without it (1 replacement(s) used)" in lines
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["steps_completed"] == 12 and [f["target"] for f in summary["failures"]] == [1, 0]


def test_a_killed_shard_given_only_by_url_that_does_not_come_back_is_named(tmp_path):
    """No process id at hand: the kill goes as SHUTDOWN NOSAVE. Nothing restarts that server here, so
    after --shard-restart-timeout the run ends in one line naming shard, endpoint and the way back."""
    with LocalShards(2) as sh:
        track(sh)
        urls = ",".join(sh.urls)
        flags = ["--redis", urls, "--timeout", "1", "--max-restarts", "0", "--shard-restart-timeout", "1.5"]
        proc = cli(tmp_path, *flags, "--inject", "shard:1@step=3")
        line = one_error_line(proc)
        assert f"shard 1 at redis://127.0.0.1:{sh.ports[1]}" in line and "did not come back within 1.5s" in line
        assert f"--resume {tmp_path / 'run'}" in line
        assert sh.is_alive(0) and not sh.is_alive(1)


def test_a_stalled_shard_given_only_by_url_is_recovered_once_it_answers(tmp_path):
    """CLIENT PAUSE for 3 s: the shard is failed after --timeout, answers again, and is restored."""
    with LocalShards(2) as sh:
        track(sh)
        flags = ["--redis", ",".join(sh.urls), "--timeout", "1", "--max-restarts", "0"]
        s = train_cli(tmp_path / "run", *SMALL, *flags, "--inject", "stall:1@step=3:3")
        (f,) = s["failures"]
        assert f["target"] == 1 and f["kind"] == "stall" and f["recovery_s"] > 0
        assert s["steps_completed"] == 5 and sh.is_alive(1)


@pytest.mark.parametrize(
    "flags, named",
    [
        (["--target-pls", "1"], "--target-pls 1: must be in (0, 1)"),
        (["--mtbf", "0"], "--mtbf 0: must be > 0 steps"),
        (["--draws", "0"], "--draws 0: must be >= 1"),
        (["--sweep-strategies", "partial@100:x"], "--sweep-strategies 'partial@100:x': '100:x' must be"),
        (["--sweep-strategies", "partial,none"], "'none' cannot be swept"),
    ],
)
def test_a_bad_sweep_flag_is_named_before_any_run(tmp_path, flags, named):
    proc = procs.run(
        ["-m", "recsys", "bench-recovery", "--sweep", "--out", str(tmp_path / "sweep"), *flags], timeout=120
    )
    assert named in one_error_line(proc)
    assert not (tmp_path / "sweep" / "none-0").exists()


def test_a_refused_resume_is_decided_before_torch_is_imported(tmp_path):
    """In a fresh interpreter (not the tests' fork server, which imported torch): a resume of a
    folder that holds no run is refused before the import of torch (4 s here)."""
    code = (
        "import sys\nfrom recsys.cli import main\n"
        f"code = main(['train', '--resume', {str(tmp_path / 'none')!r}])\n"
        "print(code, 'torch' in sys.modules)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.stdout.split() == ["2", "False"], proc.stdout + proc.stderr[-2000:]
    assert "no config.toml there" in proc.stderr


def test_output_to_files_is_lines_not_a_redrawn_bar(tmp_path):
    """With no terminal (stdout and stderr are files here), progress is a plain line now and then:
    step, samples/s, loss and the last AUC; no line of carriage-return redraws."""
    flags = ["--steps", "200", "--eval-every", "100", "--write-every", "1", "--recovery", "log"]
    proc = cli(tmp_path, *flags, "--inject", "shard:1@step=50")
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = (proc.stdout + proc.stderr).split("\n")
    assert "\r" not in proc.stderr and max(len(x) for x in lines) < 2000
    shown = [x for x in proc.stderr.splitlines() if x.startswith("train: step ")]
    assert 10 <= len(shown) <= 12, shown  # a tenth of the work a line (and the end)
    assert shown[-1].startswith("train: step 200/200 (100%), samples/s ") and ", loss " in shown[-1]
    assert ", auc 0." in shown[-1]
    assert any(x.startswith("failure: shard 1 at step 50: log") for x in proc.stderr.splitlines())  # its own line
