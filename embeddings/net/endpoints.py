"""Check ``--redis`` endpoints before any trainer starts: connect, TLS, credentials, a PING, the
commands the run will send (ACL) and an eviction policy that keeps its rows.

Each problem is named as what it is, with the shard and its endpoint (password removed):
nothing listens there, the host does not resolve, TLS spoken to a plain server (or the other way
round), a certificate that is not trusted, a wrong password or ACL user, an ACL user that may not
run a command the run needs there (with the rule to add), a ``maxmemory-policy`` that evicts keys
without a TTL (with the fix).
"""

from __future__ import annotations

import socket
import ssl
from collections.abc import Sequence
from dataclasses import dataclass
from urllib.parse import urlsplit

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from embeddings.errors import EndpointError


def one_try() -> Retry:
    """A redis-py client's retry policy for calls that must not be redone behind the caller's back:
    redis-py's default retries a failed call with backoff, seconds in all, and the caller (the
    recovery layer, a readiness poll, an endpoint check, an injected SHUTDOWN) decides what follows."""
    return Retry(NoBackoff(), 0)


def redact(url: str) -> str:
    """``scheme://[user@]host:port/db`` with any password removed, for messages and logs."""
    parts = urlsplit(url)
    user = f"{parts.username}@" if parts.username and parts.username != "default" else ""
    path = parts.path if parts.path not in ("", "/") else ""
    return f"{parts.scheme}://{user}{parts.hostname}:{parts.port or 6379}{path}"


def _cause(e: BaseException) -> BaseException:
    while e.__context__ is not None and not isinstance(e, (ssl.SSLError, OSError)):
        e = e.__context__
    return e


def diagnose(url: str, e: BaseException, timeout_s: float) -> str:
    """Why ``url`` did not answer a PING, in words."""
    tls = urlsplit(url).scheme == "rediss"
    text = f"{e} {_cause(e)}".lower()
    if isinstance(e, redis.AuthenticationError) or any(w in text for w in ("wrongpass", "noauth", "invalid password")):
        return "rejected the credentials: check the password (and ACL user) in the URL"
    if tls and any(w in text for w in ("wrong version number", "record layer", "unexpected eof", "packet length")):
        return "TLS handshake failed: the server does not speak TLS there (use redis:// for a plain server)"
    if tls and ("certificate" in text or "verify failed" in text):
        return f"TLS handshake failed: the server's certificate is not trusted ({_cause(e)})"
    if tls and isinstance(e, redis.TimeoutError):
        return f"no TLS handshake within {timeout_s:g}s: is the server speaking TLS on this port?"
    if not tls and any(w in text for w in ("closed by server", "connection reset", "error while reading")):
        return "the server closed the connection: if it only speaks TLS, use rediss://"
    if "name or service not known" in text or "nodename nor servname" in text or "temporary failure in name" in text:
        return f"cannot resolve host {urlsplit(url).hostname!r}"
    if "connection refused" in text:
        return "connection refused: no Redis server listens there"
    if isinstance(e, redis.TimeoutError):
        return f"no answer within {timeout_s:g}s"
    return f"{type(_cause(e)).__name__}: {_cause(e)}"


def check_endpoints(
    urls: Sequence[str],
    timeout_s: float = 5.0,
    connection_kwargs: dict | None = None,
    needs: Sequence[Sequence[Need]] | None = None,
) -> None:
    """PING every URL once; with ``needs`` (per URL, see ``commands_needed``) check that its ACL user
    may run them; refuse a server whose ``maxmemory-policy`` can evict the run's rows (``EVICTING``).
    Raise ``EndpointError`` naming the first shard that cannot serve, in one line."""
    for shard, url in enumerate(urls):
        kwargs = {"retry": one_try(), **(connection_kwargs or {})}  # one try: the error is the answer
        client = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s, **kwargs)
        try:
            client.ping()
            missing = missing_commands(client, urlsplit(url).username or "default", needs[shard]) if needs else []
            if missing:
                raise EndpointError(describe_missing(shard, url, missing))
            try:
                problem = policy_problem(server_state(client)["maxmemory_policy"])
            except redis.ResponseError as e:
                problem = str(e).removeprefix("NOPERM ")
            if problem:
                raise EndpointError(f"shard {shard} at {redact(url)}: {problem}")
        except (redis.RedisError, OSError) as e:
            why = diagnose(url, e, timeout_s)
            if urlsplit(url).scheme == "rediss" and _speaks_plain(url, timeout_s):
                why = "the server speaks plain Redis, not TLS: use redis:// (or enable TLS on the server)"
            raise EndpointError(f"shard {shard} at {redact(url)}: {why}") from None
        finally:
            client.close()


def _speaks_plain(url: str, timeout_s: float) -> bool:
    """Does a plain (non-TLS) connection to the same host and port get a Redis answer?"""
    parts = urlsplit(url)
    try:
        with socket.create_connection((parts.hostname, parts.port or 6379), timeout=min(timeout_s, 2.0)) as sock:
            sock.sendall(b"PING\r\n")
            reply = sock.recv(64)
    except OSError:
        return False
    return reply.startswith((b"+PONG", b"-NOAUTH", b"-ERR"))


# -- what a server must allow: an eviction policy that keeps the rows, the commands a run sends ------

EVICTING = ("allkeys-lru", "allkeys-lfu", "allkeys-random")
"""``maxmemory-policy`` values that evict keys without a TTL: a run's rows, once evicted, read back as
never written and are silently initialised again. The other policies are fine: ``noeviction`` evicts
nothing (a full server answers OOM, which stops the run with its own line), and ``volatile-*`` evict
only keys with a TTL, which no key of a run ever has (rows, applied markers, undo records). Refused
whatever ``maxmemory`` is now: it can be set at any moment (``CONFIG SET maxmemory``)."""

POLICY_FIX = "CONFIG SET maxmemory-policy noeviction"


def server_state(client: redis.Redis) -> dict:
    """``maxmemory_policy``, ``evicted_keys`` and ``run_id`` of the server behind ``client``, from
    ``INFO``. Where ACL refuses INFO, the policy comes from ``CONFIG GET`` (``evicted_keys`` None,
    ``run_id`` empty); raises ``redis.ResponseError`` (NOPERM) when neither is allowed."""
    try:
        try:
            info = client.info("server", "memory", "stats")
        except redis.ResponseError as e:
            if _denied(str(e)):
                raise
            info = {}  # a server that takes one INFO section at a time (Redis < 7)
            for section in ("server", "memory", "stats"):
                info.update(client.info(section))
        return {
            "maxmemory_policy": str(info.get("maxmemory_policy", "noeviction")),
            "evicted_keys": int(info.get("evicted_keys", 0)),
            "run_id": str(info.get("run_id", "")),
        }
    except redis.ResponseError as e:
        if not _denied(str(e)):
            raise
    try:
        got = client.config_get("maxmemory-policy")
    except redis.ResponseError as e:
        if not _denied(str(e)):
            raise
        raise redis.ResponseError(
            "NOPERM the ACL user may run neither INFO nor CONFIG GET, so the server's maxmemory-policy cannot "
            "be read: add `+info` to its ACL rule"
        ) from None
    return {"maxmemory_policy": str(got.get("maxmemory-policy", "noeviction")), "evicted_keys": None, "run_id": ""}


def policy_problem(policy: str) -> str | None:
    """Why a server with this ``maxmemory-policy`` cannot hold a run's rows (None: it can)."""
    if policy not in EVICTING:
        return None
    return (
        f"maxmemory-policy {policy} evicts keys without a TTL, so embedding rows would silently read back as "
        f"never written: run `{POLICY_FIX}` on it (or set it in redis.conf; volatile-* policies are fine too)"
    )


@dataclass(frozen=True)
class Need:
    """A command a run sends a server: its name in ACL rules (``sync``, ``client|pause``), a call of it
    with valid arguments (for ``ACL DRYRUN`` and the probe), and what needs it."""

    rule: str
    call: tuple[str, ...]
    why: str


def _needs(why: str, *calls: tuple[str, ...]) -> tuple[Need, ...]:
    def rule(call: tuple[str, ...]) -> str:
        return "|".join(call[:2]).lower() if call[0] in ("CLIENT", "CLUSTER") else call[0].lower()

    return tuple(Need(rule(c), c, why) for c in calls)


ROWS = _needs(
    "row reads and writes",
    ("PING",),
    ("GET", "k"),
    ("SET", "k", "v"),
    ("HGET", "k", "f"),
    ("HSET", "k", "f", "v"),
    ("MULTI",),
    ("EXEC",),
)
INFO = _needs("the eviction watch, checkpoints", ("INFO", "memory"))
RESTORE = _needs("restoring a failed shard", ("SCAN", "0"), ("UNLINK", "k"))
CLAIM = _needs("the run's claim of its namespace (embeddings.net.ownership)", ("EXISTS", "k"), ("UNLINK", "k"))
FRESH = _needs("the run's claim of its namespace (embeddings.net.ownership)", ("EXISTS", "k"))
SNAPSHOT = _needs("checkpoints over the network", ("SYNC",), ("REPLCONF", "rdb-only", "1"))
PROMOTE = _needs("promoting a replica", ("REPLICAOF", "NO", "ONE"))
WAIT = _needs("--replica-wait", ("WAIT", "1", "0"))
CLUSTER = _needs("finding the cluster's slots", ("CLUSTER", "SLOTS"))
KILL = _needs("an injected shard kill", ("SHUTDOWN", "NOSAVE"))
STALL = _needs("an injected shard stall", ("CLIENT", "PAUSE", "1", "ALL"))


def commands_needed(
    strategy: str,
    num_shards: int,
    num_replicas: int = 0,
    *,
    checkpoints: bool,
    replica_wait: bool = False,
    cluster: bool = False,
    killed: Sequence[int] = (),
    stalled: Sequence[int] = (),
) -> list[tuple[Need, ...]]:
    """Per URL (``num_shards`` servers, then ``num_replicas`` replicas): what a run sends a server it
    did not start. Every run: rows (``embeddings.net.wire``: HGET and PING, HSET, MULTI/HSET/SET/EXEC,
    GET; ``CONFIG SET`` of the listpack limits is tried but not needed, ``embeddings.store.buckets``), INFO
    (``RedisStore.check_evictions``, snapshots), EXISTS and UNLINK on primaries (the namespace claim). Every strategy but replica: restores of a
    failed shard (``clear_shard``: SCAN, UNLINK, then ``load_snapshot``). Checkpoints (``--checkpoint-every``, any strategy): a snapshot over the
    network (``embeddings.snapshots.rdb.NetworkSnapshot``: REPLCONF, SYNC). ``--recovery replica``: REPLICAOF NO
    ONE on the replica (a cluster promotes its own), which then serves the shard (rows, checkpoints).
    ``--replica-wait``: WAIT. Injected kills and stalls of ``killed`` / ``stalled`` shards: SHUTDOWN,
    CLIENT PAUSE (on a cluster, where a shard's node is not known yet: on every seed)."""
    base = ROWS + INFO + (CLUSTER if cluster else ()) + (SNAPSHOT if checkpoints else ())
    promotes = strategy == "replica"
    primary = base + (CLAIM if promotes else RESTORE + FRESH) + (WAIT if replica_wait else ())
    out = []
    for s in range(num_shards):
        kill = KILL if (cluster and killed) or s in killed else ()
        stall = STALL if (cluster and stalled) or s in stalled else ()
        out.append(primary + kill + stall)
    replica = base + (PROMOTE if promotes and not cluster else ())
    return out + [replica] * num_replicas


def _text(reply) -> str:
    return reply.decode(errors="replace") if isinstance(reply, bytes) else str(reply)


def _denied(msg: str) -> bool:
    return "noperm" in msg.lower() or "no permissions to run" in msg.lower()


def _denied_command(msg: str) -> bool:
    """ACL refuses the command itself (a refused key or channel is not what this check looks at)."""
    return "no permissions to run the" in msg.lower()


def missing_commands(client: redis.Redis, user: str, needs: Sequence[Need]) -> list[Need]:
    """The ``needs`` that ``user``'s ACL refuses: asked with ``ACL DRYRUN`` where the connection may
    run it, else found by ``probe``."""
    missing = []
    try:
        for need in needs:
            if _denied_command(_text(client.execute_command("ACL", "DRYRUN", user, *need.call))):
                missing.append(need)
    except redis.ResponseError:  # ACL DRYRUN refused to this user (or Redis < 7)
        return probe(client, needs)
    return missing


def probe(client: redis.Redis, needs: Sequence[Need]) -> list[Need]:
    """The ``needs`` the connection's ACL user may not run, found without running any. ACL is checked
    before a command is queued in a transaction, so most are sent between MULTI and DISCARD. Three
    cannot be queued: EXEC goes alone (``EXEC without MULTI``), SHUTDOWN with an unknown option (a
    syntax error), and SYNC in one packet right behind a PING, so that it finds the PING's reply
    still pending (``SYNC and PSYNC are invalid with pending output``)."""
    missing, queued = [], []
    conn = client.connection_pool.make_connection()
    try:
        conn.connect()

        def ask(*args: str) -> str:
            conn.send_command(*args)
            try:
                return _text(conn.read_response())
            except redis.ResponseError as e:
                return str(e)

        for need in needs:
            if need.rule == "exec":
                refused = _denied_command(ask("EXEC"))
            elif need.rule == "shutdown":
                refused = _denied_command(ask("SHUTDOWN", "RECSYS-ACL-PROBE"))
            elif need.rule == "sync":
                refused = _denied_command(_sync_probe(conn))
                conn.disconnect()  # a server that began a sync after all: its stream goes with the connection
                conn.connect()
            else:
                queued.append(need)
                continue
            if refused:
                missing.append(need)
        if _denied_command(ask("MULTI")):
            return missing + [n for n in needs if n.rule == "multi"]
        missing += [n for n in queued if n.rule != "multi" and _denied_command(ask(*n.call))]
        ask("DISCARD")
    finally:
        conn.disconnect()
    return [n for n in needs if n in missing]  # in the order asked


def _sync_probe(conn) -> str:
    """``PING`` and ``SYNC`` in one packet -> the reply to SYNC: an error's text, or what came instead
    (a sync began: the refusal, if any, would have come with the PONG)."""
    sock = conn._sock
    sock.sendall(b"*1\r\n$4\r\nPING\r\n*1\r\n$4\r\nSYNC\r\n")
    buf = b""
    try:
        while True:
            _, sep, rest = buf.partition(b"\r\n")
            if sep and rest[:1] == b"\n":  # a keep-alive newline: the server began a sync after all
                return ""
            if sep and rest and (rest[:1] != b"-" or b"\r\n" in rest):
                return _text(rest.split(b"\r\n")[0][1:] if rest[:1] == b"-" else rest[:1])
            chunk = sock.recv(4096)
            if not chunk:
                return ""
            buf += chunk
    except OSError:  # no refusal came with the PONG: the server is preparing a sync
        return ""


def describe_missing(shard: int, url: str, missing: Sequence[Need]) -> str:
    """One line: the server, the refused commands and what needs them, the rule to add."""
    user = urlsplit(url).username or "default"
    rules = " ".join(f"+{n.rule}" for n in missing)
    by_why: dict[str, list[str]] = {}
    for n in missing:
        by_why.setdefault(n.why, []).append(n.rule.upper())
    what = "; ".join(f"{', '.join(names)} ({why})" for why, names in by_why.items())
    return (
        f"shard {shard} at {redact(url)}: ACL user {user!r} may not run {what}: add `{rules}` to its rule "
        f"(ACL SETUSER {user} {rules})"
    )
