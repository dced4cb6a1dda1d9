"""The eviction and policy checks of a store's servers: at connect and at commit points, never
per step. One ``EvictionWatch`` per ``RedisStore``, given the shards' links and key names."""

from __future__ import annotations

from embeddings.errors import EndpointError, ShardDataError, ShardEvictedError, ShardUnavailableError, StoreAuthError
from embeddings.net.endpoints import POLICY_FIX, policy_problem, server_state
from embeddings.net.links import ShardLinks
from embeddings.store.row_space import RowSpace


class EvictionWatch:
    def __init__(self, links: ShardLinks, space: RowSpace) -> None:
        self.links, self.space = links, space
        self.noted: dict[int, tuple[str, int | None]] = {}  # shard -> (server run_id, evicted_keys) noted

    def watch(self) -> None:
        """At connect: refuse a shard whose ``maxmemory-policy`` can evict the run's rows (``EndpointError``:
        shard, endpoint, policy, fix) and note each shard's ``evicted_keys``, the baseline
        ``check`` compares with. A shard that does not answer now is noted when it does."""
        for s in range(len(self.links.clients)):
            try:
                self._note_server(s, self.links.call(s, server_state))
            except ShardUnavailableError:
                continue  # dead now: the recovery protocol meets it at its first call

    def check(self, resume: str | None = None, why_not: str = "") -> None:
        """At a commit point (rank 0 after a checkpoint's forks, and at the end): one INFO per shard.

        A server that evicted keys since its baseline lost rows of the run, which would read back as
        never written and be initialised again (unless it runs a volatile-* policy now: those evict
        only keys with a TTL, none of the run's, and the baseline moves on). The recovery protocol
        cannot repair that while the server keeps evicting (a restore would be evicted in turn), so
        the run stops with one line (``ShardEvictedError``): the shard, its endpoint, how many keys,
        the fix, and what then:
        ``resume`` (``--resume DIR``), for which the shard's applied marker is dropped first, so that
        the resumed run finds it at no step and restores it under its strategy; else a new run
        (``why_not``: why this one cannot be resumed). A policy that evicts, set since the connect,
        stops the run too, nothing lost yet (the marker stays). A server replaced since (a restore, a
        restart by its supervisor, a promoted replica: another ``run_id``) gets a new baseline, its
        policy checked as at connect. A dead shard raises ``ShardUnavailableError``: call it under
        the protocol."""
        links = self.links
        for s in range(len(links.clients)):
            state = links.call(s, server_state)
            base = self.noted.get(s)
            if base is None or base[0] != state["run_id"] or base[1] is None:
                self._note_server(s, state)
                continue
            policy, evicted = state["maxmemory_policy"], state["evicted_keys"]
            then = f"then finish the run with {resume}" if resume else f"then run it again ({why_not})"
            if evicted is not None and evicted > base[1] and not policy.startswith("volatile-"):
                if resume:
                    try:  # a shard with no applied marker is empty to a resume: it restores it first
                        links.call(s, lambda c, s=s: c.unlink(self.space.meta_key("applied", s)))
                        then += ", which restores the shard first"
                    except (ShardUnavailableError, StoreAuthError, ShardDataError) as e:
                        then = f"then run it again (the shard's marker could not be dropped for a resume: {e})"
                raise ShardEvictedError(
                    s,
                    links.endpoints[s],
                    f"the server evicted {evicted - base[1]} keys during the run (maxmemory-policy {policy}): "
                    f"rows of the run are lost there and would read back as never written; run `{POLICY_FIX}` "
                    f"on it, {then}",
                )
            problem = policy_problem(policy)
            if problem:
                raise ShardEvictedError(s, links.endpoints[s], f"set during the run: {problem}; {then}")
            self.noted[s] = (base[0], evicted)  # keys with a TTL (volatile-*), another tenant's: not ours

    def _note_server(self, shard: int, state: dict) -> None:
        problem = policy_problem(state["maxmemory_policy"])
        if problem:
            raise EndpointError(f"shard {shard} at {self.links.endpoints[shard]}: {problem}")
        self.noted[shard] = (state["run_id"], state["evicted_keys"])
