import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import redis

from embeddings.servers.launcher import LauncherError, LocalShards, ServerOptions, process_state
from tests.conftest import _pid_alive, track


def test_start_stop_and_failures_act_on_real_processes():
    with LocalShards(2, nice=10) as sh:
        track(sh)
        pids = sh.pids
        assert len(pids) == 2 and all(_pid_alive(p) for p in pids)
        # --server-nice 10: the servers run nicer than this process (its training thread goes first)
        mine = os.getpriority(os.PRIO_PROCESS, 0)
        assert [os.getpriority(os.PRIO_PROCESS, p) for p in pids] == [min(19, mine + 10)] * 2
        c = redis.Redis.from_url(sh.url(1), socket_timeout=0.3)
        c.set("k", "v")
        # bound to loopback only
        assert c.config_get("bind")["bind"] == "127.0.0.1"
        assert c.config_get("save")["save"] == ""
        sh.stall(1)
        assert process_state(pids[1]) == "T"  # stopped
        with pytest.raises(redis.TimeoutError):
            c.get("k")
        sh.resume(1)
        c = redis.Redis.from_url(sh.url(1), socket_timeout=2)
        assert c.get("k") == b"v"
        port = sh.ports[1]
        sh.kill(1)
        assert not _pid_alive(pids[1]) and not sh.is_alive(1)
        sh.restart(1)
        track(sh)
        assert sh.ports[1] == port and sh.is_alive(1)
        assert os.getpriority(os.PRIO_PROCESS, sh.pids[1]) == min(19, mine + 10)  # a restart too
        assert c.get("k") is None  # a restarted shard starts empty
        sh.stall(0)  # a stalled shard must still be stopped on exit
    assert not any(_pid_alive(p) for p in pids + sh.pids)


def test_shards_die_with_a_killed_owner_process(tmp_path):
    script = textwrap.dedent(
        """
        import sys, time
        from embeddings.servers.launcher import LocalShards
        sh = LocalShards(2).start()
        print(" ".join(map(str, sh.pids)), flush=True)
        time.sleep(60)
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, cwd=os.getcwd())
    try:
        pids = [int(p) for p in proc.stdout.readline().split()]
        assert len(pids) == 2 and all(_pid_alive(p) for p in pids)
        proc.send_signal(signal.SIGKILL)  # no atexit, no finally: only PDEATHSIG can clean up
        proc.wait(timeout=10)
        deadline = time.monotonic() + 5
        while any(_pid_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(_pid_alive(p) for p in pids)
    finally:
        proc.kill()
        proc.wait()


def test_missing_binary_is_a_clear_error():
    with pytest.raises(LauncherError, match="redis-server not found.*/nonexistent/redis-server"):
        LocalShards(1, server=ServerOptions(redis_server="/nonexistent/redis-server"))
    with pytest.raises(ValueError, match="num_shards=0"):
        LocalShards(0)


def test_trainers_are_forked_only_while_no_tensor_op_has_run_in_parallel():
    """A process with an OpenMP pool cannot fork a trainer (its first parallel op would hang): the
    launcher forks from a process that first imported torch through it and ran nothing since, and
    spawns otherwise."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    fresh = textwrap.dedent(
        """
        import recsys.launch as launch
        import torch
        before = launch.start_method()
        torch.set_num_threads(2)
        x = torch.randn(512, 512)
        (x @ x).sum()
        torch.randn(1 << 20).exp_().sum()
        print(before, launch.start_method())
        """
    )
    loaded = "import torch\nimport recsys.launch as launch\nprint(launch.start_method())"
    outs = [
        subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=120)
        for code in (fresh, loaded)
    ]
    assert [o.stdout.split() for o in outs] == [["fork", "spawn"], ["spawn"]], [o.stderr[-2000:] for o in outs]


def test_servers_run_at_their_trainers_priority_unless_told_and_a_bad_nice_is_named():
    """By default a server shares the cores as its trainers do: a niced server lags behind a busy
    host's work (its windows' writes, its checkpoints' saves). ``--server-nice`` outside 0..19 is one line."""
    with LocalShards(1) as sh:
        track(sh)
        assert os.getpriority(os.PRIO_PROCESS, sh.pids[0]) == os.getpriority(os.PRIO_PROCESS, 0)
    with pytest.raises(ValueError, match="nice=20 must be in 0..19"):
        LocalShards(1, nice=20)
    proc = subprocess.run(
        [sys.executable, "-m", "recsys", "train", "--server-nice", "20", "--steps", "1", "--out", "/nonexistent/x"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and proc.stderr.strip() == "error: config: server_nice=20: must be in 0..19", (
        proc.stderr
    )


def _huge_kb(pid: int) -> int:
    for line in open(f"/proc/{pid}/smaps_rollup"):
        if line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    return 0


def _fill(client) -> None:
    for lo in range(0, 300_000, 10_000):  # ~60 MB of 68-byte rows
        client.mset({b"k%d" % i: b"x" * 68 for i in range(lo, lo + 10_000)})


def test_huge_pages_reach_the_server_and_its_allocator():
    thp = open("/sys/kernel/mm/transparent_hugepage/enabled").read()
    with LocalShards(1, huge_pages=True) as sh:
        client = redis.Redis.from_url(sh.urls[0])
        assert client.config_get("disable-thp") == {"disable-thp": "no"}
        _fill(client)
        if "[never]" not in thp:  # the host grants them: the key space is in 2 MB pages
            assert _huge_kb(sh.pid(0)) >= 16 * 1024
        client.close()
    with LocalShards(1) as sh:  # off by default: the server turns THP off for itself
        client = redis.Redis.from_url(sh.urls[0])
        assert client.config_get("disable-thp") == {"disable-thp": "yes"}
        _fill(client)
        assert _huge_kb(sh.pid(0)) == 0
        client.close()
