"""The draft registry: one small Ray actor per app through which draft activations reach every Generator replica.

The admin endpoint records `(domain, version)` with a sequence number; each Generator replica polls
for entries newer than the last it applied, applies them (load, check, swap) and acknowledges with
its outcome. Replicas that stop polling (killed, restarted) drop out of `live()` after `ttl_s`; a
new replica starts from sequence 0, so it converges on the latest activations too.
"""

from __future__ import annotations

import time

import ray

ACTOR_PREFIX = "flashspec-draft-registry-"


@ray.remote(num_cpus=0)
class DraftRegistry:
    def __init__(self, ttl_s: float = 5.0) -> None:
        self.ttl_s = ttl_s
        self.seq = 0
        self.entries: list[tuple[int, str, str]] = []  # (seq, domain, version)
        self.seen: dict[str, float] = {}  # replica id -> last poll (monotonic)
        self.acks: dict[int, dict[str, dict]] = {}  # seq -> replica id -> {"ok", "message", "version"}
        self.applied: dict[str, int] = {}  # replica id -> highest sequence handled (applied or superseded)

    def push(self, domain: str, version: str) -> int:
        self.seq += 1
        self.entries.append((self.seq, domain, version))
        return self.seq

    def withdraw(self, seq: int) -> None:
        """Forget a refused activation, so replicas starting later do not try it again."""
        self.entries = [e for e in self.entries if e[0] != seq]

    def poll(self, replica: str, after: int) -> list[tuple[int, str, str]]:
        """Entries newer than `after`; only the newest per domain matters."""
        self.seen[replica] = time.monotonic()
        newest: dict[str, tuple[int, str, str]] = {}
        for entry in self.entries:
            if entry[0] > after:
                newest[entry[1]] = entry
        return sorted(newest.values())

    def ack(self, replica: str, seq: int, ok: bool, message: str, version: str) -> None:
        self.seen[replica] = time.monotonic()
        self.acks.setdefault(seq, {})[replica] = {"ok": ok, "message": message, "version": version}
        self.applied[replica] = max(self.applied.get(replica, 0), seq)

    def live(self) -> list[str]:
        now = time.monotonic()
        return sorted(r for r, t in self.seen.items() if now - t <= self.ttl_s)

    def outcome(self, seq: int) -> dict:
        """{"live", "pending" (live replicas not past `seq` yet), "acks": {replica: {...}}} for one activation."""
        live = self.live()
        pending = [r for r in live if self.applied.get(r, 0) < seq]
        return {"live": live, "pending": pending, "acks": dict(self.acks.get(seq, {}))}


def registry_handle(app_name: str):
    """The app's registry actor, created on first use (detached: it outlives replica restarts)."""
    return DraftRegistry.options(
        name=ACTOR_PREFIX + app_name, lifetime="detached", get_if_exists=True, max_restarts=-1,
    ).remote()
