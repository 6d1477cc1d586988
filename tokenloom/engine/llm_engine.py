"""LLMEngine: the EngineCore and the OutputProcessor behind one interface.

Requests in (``add_request``), one ``step()`` at a time, StepDeltas out. The sync ``LLM``,
``AsyncLLMEngine`` and, through it, the server use this interface only.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch

from tokenloom.config import EngineConfig
from tokenloom.engine.core import EngineCore
from tokenloom.engine.output_processor import OutputProcessor
from tokenloom.engine.request import Request
from tokenloom.loader import load_model
from tokenloom.lora.manager import AdapterRef, PreparedAdapter
from tokenloom.memory.allocator import keep_freed_memory
from tokenloom.metrics import EngineStats
from tokenloom.outputs import StepDelta
from tokenloom.sampling_params import SamplingParams
from tokenloom.worker.batch import SeqChunk

if TYPE_CHECKING:
    from tokenloom.distributed.launch import Ranks


class LLMEngine:
    """Not thread-safe: one caller at a time (AsyncLLMEngine serializes concurrent users)."""

    def __init__(self, config: EngineConfig, progress: bool = False) -> None:
        self.config = config
        keep_freed_memory()  # large activations reuse mapped pages (memory/allocator.py)
        self.ranks: Ranks | None = None
        if config.world_size > 1:
            loaded = self._load_parallel(config, progress)
        else:
            loaded = load_model(
                config.model,
                config.dtype,
                config.device,
                config.max_model_len,
                progress,
                quantization=config.quantization,
            )
        self.tokenizer = loaded.tokenizer
        self.sampling_defaults = loaded.sampling_defaults  # what a request that leaves settings out gets
        try:
            self.core = EngineCore(config, loaded, progress, peers=None if self.ranks is None else self.ranks.group)
            if self.ranks is not None:
                kv = self.core.runner.kv_cache
                self.ranks.group.send("cache", (kv.num_blocks, kv.block_size, config.dtype, config.kv_cache_dtype))
        except BaseException:
            if self.ranks is not None:
                self.ranks.stop()  # the ranks started for this engine go with it
            raise
        self.output_processor = OutputProcessor(self.tokenizer, self.core.finish, self.core.kv_bytes_per_token)
        self._arrivals = itertools.count()

    def _load_parallel(self, config: EngineConfig, progress: bool):
        """Rank 0's share of a model split over ranks (tensor or pipeline parallel), the other ranks
        started (each loads its own share meanwhile). The plan is checked before any process starts."""
        from tokenloom.distributed.group import rank_device
        from tokenloom.distributed.launch import start_ranks
        from tokenloom.distributed.shard import TensorParallelError
        from tokenloom.distributed.worker import load_share, parallel_plan
        from tokenloom.loader.load import load_checkpoint
        from tokenloom.models.registry import model_class

        if config.speculative is not None:
            raise TensorParallelError("speculative decoding with a model split over ranks is not implemented")
        checked = load_checkpoint(config.model).config
        plan = parallel_plan(config, 0, checked)
        plan.check(checked, model_class(checked))
        rank_device(config.device, 0)  # CUDA: rank 0 on this node's first GPU
        self.ranks = start_ranks(config, checked)
        try:
            loaded = load_share(config, plan, self.ranks.group)
            self.ranks.wait_loaded()
        except BaseException:
            self.ranks.stop()
            raise
        return loaded

    # ---- what callers read -------------------------------------------------------------------
    @property
    def model_config(self):
        return self.core.model_config

    @property
    def max_model_len(self) -> int:
        return self.core.max_model_len

    @property
    def context_shift(self) -> bool:
        """A sequence that fills the context goes on (engine/context_shift.py) instead of ending."""
        return bool(self.core.config.scheduler.context_shift)

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return self.core.eos_token_ids

    @eos_token_ids.setter
    def eos_token_ids(self, ids: frozenset[int]) -> None:
        self.core.eos_token_ids = frozenset(ids)

    @property
    def model(self) -> torch.nn.Module:
        """The loaded model (to inspect: its weights, their formats; the engine owns it)."""
        return self.core.runner.model

    @property
    def requests(self) -> dict[str, Request]:
        """The requests the core is running or queueing, by id (read-only use)."""
        return self.core.requests

    @property
    def kv_cache_tokens(self) -> int:
        return self.core.runner.kv_cache.num_tokens

    def reserve_activation_memory(self) -> bool:
        return self.core.reserve_activation_memory()

    def warm_up_grammars(self) -> None:
        """Pay the grammar engine's one-time start-up now rather than in the first constrained request."""
        self.core.grammars.warm_up()

    def check_constraint(self, constraint) -> None:
        """ValueError if a structured-output constraint does not compile (compiled once, cached)."""
        self.core.grammars.grammar(constraint)

    def grammar_special_tokens(self, texts: tuple[str, ...]) -> frozenset[str]:
        """Those of `texts` that are one special token to the grammar engine (a grammar names them as
        <token>, not as text)."""
        return self.core.grammars.special_tokens(texts, lambda t: self.tokenizer.encode(t, add_special_tokens=False))

    @torch.inference_mode()
    def embed(self, token_ids: list[int], pooling: str = "mean") -> list[float]:
        """An embedding of `token_ids`: the final hidden states (after the last norm, before the
        output projection) pooled over the tokens ("mean") or taken at the last one ("last"),
        L2-normalized. Runs the prompt once through the model in KV blocks borrowed for the call
        (never cached); call between steps. ValueError for an empty or too long input,
        RuntimeError when the KV cache has no room for it now."""
        if pooling not in ("mean", "last"):
            raise ValueError(f"pooling must be mean or last, got {pooling!r}")
        if not token_ids or len(token_ids) > self.max_model_len:
            raise ValueError(f"the input has {len(token_ids)} tokens; this model takes 1 to {self.max_model_len}")
        with self.core.block_manager.borrow(len(token_ids)) as (block_ids, slot, window_ids):
            hidden, _ = self.core.runner.forward([SeqChunk(list(token_ids), 0, block_ids, slot, window_ids)])
        pooled = hidden.float().mean(0) if pooling == "mean" else hidden[-1].float()  # (hidden,)
        return torch.nn.functional.normalize(pooled, dim=0).tolist()

    @torch.inference_mode()
    def prefill_logits(self, token_ids: list[int], chunk_size: int = 128) -> Iterator[tuple[int, torch.Tensor]]:
        """(start, logits) per chunk: float32 logits (len(chunk), vocab) for the positions
        start .. start + len(chunk) - 1 of `token_ids`, each predicting the next token (full logits,
        for comparing engines; a scoring request's prompt logprobs are the serving path).

        Runs while the engine is idle (RuntimeError otherwise), in KV blocks borrowed for the call
        (RuntimeError if they are not free); ValueError past the context. Chunks after the first
        read the earlier tokens' keys and values from the KV cache, as decoding does."""
        n = len(token_ids)
        if n > self.max_model_len:
            raise ValueError(f"{n} tokens exceed the model's context of {self.max_model_len}")
        if self.has_unfinished_requests():
            raise RuntimeError("full logits are computed only while the engine has no requests in flight")
        runner = self.core.runner
        with self.core.block_manager.borrow(n) as (block_ids, slot, window_ids):
            for start in range(0, n, chunk_size):
                chunk = SeqChunk(token_ids[start : start + chunk_size], start, block_ids, slot, window_ids)
                hidden, _ = runner.forward([chunk])
                yield start, runner.model.compute_logits(hidden)  # (len, vocab)

    # ---- LoRA adapters ------------------------------------------------------------------------
    def prepare_lora(self, name: str, path: str) -> PreparedAdapter:
        """Read and check a LoRA adapter's files for ``add_lora`` (EngineCore.prepare_lora; any thread)."""
        return self.core.prepare_lora(name, path)

    def add_lora(self, name: str, source: str | PreparedAdapter) -> AdapterRef:
        """Load a LoRA adapter (a path, or prepared) under `name` (EngineCore.add_lora; between steps)."""
        return self.core.add_lora(name, source)

    def remove_lora(self, name: str) -> None:
        """Unload adapter `name` (ValueError while a request uses it)."""
        self.core.remove_lora(name)

    def loras(self) -> list[AdapterRef]:
        """The adapters loaded, each with its slot and path."""
        return self.core.loras()

    @property
    def lora_enabled(self) -> bool:
        """The engine keeps slots for LoRA adapters (--lora or --enable-lora)."""
        return self.core.runner.lora is not None

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (the next prompts compute from scratch)."""
        self.core.block_manager.reset_prefix_cache()

    # ---- requests ----------------------------------------------------------------------------
    def validate_request(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise ValueError (naming the problem) for input the model cannot take; changes nothing."""
        self.core.validate(prompt_token_ids, params)

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> Request:
        """Queue a request (validated first: ValueError for input the model cannot take)."""
        self.core.validate(prompt_token_ids, params)
        return self.enqueue(request_id, prompt_token_ids, params)

    def enqueue(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, client: str | None = None
    ) -> Request:
        """Queue a request whose input ``validate_request`` has accepted (it is not checked again);
        ValueError if the id is in use. `client` (who it runs for: a server labels each) takes turns with other clients
        where the scheduler divides steps between them (engine/fair_share.py)."""
        req = Request(
            request_id, list(prompt_token_ids), params, self.core.eos_token_ids, next(self._arrivals), client=client
        )
        self.core.add(req)
        self.output_processor.add(req)
        return req

    def abort(self, request_id: str) -> None:
        """Stop a request now and free its KV blocks (no-op for unknown or finished ids)."""
        self.output_processor.drop(request_id)
        self.core.finish(request_id, "abort")

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished

    def step(self) -> list[StepDelta]:
        """Run one engine step; a delta for every request that produced tokens or ended.

        A request's finishing delta carries its CompletionOutput (finish reason "error" and
        the message in ``error`` for a request that failed; the others go on).
        """
        step = self.core.step()
        return self.output_processor.process(step.outputs, step.seconds, step.kv_blocks_used)

    def stats(self) -> EngineStats:
        s, bm = self.core.scheduler, self.core.block_manager
        return EngineStats(
            len(s.running),
            len(s.waiting),
            bm.num_used_blocks,
            bm.num_free_blocks,
            bm.stats.hit_rate,
            s.num_prompt_tokens_computed,
            s.num_generated_tokens,
            s.num_preemptions,
            spec_steps=s.spec_steps,
            spec_draft_tokens=s.spec_draft_tokens,
            spec_accepted_tokens=s.spec_accepted_tokens,
        )
