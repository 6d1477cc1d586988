"""What every CLI command that loads a model shares: the engine flags, their early check,
and the LLM they build (used by cli.py and cli_tools.py)."""

from __future__ import annotations

import argparse

from tokenloom.quant.scheme import CHOICES as QUANT_CHOICES


def engine_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model and engine")
    g.add_argument("-m", "--model", default=None,
                   help="HF folder (config.json + safetensors + tokenizer.json) or .gguf file; "
                        "default: SmolLM2-135M-Instruct, pulled on first use")
    g.add_argument("-t", "--threads", type=int, default=None, metavar="N",
                   help="CPU threads, always N (default: one per physical core, fewer while other processes "
                        "keep cores busy: threads that lose their core stall the others at every step)")
    g.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                   help="where the model runs. auto (default): the GPU where CUDA has one, else the CPU")
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="weight and activation dtype. auto (default): on the CPU float32, and a GGUF file's "
                        "quantized blocks kept as stored; on a GPU bfloat16 (a GGUF file dequantized to it at "
                        "load); float32/bfloat16/float16 dequantize a GGUF file to that dtype (bf16/fp16 are slow "
                        "on most CPUs)")
    g.add_argument("--enforce-eager", action="store_true",
                   help="GPU: run decode steps op by op instead of replaying CUDA graphs captured at start-up")
    g.add_argument("--decode-steps", type=int, default=None, metavar="N",
                   help="decode up to N tokens per engine step where every running request allows it, each fed "
                        "back on the device (one host round trip per N tokens; default: 8 on a GPU with CUDA "
                        "graphs, else 1)")
    g.add_argument("-c", "--ctx-size", "--max-model-len", dest="max_model_len", type=int, default=None, metavar="N",
                   help="context window in tokens (default: the model's; -c/--ctx-size as llama.cpp, --max-model-len "
                        "as vLLM)")
    g.add_argument("--kv-cache-memory", type=float, default=None, metavar="GIB",
                   help="memory for the KV cache in GiB (default: what one full context needs, at most 1; "
                        "serve: 1; or see --kv-cache-fraction)")
    g.add_argument("--kv-cache-fraction", type=float, default=None, metavar="F",
                   help="size the KV cache as this fraction of the memory available now")
    g.add_argument("--no-prefix-caching", action="store_false", dest="enable_prefix_caching",
                   help="do not reuse the KV cache of shared prompt prefixes")
    g.add_argument("--speculative", default=None, metavar="SPEC",
                   help="speculative decoding (lossless): 'ngram,k=4' (prompt lookup) or 'draft=PATH,k=4' "
                        "(a smaller model with the same tokenizer); options max_batch=N (plain decoding above "
                        "N running requests, default 8), min_acceptance=F, ngram_max/ngram_min")
    g.add_argument("--quantization", default=None, choices=list(QUANT_CHOICES),
                   help="weight-only quantization of every Linear: int8 (per-channel), int4 (groups of 32; "
                        "int4-g64/-g128 for larger groups), gguf (keep a GGUF file's own Q8_0/Q4_0/Q4_1 blocks)")
    g.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "int8"],
                   help="int8: store keys/values as int8 with a scale per token and head (half of bf16, "
                        "a quarter of float32)")
    g.add_argument("-tp", "--tensor-parallel-size", type=int, default=1, metavar="N",
                   help="split the model over N processes (torch.distributed, gloo on CPU): started on this machine, "
                        "or under torchrun (--nnodes, --master-addr) the same command on every node, rank 0 "
                        "serving (Llama, Mistral, Qwen2/3 and their MoE models)")
    g.add_argument("-pp", "--pipeline-parallel-size", type=int, default=1, metavar="N",
                   help="split the model's layers into N stages, one process each, micro-batches in flight (for "
                        "slow links between machines, where it beats tensor parallelism); launched as "
                        "--tensor-parallel-size")


def resolve_device(name: str) -> str:
    """auto -> cuda where torch sees a GPU, else cpu; cuda without one is a ValueError."""
    import torch
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: torch sees no CUDA device here (a CPU build of torch, or no GPU)")
    return name


def _engine_settings(args: argparse.Namespace) -> dict:
    memory = None if args.kv_cache_memory is None else int(args.kv_cache_memory * (1 << 30))
    return dict(device=resolve_device(getattr(args, "device", "cpu")),
                enforce_eager=getattr(args, "enforce_eager", False), decode_steps=getattr(args, "decode_steps", None),
                cpu_threads=getattr(args, "threads", None),
                dtype=args.dtype,
                max_model_len=args.max_model_len, kv_cache_memory=memory,
                kv_cache_fraction=args.kv_cache_fraction, enable_prefix_caching=args.enable_prefix_caching,
                max_num_seqs=getattr(args, "max_num_seqs", 64), fair_share_seqs=getattr(args, "fair_share_seqs", None),
                speculative=args.speculative, quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype,
                kv_cache_contexts=getattr(args, "kv_cache_contexts", 1),
                tensor_parallel_size=getattr(args, "tensor_parallel_size", 1),
                pipeline_parallel_size=getattr(args, "pipeline_parallel_size", 1))


def make_llm(args: argparse.Namespace):
    """The LLM the flags describe. Under torchrun, a rank other than 0 does not return: it loads its
    share of the model and serves rank 0 until rank 0 leaves (then the process exits)."""
    from tokenloom.distributed.launch import torchrun_rank
    from tokenloom.llm import LLM, engine_config
    if getattr(args, "threads", None):
        import torch
        torch.set_num_threads(args.threads)         # torch's and the kernels' OpenMP pool
    split = getattr(args, "tensor_parallel_size", 1) * getattr(args, "pipeline_parallel_size", 1) > 1
    joined = torchrun_rank() if split else None
    if joined is not None and joined[0] > 0:
        from tokenloom.distributed.worker import worker_main
        worker_main(*joined, "env://", engine_config(args.model, **_engine_settings(args)), args.threads)
        raise SystemExit(0)
    return LLM(args.model, progress=True, **_engine_settings(args))


def check_engine_flags(args: argparse.Namespace) -> None:
    """Fail on bad engine flags before the (slow) model load."""
    resolve_device(getattr(args, "device", "cpu"))
    if getattr(args, "decode_steps", None) is not None and args.decode_steps < 1:
        raise ValueError(f"--decode-steps must be >= 1, got {args.decode_steps}")
    if getattr(args, "threads", None) is not None and args.threads < 1:
        raise ValueError(f"--threads must be >= 1, got {args.threads}")
    for flag in ("tensor_parallel_size", "pipeline_parallel_size"):
        if getattr(args, flag, 1) < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if args.speculative:
        from tokenloom.config import SpeculativeConfig
        SpeculativeConfig.parse(args.speculative)


def check_chat_template_early(args: argparse.Namespace, flag: str = "--chat") -> None:
    """A chat (`flag`) on a model without a chat template: a ValueError before the weights load."""
    from tokenloom.hub import resolve_model
    from tokenloom.loader.load import chat_template_of
    path = resolve_model(args.model)
    if chat_template_of(path) is None:
        raise ValueError(f"{flag}: the model at {path} has no chat template (a base model?); give it a plain "
                         "prompt with `tokenloom generate` (without --chat)")


def check_port_free(host: str, port: int) -> None:
    """ValueError, before the model loads, when nothing can listen on host:port (another server there)."""
    import socket
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)     # as uvicorn binds
        try:
            s.bind((host, port))
        except OSError as e:
            raise ValueError(f"cannot listen on {host}:{port}: {e.strerror} (another server there? give --port "
                             "or --host)") from None


# A token is at least one byte of text (plus a chat template's few), so a prompt this short fits any
# context worth running; longer ones are counted before the weights load.
_SURELY_FITS_BYTES = 2048


def check_prompt_early(args: argparse.Namespace, prompt: str) -> None:
    """ValueError, before any weights are read, when `prompt` is longer than the context the model
    will run at (only the config and tokenizer are read, and only for a long prompt)."""
    if len(prompt.encode("utf-8", "surrogatepass")) <= _SURELY_FITS_BYTES:
        return
    from tokenloom.hub import resolve_model
    from tokenloom.loader.load import load_checkpoint
    ckpt = load_checkpoint(resolve_model(args.model))
    context = args.max_model_len or ckpt.config.max_model_len
    tokens = len(ckpt.tokenizer.encode(prompt))
    if tokens >= context:
        raise ValueError(f"the prompt is {tokens} tokens, but the context is {context} (--max-model-len): "
                         "shorten the prompt")


class GenerationSummary:
    """The line `generate` prints on stderr when it is done: tokens, speed, time to first token."""

    def __init__(self, prompt_tokens: int) -> None:
        import time
        self.clock = time.perf_counter
        self.prompt_tokens, self.tokens = prompt_tokens, 0
        self.start, self.first = self.clock(), None

    def add(self, new_tokens: int) -> None:
        if new_tokens and self.first is None:
            self.first = self.clock()
        self.tokens += new_tokens

    def __str__(self) -> str:
        end = self.clock()
        first = self.first if self.first is not None else end
        rate = (self.tokens - 1) / (end - first) if self.tokens > 1 and end > first else 0.0
        return (f"{self.tokens} tokens, {rate:.1f} tok/s (prompt {self.prompt_tokens} tokens, first token "
                f"after {first - self.start:.2f} s)")
