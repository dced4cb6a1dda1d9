"""Check ``--redis`` endpoints before any trainer starts: connect, TLS, credentials, a PING.

Each problem is named as what it is, with the shard and its endpoint (password removed):
nothing listens there, the host does not resolve, TLS spoken to a plain server (or the other way
round), a certificate that is not trusted, a wrong password or ACL user.
"""

from __future__ import annotations

import socket
import ssl
from collections.abc import Sequence
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


def check_endpoints(urls: Sequence[str], timeout_s: float = 5.0, connection_kwargs: dict | None = None) -> None:
    """PING every URL once; raise ``EndpointError`` naming the first shard that cannot serve."""
    for shard, url in enumerate(urls):
        kwargs = {"retry": one_try(), **(connection_kwargs or {})}  # one try: the error is the answer
        client = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s, **kwargs)
        try:
            client.ping()
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
