"""Decides, each step, which requests compute how many tokens. No torch here.

The rule is vLLM v1's: every request has ``num_computed_tokens`` and
``num_tokens``, and a step hands out up to ``max_num_batched_tokens`` tokens of
work. Prefill, chunked prefill, decode, prefix-cache hits and recomputation
after preemption are all that one rule:

1. running requests, oldest first, each get ``num_tokens - num_computed_tokens``
   tokens (a prompt chunk, or 1 to decode) within the budget; KV blocks are
   allocated as they are needed. When blocks run out, the newest running
   request is preempted: its blocks are freed and it waits to be recomputed.
2. if nothing was preempted, waiting requests are admitted oldest first while
   there is budget, a sequence slot and blocks; an admitted prompt starts after
   its longest cached prefix. Nobody overtakes the head of the queue (FCFS), and
   since preemption always takes the newest, the oldest request always progresses.
   With prefix caching, the head also waits while its next uncached prompt block is
   one that a running request has yet to compute (this step or a later chunk): requests
   that arrive together with a shared system prompt compute it once, then hit it,
   instead of each computing it side by side in the same step.
3. when every scheduled request decodes, none waits, and the runner can feed each token back on
   the device (``decodes_ahead``: the device sampler's settings, no logprobs, penalties or
   grammar), a step decodes up to ``decode_steps`` tokens in a row: one host round trip for
   several tokens. KV room is taken for all of them; a request that stops on the way keeps the
   tokens up to its stop, and the room past it is given back.
4. with ``context_shift`` set, a decoding request that fills the context drops its oldest tokens
   after the kept head before its step (engine/context_shift.py); the runner turns the moved keys
   back before the step's forward.
5. with ``fair_share_seqs`` set, requests of several clients (a server labels each) take turns:
   a step computes at most a client's share of its sequences (engine/fair_share.py); the others sit
   the step out, and a waiting request whose client has used its turns (and admitted one past
   them) lets later ones pass.
"""

from __future__ import annotations

import bisect
import sys
from collections.abc import Callable, Sequence

from tokenloom.config import SchedulerConfig
from tokenloom.engine.context_shift import plan_shift
from tokenloom.engine.core_output import CoreOutput
from tokenloom.engine.fair_share import FairShare
from tokenloom.engine.request import Request, RequestStatus
from tokenloom.engine.stopping import check_token_stop
from tokenloom.kv_cache.block_manager import BlockManager
from tokenloom.outputs import describe_error
from tokenloom.worker.contract import KVShift, RunnerOutput, ScheduledRequest, SchedulerOutput


def _by_arrival(r: Request) -> int:
    return r.arrival


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        block_manager: BlockManager,
        max_model_len: int,
        decodes_ahead: Callable[[Request], bool] | None = None,
    ) -> None:
        """`decodes_ahead(request)`: the runner can decode several of its tokens in a row."""
        self.config = config
        self.decodes_ahead = decodes_ahead
        self.blocks = block_manager
        self.max_model_len = max_model_len
        self.waiting: list[Request] = []  # sorted by arrival
        self.running: list[Request] = []  # sorted by arrival
        self.num_preemptions = 0
        self.num_steps = 0
        self.turns = FairShare(config.fair_share_seqs) if config.fair_share_seqs is not None else None
        self.num_prompt_tokens_computed = 0  # prompt positions run through the model (prefill, recompute)
        self.num_generated_tokens = 0
        self.num_context_shifts = 0
        self.spec_steps = self.spec_draft_tokens = self.spec_accepted_tokens = 0  # summed over requests

    def check_fits(self, num_prompt_tokens: int, max_tokens: int) -> None:
        """ValueError if a request this long could never fit in the whole cache."""
        need = min(num_prompt_tokens + max_tokens, self.max_model_len)
        if not self.blocks.fits(need):
            raise ValueError(
                f"request needs up to {need} tokens of KV cache (prompt {num_prompt_tokens} + "
                f"max_tokens {max_tokens}) but the whole cache holds "
                f"{self.blocks.capacity_tokens}; lower max_tokens or raise --kv-cache-memory"
            )

    def add(self, request: Request) -> None:
        """Queue a request (``check_fits`` has accepted its size)."""
        bisect.insort(self.waiting, request, key=_by_arrival)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        preemptions_before = self.num_preemptions
        self.num_steps += 1
        sitting_out = self.turns.begin(self.running) if self.turns is not None else set()
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            if id(req) in sitting_out:
                i += 1
                continue
            if self._fills_context(req) and not self._shift(req, out):
                break  # req itself was preempted to make room: it waits now
            spec = self._take_drafts(req, budget)
            n = min(req.num_tokens - req.num_computed_tokens, budget) + len(spec)
            if not spec and not self._allocate_or_preempt(req, n):
                break  # req itself was the newest: it waits now
            budget -= self._emit(out, req, n, spec)
            i += 1
        if self.num_preemptions == preemptions_before:
            self._admit(out, budget)
        if self.config.decode_steps > 1 and not self.waiting and out.scheduled:
            self._decode_ahead(out)
        out.block_copies = self.blocks.pending_copies()
        out.window_block_copies = self.blocks.pending_window_copies()
        return out

    def _decode_ahead(self, out: SchedulerOutput) -> None:
        """Let every scheduled request decode the same number of tokens in a row (at most
        decode_steps, none past its max_tokens or the context), with KV room for them; nothing
        changes unless all of them can and the free blocks hold the room."""
        steps = self.config.decode_steps
        for s in out.scheduled:
            req = s.request
            if (
                s.num_tokens != 1
                or s.spec_token_ids
                or not s.samples
                or self.decodes_ahead is None
                or not self.decodes_ahead(req)
            ):
                return
            steps = min(steps, req.params.max_tokens - len(req.output_token_ids), self.max_model_len - req.num_tokens)
        if steps <= 1:
            return
        tables = self.blocks.grow_all(
            {s.request.request_id: s.request.num_computed_tokens + steps for s in out.scheduled}
        )
        if tables is None:
            return
        for s in out.scheduled:
            rid = s.request.request_id
            s.block_ids, s.decode_steps = tables[rid], steps
            s.window_block_ids = self.blocks.window_block_ids(rid)

    def _allocate_or_preempt(self, req: Request, n: int) -> bool:
        """Blocks for req's next n tokens, preempting the newest running requests until they fit.

        Returns False if req itself had to be preempted. Victims come from the end of
        the arrival-ordered running list, so none of them was scheduled yet this step.
        """
        while self.blocks.allocate(req.request_id, req.num_computed_tokens + n) is None:
            victim = self.running[-1]
            self._preempt(victim)
            if victim is req:
                return False
        return True

    def _fills_context(self, req: Request) -> bool:
        """req decodes next and its context is full: with context shift on, it shifts first."""
        return bool(
            self.config.context_shift
            and req.num_tokens >= self.max_model_len
            and req.num_tokens - req.num_computed_tokens == 1
        )

    def _shift(self, req: Request, out: SchedulerOutput) -> bool:
        """Drop req's oldest blocks after its kept head (engine/context_shift.py), preempting the
        newest running requests if the moved blocks' copies need room. Returns False if req itself
        had to be preempted."""
        plan = plan_shift(req.num_computed_tokens, self._keep(req), self.blocks.block_size)
        assert plan is not None, "context_shift.check_keep admits only keeps that leave blocks to drop"
        while (moves := self.blocks.shift(req.request_id, plan.keep_blocks, plan.drop_blocks)) is None:
            victim = self.running[-1]
            self._preempt(victim)
            if victim is req:
                return False
        req.keep_tokens = plan.keep_tokens
        req.num_dropped += plan.delta
        req.num_computed_tokens -= plan.delta
        req.draft_num_computed = 0
        self.num_context_shifts += 1
        out.kv_shifts.append(KVShift(moves.pairs, plan.delta, moves.window_pairs))
        return True

    def _keep(self, req: Request) -> int:
        """The tokens a context shift of req keeps at its start (0 with context shift off)."""
        if not self.config.context_shift:
            return 0
        return req.params.context_keep if req.params.context_keep is not None else self.config.context_keep

    def _take_drafts(self, req: Request, budget: int) -> list[int]:
        """The request's draft tokens to verify this step, with blocks allocated for them; [] if
        it is not decoding, has none, or they do not fit (drafts never preempt anyone)."""
        drafts, req.spec_token_ids = req.spec_token_ids, []
        if not drafts or req.num_tokens - req.num_computed_tokens != 1:
            return []
        drafts = drafts[: budget - 1]
        if drafts and self.blocks.allocate(req.request_id, req.num_tokens + len(drafts)) is not None:
            return drafts
        return []

    def _admit(self, out: SchedulerOutput, budget: int) -> None:
        j = 0
        while j < len(self.waiting) and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[j]
            if self.turns is not None and not self.turns.may_admit(req):
                j += 1  # its client has had its turns this step
                continue
            # a scoring request needs logits at every prompt position: no cached prefix
            hit = self.blocks.lookup(
                req.request_id,
                req.all_token_ids,
                req.num_prompt_tokens,
                use_cache=req.params.prompt_logprobs is None,
                root=req.lora.root if req.lora is not None else None,
            )
            if hit.waits:
                break  # hit its next block next step instead of computing it twice
            n = min(req.num_tokens - hit.num_tokens, budget)
            if self.blocks.allocate(req.request_id, hit.num_tokens + n, hit) is None:
                break
            if req.num_preemptions == 0:
                req.metrics.num_cached_prompt_tokens = hit.num_tokens
            self.waiting.pop(j)
            req.num_computed_tokens = hit.num_tokens
            req.status = RequestStatus.RUNNING
            bisect.insort(self.running, req, key=_by_arrival)
            budget -= self._emit(out, req, n)

    def _emit(self, out: SchedulerOutput, req: Request, n: int, spec: Sequence[int] = ()) -> int:
        if self.turns is not None:
            self.turns.take(req, self.num_steps)
        samples = req.num_computed_tokens + n - len(spec) == req.num_tokens and req.params.max_tokens > 0
        rid = req.request_id
        out.scheduled.append(
            ScheduledRequest(
                req,
                n,
                samples,
                self.blocks.block_ids(rid),
                list(spec),
                state_slot=self.blocks.state_slot(rid),
                window_block_ids=self.blocks.window_block_ids(rid),
            )
        )
        return n

    def _preempt(self, req: Request) -> None:
        """Free a running request's blocks; it will be recomputed from scratch (prefix hits aside)."""
        self.running.remove(req)
        self.blocks.release(req.request_id)
        req.num_computed_tokens = req.draft_num_computed = 0
        req.spec_token_ids = []
        req.status = RequestStatus.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        bisect.insort(self.waiting, req, key=_by_arrival)

    def update_from_output(self, sched: SchedulerOutput, out: RunnerOutput) -> list[CoreOutput]:
        """The step's tokens are in the cache: append each request's new tokens, check token
        stops and grammar completion, advance ``num_computed_tokens``, index newly full blocks,
        give back the room of rejected drafts, and finish requests that ended (the only place a
        step finishes one). A request whose data failed anywhere in the step ends alone with
        finish reason "error"; the others go on.

        Returns one CoreOutput per request that produced tokens, prompt logprobs or an ending.
        """
        self.blocks.copies_done()
        results = dict(zip(out.request_ids, zip(out.sampled_token_ids, out.logprobs)))
        outputs = []
        for s in sched.scheduled:
            req = s.request
            prompt_left = req.num_prompt_tokens - req.num_computed_tokens
            self.num_prompt_tokens_computed += max(0, min(s.num_tokens, prompt_left))
            if req.is_finished:
                continue  # aborted while the step ran
            rid = req.request_id
            tokens, logprobs = results.get(rid, ([], None))
            error = out.errors.get(rid)
            if error is None:
                try:
                    tokens = self._advance(req, s, tokens)
                except Exception as e:  # e.g. a grammar matcher refusing a token
                    error = describe_error(e)
            if error is not None:
                self.finish(req, "error", error)
                outputs.append(CoreOutput(req, [], finished=True, error=error))
                continue
            output = CoreOutput(
                req,
                tokens,
                None if logprobs is None else logprobs[: len(tokens)],
                out.prompt_logprobs.get(rid),
                out.explanations.get(rid),
                req.is_finished,
            )
            if tokens or output.finished or output.prompt_logprobs is not None:
                outputs.append(output)
        return outputs

    def _advance(self, req: Request, s: ScheduledRequest, tokens: list[int]) -> list[int]:
        """Append `tokens` up to the first token stop, advance the computed count, cache full
        blocks; finish the request if it ended. Returns the tokens appended.

        After a step every token but the newest has KV in the cache: a prompt chunk adds its
        own tokens, a sampled token is the newest, and a request that verified drafts holds KV
        for its last token and every accepted draft.
        """
        if s.spec_token_ids:
            self._record_speculation(req, len(s.spec_token_ids), len(tokens) - 1)
        appended, stop = [], None
        for token in tokens:
            if req.matcher is not None:
                req.matcher.consume_token(token)
            req.output_token_ids.append(token)
            appended.append(token)
            self.num_generated_tokens += 1
            stop = self._token_stop(req)
            if stop is not None:
                break
        if s.spec_token_ids or s.decode_steps > 1:  # KV for every token but the newest; room past it back
            req.num_computed_tokens = req.num_tokens - 1
            self.blocks.trim(req.request_id, req.num_tokens)
        else:
            req.num_computed_tokens += s.num_tokens
        req.draft_num_computed = min(req.draft_num_computed, req.num_computed_tokens)
        if stop is None and req.params.max_tokens == 0 and req.num_computed_tokens >= req.num_prompt_tokens:
            stop = ("length", None)  # scored: the whole prompt is computed
        if stop is not None:
            self.finish(req, *stop)
        else:
            self.blocks.commit(req.request_id, req.all_token_ids, req.num_computed_tokens, self._keep(req))
        return appended

    def _token_stop(self, req: Request) -> tuple[str, int | None] | None:
        """(finish reason, stop token) if req's newest token ends it: EOS, a stop id, max_tokens,
        the context end, or a grammar that is complete (nothing may follow)."""
        context = sys.maxsize if self.config.context_shift else self.max_model_len  # a full context shifts
        stop = check_token_stop(req.output_token_ids, req.params, req.eos_token_ids, req.num_tokens, context)
        if stop is None and req.matcher is not None and req.matcher.is_stopped():
            stop = ("stop", None)
        return stop

    def _record_speculation(self, req: Request, proposed: int, accepted: int) -> None:
        m = req.metrics
        m.num_spec_steps += 1
        m.num_draft_tokens += proposed
        m.num_accepted_tokens += accepted
        self.spec_steps += 1
        self.spec_draft_tokens += proposed
        self.spec_accepted_tokens += accepted
        req.spec_acceptance = 0.5 * req.spec_acceptance + 0.5 * accepted / proposed

    def reserve_lookahead(self, req: Request, num_tokens: int) -> list[int] | None:
        """KV blocks for `num_tokens` of req's positions ahead of the scheduler's own allocation
        (a draft model writes its drafts' keys there): the block table, or None if they do
        not fit (a lookahead never preempts anyone)."""
        return self.blocks.allocate(req.request_id, num_tokens)

    def finish(self, request: Request, reason: str, stop_reason: str | int | None = None) -> None:
        """End a request: free its blocks and drop it from the queues (no-op if it has ended).

        A request that ended normally ("stop", "length") first adds the full blocks of its
        tokens that have KV (``num_computed_tokens``) to the prefix cache, and remembers its
        last partial block, so a request that ends in the step that computed its prompt
        (max_tokens=1, scoring) still leaves its prompt to be reused. `reason` "error" carries
        the message in `stop_reason`.
        """
        if request.is_finished:
            return
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        request.stop_reason = stop_reason
        ended = reason in ("stop", "length")
        self.blocks.release(request.request_id, request.all_token_ids if ended else None, request.num_computed_tokens)
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
