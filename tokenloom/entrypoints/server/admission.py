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
so a client sending hundreds of requests at once takes its share of the batch, not all of it;
among a client's requests, a freed turn goes to the one holding fewest, so its short request
does not wait for its other requests' whole fan-outs.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from tokenloom.entrypoints.server.errors import APIError


def server_busy(why: str, retry_after_s: int) -> APIError:
    """The 429 of a server that has no room for the request now (OpenAI's rate-limit error)."""
    return APIError(
        429,
        f"the server is busy ({why}): retry after {retry_after_s} s",
        type="rate_limit_error",
        code="server_busy",
        headers={"Retry-After": str(retry_after_s)},
    )


@dataclass(frozen=True, slots=True)
class AdmissionLimits:
    """The server's bounds (``tokenloom serve --help`` names the flags)."""

    max_seqs_per_request: int = 64  # prompts x n (x beam width) in one request
    max_pending_seqs: int = 256  # sequences accepted and not yet finished, all requests together
    max_pending_tokens: int = 1 << 20  # the prompt tokens of those sequences
    max_running_per_request: int = 8  # a request's sequences in the engine at once
    max_running_per_client: int = 16  # a client's sequences in the engine at once, all its requests
    default_max_tokens: int = 1024  # new tokens for a request that names no max_tokens
    retry_after_s: int = 1  # what a 429 tells the client to wait

    def __post_init__(self) -> None:
        for name in (
            "max_seqs_per_request",
            "max_pending_seqs",
            "max_pending_tokens",
            "max_running_per_request",
            "max_running_per_client",
            "default_max_tokens",
            "retry_after_s",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"admission limit {name} must be >= 1, got {getattr(self, name)}")


@dataclass
class _ClientTurns:
    """One client's turns: how many are held, by which request, and who waits for one."""

    held: int = 0
    users: int = 0  # holders + waiters
    by_request: dict = field(default_factory=dict)  # request key -> turns it holds
    waiting: dict = field(default_factory=dict)  # request key -> its waiters (futures), in order


class PerClientTurns:
    """At most `turns` holders at once per client. A freed turn goes to the waiting request that
    holds the fewest of the client's turns (the least recently served among equals), so a client's
    short request takes turns with its long fan-outs instead of queueing behind all of them.
    Event-loop only."""

    def __init__(self, turns: int) -> None:
        self.turns = turns
        self._clients: dict[str, _ClientTurns] = {}

    @asynccontextmanager
    async def turn(self, client: str, request: object = None) -> AsyncIterator[None]:
        """Wait for one of `client`'s turns for `request` (any hashable key), hold it for the block."""
        c = self._clients.setdefault(client, _ClientTurns())
        c.users += 1
        try:
            if c.held < self.turns and not c.waiting:
                self._grant(c, request)
            else:
                await self._wait(c, request)
            try:
                yield
            finally:
                self._release(c, request)
        finally:
            c.users -= 1
            if c.users == 0:
                del self._clients[client]

    async def _wait(self, c: _ClientTurns, request: object) -> None:
        """Queue for a turn; a waiter cancelled after its turn was granted gives it back."""
        granted = asyncio.get_running_loop().create_future()
        c.waiting.setdefault(request, []).append(granted)
        try:
            await granted
        except asyncio.CancelledError:
            if granted.done() and not granted.cancelled():
                self._release(c, request)
            else:
                queue = c.waiting.get(request, [])
                if granted in queue:
                    queue.remove(granted)
                    if not queue:
                        del c.waiting[request]
            raise

    @staticmethod
    def _grant(c: _ClientTurns, request: object) -> None:
        c.held += 1
        c.by_request[request] = c.by_request.get(request, 0) + 1

    def _release(self, c: _ClientTurns, request: object) -> None:
        c.held -= 1
        c.by_request[request] -= 1
        if not c.by_request[request]:
            del c.by_request[request]
        while c.waiting and c.held < self.turns:
            nxt = min(c.waiting, key=lambda r: c.by_request.get(r, 0))  # ties: the least recently served
            queue = c.waiting.pop(nxt)
            granted = queue.pop(0)
            if queue:
                c.waiting[nxt] = queue  # to the back of the ties
            if not granted.done():
                self._grant(c, nxt)
                granted.set_result(None)

    def __len__(self) -> int:
        return len(self._clients)

    def users(self, client: str) -> int:
        """The client's holders and waiters."""
        return self._clients[client].users if client in self._clients else 0


class Ticket:
    """One admitted request's share of the pending counts; ``release()`` (idempotent) returns it."""

    def __init__(self, admission: Admission, seqs: int, tokens: int, client: str) -> None:
        self.admission, self.seqs, self.tokens, self.client = admission, seqs, tokens, client
        self.turns = asyncio.Semaphore(admission.limits.max_running_per_request)  # sequences in the engine
        self.released = False

    def client_turn(self):
        """One of the client's running-sequence turns, shared by all its requests in turn (async with)."""
        return self.admission.running.turn(self.client, self)

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
        self.running = PerClientTurns(limits.max_running_per_client)  # each client's sequences in the engine

    def check_size(self, seqs: int, param: str) -> None:
        """APIError 400 (naming `param`) for a request of more sequences than one may have; checked
        before its prompts are tokenized and its sequences' parameters built (2,000 prompts x n=16)."""
        if seqs > self.limits.max_seqs_per_request:
            raise APIError(
                400,
                f"this request asks for {seqs} sequences (prompts x n x beams); this server takes "
                f"at most {self.limits.max_seqs_per_request} per request",
                param,
            )

    def admit(self, seqs: int, prompt_tokens: int, param: str, client: str = "") -> Ticket:
        """A ticket for `seqs` sequences holding `prompt_tokens` prompt tokens in all, or an
        APIError: 400 (naming `param`) past the per-request bound, 429 when the server is full."""
        limits = self.limits
        self.check_size(seqs, param)
        if (
            self.pending_seqs + seqs > limits.max_pending_seqs
            or self.pending_tokens + prompt_tokens > limits.max_pending_tokens
        ):
            raise server_busy(
                f"{self.pending_seqs} sequences with {self.pending_tokens} prompt tokens pending; at "
                f"most {limits.max_pending_seqs} and {limits.max_pending_tokens}",
                limits.retry_after_s,
            )
        self.pending_seqs += seqs
        self.pending_tokens += prompt_tokens
        return Ticket(self, seqs, prompt_tokens, client)
