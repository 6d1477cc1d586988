"""The engine core: owns every request's token state and the KV cache, one step at a time.

``EngineCore.step()`` is schedule -> execute -> update: the scheduler decides who computes
how many tokens (and holds their KV blocks), the runner runs the model and sampler, and
``Scheduler.update_from_output`` appends tokens, checks token stops and ends finished
requests. Text (detokenizing, stop strings, records) is the OutputProcessor's, above.
"""

from __future__ import annotations

import atexit
import logging
import time
import weakref
from dataclasses import dataclass

from tokenloom.config import EngineConfig
from tokenloom.engine.context_shift import check_keep
from tokenloom.engine.core_output import CoreOutput
from tokenloom.engine.cpu_share import CpuShare
from tokenloom.engine.kv_layout import report_window_pool, window_pool_blocks, window_pool_layers
from tokenloom.engine.request import Request
from tokenloom.engine.scheduler import Scheduler
from tokenloom.kv_cache.block_manager import BlockManager
from tokenloom.kv_cache.disk_tier import DiskTier, model_identity, namespace
from tokenloom.kv_cache.paged import PagedKVCache, kv_bytes_per_token
from tokenloom.kv_cache.window_pool import WindowPool
from tokenloom.loader.load import LoadedModel
from tokenloom.lora.manager import AdapterRef, LoRAManager, PreparedAdapter
from tokenloom.models.config import parse_dtype
from tokenloom.sampling.vocab import SamplingVocab
from tokenloom.sampling_params import SamplingParams
from tokenloom.spec_decode.proposer import SpecProposer
from tokenloom.structured.grammars import GrammarCompiler
from tokenloom.worker.model_runner import ModelRunner

logger = logging.getLogger("tokenloom")

# A step of this many tokens first reserves the heap for a full step's activations: below it
# the activations are a few MB, and a one-off run with a short prompt never pays the reserve.
RESERVE_FROM_TOKENS = 256


@dataclass(slots=True)
class CoreStep:
    """One step's outputs, and what the step cost (for explain records)."""

    outputs: list[CoreOutput]
    seconds: float = 0.0
    kv_blocks_used: int = 0


class EngineCore:
    """Model runner, KV cache, block manager, scheduler, grammar compiler and draft proposer.

    Not thread-safe: one caller at a time. Requests enter validated (``add``) and leave
    through ``Scheduler.finish`` only: at a token stop or scoring's end in a step's update,
    or by ``finish`` (aborts, stop strings matched above).
    """

    def __init__(self, config: EngineConfig, loaded: LoadedModel, progress: bool = False, peers=None) -> None:
        """`peers`: the group of the other ranks, where the model is split over processes."""
        self.config = config
        self.model_config = loaded.config
        self.max_model_len = loaded.config.max_model_len
        self.eos_token_ids = loaded.eos_token_ids
        logger.info("sampling settings a request leaves out: %s", loaded.sampling_defaults.describe())
        dtype = parse_dtype(config.dtype)
        assert loaded.local_config is not None  # LoadedModel.__post_init__ fills it
        self.cache_config = loaded.local_config  # a tensor-parallel rank caches its own KV heads only
        self.kv_bytes_per_token = kv_bytes_per_token(self.cache_config, dtype, config.kv_cache_dtype, loaded.kv_layers)
        recurrent = self.cache_config.recurrent is not None
        self._check_recurrent(config, recurrent)
        # a hybrid's sequences each hold a recurrent-state slot: the scheduler runs at most
        # max_num_seqs of them, and one more is kept for a borrowed table (embeddings, scoring)
        state_slots = config.scheduler.max_num_seqs + 1 if recurrent else 0
        window_layers, window = window_pool_layers(config, loaded, self.max_model_len, peers is not None)
        kv = self._make_cache(config, loaded, dtype, state_slots, window_layers, window)
        self._report_cache(kv)
        prefix_caching = config.cache.enable_prefix_caching and not recurrent
        pool = WindowPool(kv.num_window_blocks, window, kv.block_size) if window_layers else None
        self.block_manager = BlockManager(kv.num_blocks, kv.block_size, prefix_caching, state_slots, pool)
        if config.cache.prefix_cache_dir is not None:
            if config.lora is not None:
                raise ValueError(
                    "LoRA adapters with the prefix cache's disk tier (--prefix-cache-dir) are not implemented"
                )
            self._attach_disk_tier(config, loaded, kv, peers)
        self.runner = ModelRunner(
            loaded.model,
            kv,
            config.device,
            cuda_graphs=not config.enforce_eager,
            max_num_seqs=config.scheduler.max_num_seqs,
            max_model_len=self.max_model_len,
            peers=peers,
            pipeline=loaded.pipeline,
            recompute_tokens=config.scheduler.max_num_batched_tokens,
            lora=config.lora,
        )
        self.scheduler = Scheduler(config.scheduler, self.block_manager, self.max_model_len, self.runner.decodes_ahead)
        self.heap_reserved = False  # reserve_activation_memory has run (before the first large step)
        self.grammars = GrammarCompiler(
            loaded.tokenizer.backend.to_str, loaded.config.vocab_size, sorted(self.eos_token_ids)
        )
        self.sampling_vocab = SamplingVocab(loaded.tokenizer, loaded.config.vocab_size)
        self.proposer = (
            None
            if config.speculative is None
            else SpecProposer.create(
                config.speculative, self.runner, loaded.tokenizer, self.max_model_len, config.dtype, progress
            )
        )
        self._settle_context_shift(config, loaded, peers)
        for name, path in (config.lora.adapters if config.lora is not None else {}).items():
            self.add_lora(name, path)
            logger.info("LoRA adapter %s: %s", name, path)
        self.requests: dict[str, Request] = {}
        self.cpu_share = self._cpu_share(config)

    def _attach_disk_tier(self, config: EngineConfig, loaded: LoadedModel, kv: PagedKVCache, peers) -> None:
        """The prefix cache's disk tier under --prefix-cache-dir, its blocks keyed by what their bytes
        depend on (kv_cache/disk_tier.py); every cached block is saved at exit."""
        if peers is not None:
            raise ValueError("the prefix cache's disk tier is not implemented for a model split over processes")
        space = namespace(
            model_identity(config.model),
            config.dtype,
            config.kv_cache_dtype,
            config.quantization,
            kv.block_size,
            tuple(kv.layers),
            self.cache_config.num_kv_heads,
            self.cache_config.head_dim,
        )
        assert config.cache.prefix_cache_dir is not None  # the caller checked
        disk = DiskTier(config.cache.prefix_cache_dir, space, config.cache.prefix_cache_disk)
        self.block_manager.attach_disk(disk, kv.block_bytes, kv.load_block_bytes)
        atexit.register(_save_at_exit, weakref.ref(self.block_manager))
        logger.info("prefix cache disk tier: %s (up to %.1f GiB)", disk.root, disk.max_bytes / 2**30)

    def _settle_context_shift(self, config: EngineConfig, loaded: LoadedModel, peers) -> None:
        """Context shift asked for (True) must be possible: ValueError naming why not. Where the model
        allows it (None) it is on if possible, else off (said in the log)."""
        wanted = config.scheduler.context_shift
        if wanted is False:
            return
        try:
            self._check_context_shift(config, loaded, peers)
        except ValueError as e:
            if wanted:
                raise
            logger.info("context shift is off: %s", e)
            config.scheduler.context_shift = False
        else:
            config.scheduler.context_shift = True

    def _check_context_shift(self, config: EngineConfig, loaded: LoadedModel, peers) -> None:
        """ValueError naming what context shift cannot run with (engine/context_shift.py)."""
        name = self.model_config.architecture
        if peers is not None:
            raise ValueError("context shift is not implemented for a model split over processes")
        if config.speculative is not None:
            raise ValueError("context shift is not implemented with speculative decoding")
        try:
            loaded.model.key_turns(self.block_manager.block_size)
        except NotImplementedError as e:
            raise ValueError(f"{e} ({name})") from None
        check_keep(config.scheduler.context_keep, self.max_model_len, self.block_manager.block_size)

    def _check_recurrent(self, config: EngineConfig, recurrent: bool) -> None:
        """A hybrid model's recurrent state follows every computed token (kv_cache/recurrent.py):
        prefix caching is off for it (said in the log), speculative decoding refused."""
        if not recurrent:
            return
        if config.speculative is not None:
            raise ValueError(
                f"speculative decoding is not implemented for {self.model_config.architecture}: its recurrent "
                "layers' state would have advanced over rejected draft tokens"
            )
        if config.cache.enable_prefix_caching:
            logger.info(
                "prefix caching is off for %s: its recurrent layers' state after a prefix is not kept "
                "with the prefix's KV blocks",
                self.model_config.architecture,
            )

    def _make_cache(
        self, config: EngineConfig, loaded: LoadedModel, dtype, state_slots: int, window_layers, window: int
    ) -> PagedKVCache:
        """The KV cache within the configured budget, with `state_slots` sequences' recurrent state
        beside it (not counted in the budget: on the CPU its pages become resident as sequences
        write them, on a GPU it is allocated whole; the log says how much), and `window_layers`
        keeping blocks for windows of `window` positions in a pool of their own."""
        budget = self.kv_cache_budget = config.cache.resolve_memory(self.kv_bytes_per_token, self.max_model_len)
        args = (config.cache.block_size, dtype, config.device, config.kv_cache_dtype, loaded.kv_layers, state_slots)
        if not window_layers:
            return PagedKVCache.from_memory_budget(self.cache_config, budget, *args)
        s = config.scheduler
        wanted = window_pool_blocks(window, config.cache.block_size, s.max_num_seqs, s.max_num_batched_tokens)
        cached = len(self.cache_config.attention_layers(loaded.kv_layers))
        report_window_pool(window_layers, window, cached, self.kv_bytes_per_token, self.max_model_len, args[0])
        return PagedKVCache.from_memory_budget(self.cache_config, budget, *args, window_layers, wanted)

    @staticmethod
    def _cpu_share(config: EngineConfig) -> CpuShare | None:
        """On the CPU, in one process: the thread count that follows the free cores (cpu_share.py),
        unless `cpu_threads` fixes it."""
        import torch

        if torch.device(config.device).type != "cpu" or config.world_size > 1:
            return None
        if config.cpu_threads is not None:
            torch.set_num_threads(config.cpu_threads)
            return None
        return CpuShare(torch.get_num_threads())

    def _report_cache(self, kv: PagedKVCache) -> None:
        if kv.states is not None:
            per_seq = kv.states.bytes_per_sequence
            logger.info(
                "recurrent state: %d slots x %d layers = %.2f GiB (%.1f MiB a sequence, beside the KV cache), %s",
                kv.states.num_slots,
                len(kv.states.layers),
                kv.states.num_slots * per_seq / 2**30,
                per_seq / 2**20,
                "resident as sequences write it" if kv.device.type == "cpu" else "allocated now",
            )
        c, per_token = self.cache_config, self.kv_bytes_per_token
        layers, tensors = len(kv.layers), 1 if kv.latent else 2
        element_bytes = per_token // (tensors * layers * c.num_kv_heads * c.head_dim)
        element = {
            "int8": f"({c.head_dim} head_dim x 1 B int8 + 4 B scale)",
            "int4": f"({c.head_dim} head_dim x 0.5 B int4 + {c.head_dim // 32} x 2 B scales)",
        }.get(kv.kv_cache_dtype, f"{c.head_dim} head_dim x {element_bytes} B")
        what = "1 latent (keys and values)" if kv.latent else "2 (keys, values)"
        logger.info(
            "KV cache: %d tokens (%d blocks x %d) in %.2f GiB; per token %s x %d layers x %d kv_heads x %s = %d B",
            kv.num_tokens,
            kv.num_blocks,
            kv.block_size,
            kv.num_tokens * per_token / 2**30,
            what,
            layers,
            c.num_kv_heads,
            element,
            per_token,
        )

    def reserve_activation_memory(self) -> bool:
        """Grow the heap for one full step's activations now (ModelRunner.reserve_activation_memory):
        before the first step of RESERVE_FROM_TOKENS or more (a server also at start-up), and again
        after other code in the process has taken the freed heap. A step computes at most
        max_num_batched_tokens, and no more than the KV cache holds (each token it computes
        writes there): a one-context cache of 192 tokens needs no 8,192-token reserve."""
        self.heap_reserved = True
        step_tokens = min(self.config.scheduler.max_num_batched_tokens, self.runner.kv_cache.num_tokens)
        return self.runner.reserve_activation_memory(step_tokens, parse_dtype(self.config.dtype))

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise ValueError (naming the problem) for input the model cannot take; changes nothing."""
        ids = prompt_token_ids
        if not ids:
            raise ValueError("prompt is empty: give at least one token")
        if len(ids) + min(params.max_tokens, 1) > self.max_model_len:  # scoring (max_tokens=0) needs no room
            raise ValueError(
                f"prompt has {len(ids)} tokens but the context window is {self.max_model_len} "
                "tokens (the prompt must leave room for at least one new token)"
            )
        vocab = self.model_config.vocab_size
        bad = [t for t in ids if not (isinstance(t, int) and 0 <= t < vocab)]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary (size {vocab})")
        params.check_vocab(vocab)
        if self.config.scheduler.context_shift and params.context_keep is not None:
            check_keep(params.context_keep, self.max_model_len, self.block_manager.block_size)
        self.scheduler.check_fits(len(ids), params.max_tokens)
        if params.structured_output is not None:
            self.grammars.grammar(params.structured_output)  # compiles (cached); ValueError if invalid
        if params.lora is not None:
            self.lora_ref(params.lora)

    # ---- LoRA adapters ----------------------------------------------------------------------------
    def lora_ref(self, name: str) -> AdapterRef:
        """The loaded adapter `name`; ValueError naming the loaded ones otherwise."""
        lora = self.runner.lora
        if lora is None:
            raise ValueError(f"LoRA adapter {name!r} asked for, but this engine has none (start it with --lora)")
        if name not in lora.adapters:
            loaded = ", ".join(sorted(lora.adapters)) or "none"
            raise ValueError(f"no LoRA adapter named {name!r} is loaded (loaded: {loaded})")
        return lora.adapters[name]

    def prepare_lora(self, name: str, path: str) -> PreparedAdapter:
        """Read and check the adapter at `path` for loading as `name` (LoRAManager.prepare: any thread;
        ValueError: LoRA not enabled, or the adapter does not fit the model)."""
        return self._lora_manager().prepare(name, path)

    def add_lora(self, name: str, source: str | PreparedAdapter) -> AdapterRef:
        """Load a LoRA adapter (a path, or one ``prepare_lora`` read) under `name` (ValueError: LoRA not
        enabled, name taken, no free slot, or the adapter does not fit the model)."""
        return self._lora_manager().add(name, source)

    def _lora_manager(self) -> LoRAManager:
        if self.runner.lora is None:
            raise ValueError("this engine was started without LoRA support (--lora or --enable-lora)")
        return self.runner.lora

    def remove_lora(self, name: str) -> None:
        """Unload adapter `name` (ValueError if unknown or a request still uses it)."""
        ref = self.lora_ref(name)
        users = [r.request_id for r in self.requests.values() if r.lora is ref]
        if users:
            raise ValueError(f"LoRA adapter {name!r} is in use by {len(users)} request(s)")
        assert self.runner.lora is not None  # lora_ref found it
        self.runner.lora.remove(name)

    def loras(self) -> list[AdapterRef]:
        return [] if self.runner.lora is None else list(self.runner.lora.adapters.values())

    def add(self, request: Request) -> None:
        """Queue a request built from validated input (``validate``)."""
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        if request.params.structured_output is not None:
            request.matcher = self.grammars.matcher(request.params.structured_output)
        request.sampling_state = self.sampling_vocab.resolve(request.params)
        if request.params.lora is not None:
            request.lora = self.lora_ref(request.params.lora)
        self.scheduler.add(request)
        self.requests[request.request_id] = request

    def finish(self, request_id: str, reason: str = "abort", stop_reason: str | int | None = None) -> None:
        """End a request now and free its KV blocks (no-op for unknown or ended ids)."""
        req = self.requests.pop(request_id, None)
        if req is not None:
            self.scheduler.finish(req, reason, stop_reason)

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished

    def step(self) -> CoreStep:
        """Propose drafts, schedule, execute, update: one CoreOutput per request that moved."""
        started = time.perf_counter()
        if self.cpu_share is not None:
            self.cpu_share.before_step()
        if self.proposer is not None:
            self.proposer.propose_for(self.scheduler.running, self.scheduler.reserve_lookahead)
        sched = self.scheduler.schedule()
        if sched.is_empty:
            return CoreStep([])
        if not self.heap_reserved and sched.num_tokens >= RESERVE_FROM_TOKENS:
            self.reserve_activation_memory()  # in 2 MiB pages now, not page-faulted in 4 KiB by the step
        out = self.runner.execute(sched)
        seconds, used = time.perf_counter() - started, self.block_manager.num_used_blocks  # what the step ran on
        if self.cpu_share is not None:
            self.cpu_share.after_step(seconds)
        outputs = self.scheduler.update_from_output(sched, out)
        for o in outputs:
            if o.finished:
                self.requests.pop(o.request.request_id, None)
        return CoreStep(outputs, seconds, used)


def _save_at_exit(ref: weakref.ref) -> None:
    """At interpreter exit: the prefix cache's blocks to its disk tier, if the engine is alive."""
    blocks = ref()
    if blocks is not None:
        blocks.save_to_disk()
