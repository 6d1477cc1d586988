"""Turns between clients: how many of one client's sequences a step computes.

A server labels each request with its client (``Request.client``: its `user` field, else its
address). On a CPU a step's cost grows with the number of sequences in it, so a client running
many sequences slows every other client's tokens, even with batch slots to spare. When requests
of two or more clients run, a step computes at most ``share = ceil(seqs / clients)`` (at least 1)
of each client's sequences: a client with more waits its turn, the ones stepped least recently
first, so each of them still progresses. A client whose turns are spent still admits one waiting
request a step (its prompt's first chunk): new requests join the rotation instead of waiting
behind the client's running ones. With one client (every offline run) nothing is held back, and
skipping a step changes no token: a sequence computes the same tokens whenever it is stepped.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from tokenloom.engine.request import Request


class FairShare:
    """Per-step turns for ``seqs`` sequences divided between the clients of running requests."""

    def __init__(self, seqs: int) -> None:
        self.seqs = seqs  # >= 1 (SchedulerConfig checks it)
        self.share: int | None = None  # this step's turns per client; None: unbounded
        self.used: Counter = Counter()  # client -> sequences this step computes
        self.admitted_past_share: set[str | None] = set()

    def begin(self, running: Iterable[Request]) -> set[int]:
        """Start a step over `running`; the ids (``id(request)``) of the requests that sit it out."""
        by_client: dict[str | None, list[Request]] = {}
        for req in running:
            by_client.setdefault(req.client, []).append(req)
        self.used.clear()
        self.admitted_past_share.clear()
        self.share = max(1, -(-self.seqs // len(by_client))) if len(by_client) > 1 else None
        if self.share is None:
            return set()
        return {
            id(req)
            for reqs in by_client.values()
            if len(reqs) > self.share
            for req in sorted(reqs, key=lambda r: (r.last_step, r.arrival))[self.share :]
        }

    def may_admit(self, req: Request) -> bool:
        """Whether waiting req may join this step: its client has a turn left, or has not yet
        admitted one past its share this step."""
        return self.share is None or self.used[req.client] < self.share or req.client not in self.admitted_past_share

    def take(self, req: Request, step: int) -> None:
        """req is computed in step `step`."""
        if self.share is not None and self.used[req.client] >= self.share:
            self.admitted_past_share.add(req.client)
        self.used[req.client] += 1
        req.last_step = step
