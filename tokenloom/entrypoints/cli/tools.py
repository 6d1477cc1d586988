"""tokenloom's measuring and converting commands: eval-ppl | bench | quantize (commands.py registers them)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from tokenloom.entrypoints.cli.common import check_engine_flags, engine_flags, make_llm


def cmd_eval_ppl(args: argparse.Namespace) -> int:
    from tokenloom.eval.scoring import default_eval_text, perplexity

    check_engine_flags(args)
    text = default_eval_text() if args.text is None else Path(args.text).read_text(encoding="utf-8")
    llm = make_llm(args)
    ids = llm.tokenizer.encode(text)
    if args.max_eval_tokens:
        ids = ids[: args.max_eval_tokens]
    result = perplexity(llm.engine, ids, window=args.window)
    report = {
        "perplexity": result.perplexity,
        "tokens_scored": result.tokens_scored,
        "windows": result.windows,
        "window": args.window,
        "dtype": args.dtype,
        "quantization": args.quantization or "none",
        "kv_cache_dtype": args.kv_cache_dtype,
        "text": args.text or "tokenloom/data/declaration.txt",
    }
    if args.compare:
        report |= _compare(args, llm, ids)
    print(
        json.dumps(report)
        if args.json
        else f"perplexity {result.perplexity:.4f} over {result.tokens_scored} tokens "
        f"({result.windows} windows of {args.window}; dtype {args.dtype}, "
        f"quantization {args.quantization or 'none'}, kv cache {args.kv_cache_dtype})"
        + (
            f"\nagainst {args.compare}: same top-1 {100 * report['same_top1']:.2f}%, KL divergence mean "
            f"{report['kl_mean']:.5f}, p99 {report['kl_p99']:.4f} nats over {report['positions_compared']} "
            "positions (second halves of whole windows, as llama-perplexity scores)"
            if args.compare
            else ""
        )
    )
    return 0


def _compare(args: argparse.Namespace, llm, ids: list[int]) -> dict:
    """Same-top-1 and KL divergence against the same model loaded with dtype `args.compare`, on the
    positions llama-perplexity --kl-divergence scores: the second half of each whole window."""
    from tokenloom import LLM
    from tokenloom.eval.agreement import agreement, whole_windows

    reference = LLM(
        llm.engine.config.model,
        dtype=args.compare,
        max_model_len=args.max_model_len,
        kv_cache_memory=256 << 20,
        progress=True,
    )
    a = agreement(
        llm.engine, reference.engine, whole_windows(ids, args.window), window=args.window, skip=args.window // 2
    )
    return {
        "compare": args.compare,
        "same_top1": a.same_top1,
        "kl_mean": a.kl_mean,
        "kl_p99": a.kl_p99,
        "positions_compared": a.positions,
    }


def cmd_bench(args: argparse.Namespace) -> int:
    from tokenloom.eval.bench import measure

    check_engine_flags(args)
    llm = make_llm(args)
    r = measure(llm, args.prompt_tokens, args.new_tokens, args.runs)
    if args.json:
        print(json.dumps(r.as_dict()))
        return 0
    print(
        f"batch 1, prompt {r.prompt_tokens}, {r.new_tokens} new tokens, median of {args.runs} runs\n"
        f"  prefill   {r.prefill_tok_s:8.1f} tok/s   (time to first token {r.ttft_s * 1000:.0f} ms)\n"
        f"  decode    {r.decode_tok_s:8.1f} tok/s\n"
        f"  weights   {r.weight_bytes / 1e6:8.1f} MB     peak RSS {r.peak_rss_bytes / 1e6:.0f} MB"
    )
    return 0


def cmd_quantize(args: argparse.Namespace) -> int:
    from tokenloom.loader.hub import resolve_model
    from tokenloom.loader.save import save_quantized

    if not args.quantization:
        raise ValueError("quantize needs --quantization (int8, int4, int4-g64, int4-g128 or gguf)")
    modules = save_quantized(
        resolve_model(args.model, token=getattr(args, "hf_token", None)), args.output, args.quantization
    )
    print(
        f"saved {len(modules)} quantized layers ({args.quantization}) to {args.output}; "
        f"load it with: tokenloom generate -m {args.output}",
        file=sys.stderr,
    )
    return 0


def add_commands(sub) -> None:
    """Register eval-ppl, bench and quantize on the main parser's subparsers."""
    ppl = sub.add_parser(
        "eval-ppl",
        help="perplexity on a text (default: a shipped public-domain text)",
        description="Perplexity of the model as loaded (dtype, --quantization, --kv-cache-dtype) "
        "on fixed non-overlapping windows of a text.",
    )
    ppl.add_argument("--text", default=None, help="UTF-8 text file (default: tokenloom/data/declaration.txt)")
    ppl.add_argument("--window", type=int, default=512, help="tokens per window, each scored from scratch")
    ppl.add_argument("--max-eval-tokens", type=int, default=None, help="score only the first N tokens")
    ppl.add_argument("--json", action="store_true", help="print one JSON object")
    ppl.add_argument(
        "--compare",
        default=None,
        choices=["float32", "bfloat16"],
        metavar="DTYPE",
        help="also load the model with this dtype (float32: a GGUF file dequantized) and report "
        "the share of same top-1 tokens and the KL divergence against it, over the second "
        "half of each whole window (as llama-perplexity --kl-divergence; a partial last "
        "window is left out)",
    )
    engine_flags(ppl)
    ppl.set_defaults(func=cmd_eval_ppl)
    bench = sub.add_parser(
        "bench",
        help="batch-1 prefill and decode speed, memory",
        description="Time greedy generations at batch 1 (median of --runs after a warm-up).",
    )
    bench.add_argument("--prompt-tokens", type=int, default=128)
    bench.add_argument("--new-tokens", type=int, default=64)
    bench.add_argument("--runs", type=int, default=3)
    bench.add_argument("--json", action="store_true", help="print one JSON object")
    engine_flags(bench)
    bench.set_defaults(func=cmd_bench)
    quant = sub.add_parser(
        "quantize",
        help="save an int8/int4 copy of a model that loads without re-quantizing",
        description="Quantize MODEL's Linear layers and save an HF-style folder.",
    )
    quant.add_argument("-o", "--output", required=True, help="folder to write")
    engine_flags(quant)
    quant.set_defaults(func=cmd_quantize)
