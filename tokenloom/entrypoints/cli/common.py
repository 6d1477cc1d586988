"""What every CLI command that loads a model shares: the engine flags (EngineArgs), their early
check, the LLM they build, and the other checks made before the weights load."""

from __future__ import annotations

import argparse
import dataclasses

from tokenloom.engine.args import EngineArgs
from tokenloom.entrypoints.cli.collection import resume_collection

# The one command-specific default of the engine options: a CLI session runs one conversation, so
# its KV cache holds one full context (serve keeps EngineArgs' 1 GiB).
SESSION_DEFAULTS = {"kv_cache_contexts": 1}


def engine_flags(p: argparse.ArgumentParser, command: str | None = None, defaults: dict | None = None) -> None:
    """The model and engine flags (EngineArgs) `command` shows; without `defaults`, a session's."""
    EngineArgs.add_cli_args(p, command, SESSION_DEFAULTS if defaults is None else defaults)


def make_llm(args: argparse.Namespace):
    """The LLM the flags describe. Under torchrun, a rank other than 0 does not return: it loads its
    share of the model and serves rank 0 until rank 0 leaves (then the process exits)."""
    from tokenloom.distributed.launch import torchrun_rank
    from tokenloom.entrypoints.llm import LLM

    options = EngineArgs.from_cli_args(args)
    if options.cpu_threads:
        import torch

        torch.set_num_threads(options.cpu_threads)  # torch's and the kernels' OpenMP pool
    joined = torchrun_rank() if options.tensor_parallel_size * options.pipeline_parallel_size > 1 else None
    if joined is not None and joined[0] > 0:
        from tokenloom.distributed.worker import worker_main

        resume_collection()  # a worker rank runs until rank 0 leaves
        worker_main(*joined, "env://", options.create_engine_config(), options.cpu_threads)
        raise SystemExit(0)
    fields = dataclasses.asdict(options)
    llm = LLM(fields.pop("model"), progress=True, **fields)
    resume_collection()  # start-up's objects are loaded for good
    return llm


def check_engine_flags(args: argparse.Namespace) -> None:
    """Fail on bad engine flags before the (slow) model load: a ValueError naming the flag."""
    try:
        EngineArgs.from_cli_args(args).check()
    except ValueError as e:
        raise ValueError(_as_flags(str(e))) from None


def _as_flags(message: str) -> str:
    """An EngineArgs error in the command line's words: `max_num_seqs must ...` -> `--max-num-seqs must ...`."""
    for f in dataclasses.fields(EngineArgs):
        flags = [flag for flag in f.metadata.get("flags", ()) if flag.startswith("--")]
        if flags and message.startswith(f"{f.name} "):
            return flags[0] + message[len(f.name) :]
    return message


def check_chat_template_early(args: argparse.Namespace, flag: str = "--chat") -> None:
    """A chat (`flag`) on a model without a chat template: a ValueError before the weights load."""
    from tokenloom.loader.hub import resolve_model
    from tokenloom.loader.load import chat_template_of

    path = resolve_model(args.model, token=getattr(args, "hf_token", None))
    if chat_template_of(path) is None:
        raise ValueError(
            f"{flag}: the model at {path} has no chat template (a base model?); give it a plain "
            "prompt with `tokenloom generate` (without --chat)"
        )


def check_port_free(host: str, port: int) -> None:
    """ValueError, before the model loads, when nothing can listen on host:port (another server there)."""
    import socket

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        try:
            s.bind((host, port))
        except OSError as e:
            raise ValueError(
                f"cannot listen on {host}:{port}: {e.strerror} (another server there? give --port or --host)"
            ) from None


# A token is at least one byte of text (plus a chat template's few), so a prompt this short fits any
# context worth running; longer ones are counted before the weights load.
_SURELY_FITS_BYTES = 2048


def check_prompt_early(args: argparse.Namespace, prompt: str) -> None:
    """ValueError, before any weights are read, when `prompt` is longer than the context the model
    will run at (only the config and tokenizer are read, and only for a long prompt)."""
    if len(prompt.encode("utf-8", "surrogatepass")) <= _SURELY_FITS_BYTES:
        return
    from tokenloom.loader.hub import resolve_model
    from tokenloom.loader.load import load_checkpoint

    ckpt = load_checkpoint(resolve_model(args.model, token=getattr(args, "hf_token", None)))
    context = args.max_model_len or ckpt.config.max_model_len
    tokens = len(ckpt.tokenizer.encode(prompt))
    if tokens >= context:
        raise ValueError(
            f"the prompt is {tokens} tokens, but the context is {context} (--max-model-len): shorten the prompt"
        )


class GenerationSummary:
    """The line `generate` prints on stderr when it is done: tokens, speed, time to first token."""

    def __init__(self, prompt_tokens: int) -> None:
        import time

        self.clock = time.perf_counter
        self.prompt_tokens, self.tokens = prompt_tokens, 0
        self.start = self.clock()
        self.first: float | None = None

    def add(self, new_tokens: int) -> None:
        if new_tokens and self.first is None:
            self.first = self.clock()
        self.tokens += new_tokens

    def __str__(self) -> str:
        end = self.clock()
        first = self.first if self.first is not None else end
        rate = (self.tokens - 1) / (end - first) if self.tokens > 1 and end > first else 0.0
        return (
            f"{self.tokens} tokens, {rate:.1f} tok/s (prompt {self.prompt_tokens} tokens, first token "
            f"after {first - self.start:.2f} s)"
        )
