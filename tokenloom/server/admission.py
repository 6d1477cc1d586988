"""Admission control: how much work the server takes on, and turns between requests.

Every request's sequences (prompts x n, or x beam width) are counted from acceptance to their
end. A request beyond ``max_seqs_per_request`` is a 400 naming the parameter; one that would
take the pending sequences past ``max_pending_seqs`` or their prompt tokens past
``max_pending_tokens`` is a 429 with Retry-After (OpenAI's rate-limit error), so a burst is
refused at the door instead of queueing minutes of work. Inside, a request runs at most
``max_running_per_request`` of its sequences in the engine at once (the rest wait for one of
them to end), so one request with n=16 over many prompts cannot hold every batch slot while
another client's short request waits behind it; and a client (its ``user`` field if it gives
one, else its address) runs at most ``max_running_per_client`` sequences over all its requests,
so a client sending hundreds of requests at once takes its share of the batch, not all of it.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

from tokenloom.server.errors import APIError


def server_busy(why: str, retry_after_s: int) -> APIError:
    """The 429 of a server that has no room for the request now (OpenAI's rate-limit error)."""
    return APIError(429, f"the server is busy ({why}): retry after {retry_after_s} s", type="rate_limit_error",
                    code="server_busy", headers={"Retry-After": str(retry_after_s)})


@dataclass(frozen=True, slots=True)
class AdmissionLimits:
    """The server's bounds (``tokenloom serve --help`` names the flags)."""

    max_seqs_per_request: int = 64       # prompts x n (x beam width) in one request
    max_pending_seqs: int = 256          # sequences accepted and not yet finished, all requests together
    max_pending_tokens: int = 1 << 20    # the prompt tokens of those sequences
    max_running_per_request: int = 8     # a request's sequences in the engine at once
    max_running_per_client: int = 16     # a client's sequences in the engine at once, all its requests
    default_max_tokens: int = 1024       # new tokens for a request that names no max_tokens
    retry_after_s: int = 1               # what a 429 tells the client to wait

    def __post_init__(self) -> None:
        for name in ("max_seqs_per_request", "max_pending_seqs", "max_pending_tokens", "max_running_per_request",
                     "max_running_per_client", "default_max_tokens", "retry_after_s"):
            if getattr(self, name) < 1:
                raise ValueError(f"admission limit {name} must be >= 1, got {getattr(self, name)}")


class PerClientTurns:
    """At most `turns` holders at once per client (an asyncio semaphore each, kept while the
    client has holders or waiters). Event-loop only."""

    def __init__(self, turns: int) -> None:
        self.turns = turns
        self._clients: dict[str, tuple[asyncio.Semaphore, int]] = {}   # client -> (its turns, holders + waiters)

    @asynccontextmanager
    async def turn(self, client: str) -> AsyncIterator[None]:
        """Wait for one of `client`'s turns, hold it for the block."""
        turns, users = self._clients.get(client) or (asyncio.Semaphore(self.turns), 0)
        self._clients[client] = (turns, users + 1)
        try:
            async with turns:
                yield
        finally:
            turns, users = self._clients[client]
            if users > 1:
                self._clients[client] = (turns, users - 1)
            else:
                del self._clients[client]

    def __len__(self) -> int:
        return len(self._clients)

    def users(self, client: str) -> int:
        """The client's holders and waiters."""
        return self._clients[client][1] if client in self._clients else 0


class Ticket:
    """One admitted request's share of the pending counts; ``release()`` (idempotent) returns it."""

    def __init__(self, admission: Admission, seqs: int, tokens: int, client: str) -> None:
        self.admission, self.seqs, self.tokens, self.client = admission, seqs, tokens, client
        self.turns = asyncio.Semaphore(admission.limits.max_running_per_request)   # sequences in the engine
        self.released = False

    def client_turn(self):
        """One of the client's running-sequence turns, shared by all its requests (async with)."""
        return self.admission.running.turn(self.client)

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.admission.pending_seqs -= self.seqs
            self.admission.pending_tokens -= self.tokens


class Admission:
    """The pending counts of one server (touched only from its event loop)."""

    def __init__(self, limits: AdmissionLimits) -> None:
        self.limits = limits
        self.pending_seqs = self.pending_tokens = 0
        self.running = PerClientTurns(limits.max_running_per_client)   # each client's sequences in the engine

    def check_size(self, seqs: int, param: str) -> None:
        """APIError 400 (naming `param`) for a request of more sequences than one may have; checked
        before its prompts are tokenized and its sequences' parameters built (2,000 prompts x n=16)."""
        if seqs > self.limits.max_seqs_per_request:
            raise APIError(400, f"this request asks for {seqs} sequences (prompts x n x beams); this server takes "
                                f"at most {self.limits.max_seqs_per_request} per request", param)

    def admit(self, seqs: int, prompt_tokens: int, param: str, client: str = "") -> Ticket:
        """A ticket for `seqs` sequences holding `prompt_tokens` prompt tokens in all, or an
        APIError: 400 (naming `param`) past the per-request bound, 429 when the server is full."""
        limits = self.limits
        self.check_size(seqs, param)
        if self.pending_seqs + seqs > limits.max_pending_seqs or \
                self.pending_tokens + prompt_tokens > limits.max_pending_tokens:
            raise server_busy(f"{self.pending_seqs} sequences with {self.pending_tokens} prompt tokens pending; at "
                              f"most {limits.max_pending_seqs} and {limits.max_pending_tokens}", limits.retry_after_s)
        self.pending_seqs += seqs
        self.pending_tokens += prompt_tokens
        return Ticket(self, seqs, prompt_tokens, client)
