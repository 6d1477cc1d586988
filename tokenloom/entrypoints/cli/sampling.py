"""The sampling and structured-output flags of `generate` and `chat`, and the SamplingParams they make.

A sampling flag left out takes the model's recommended setting, else llama.cpp's default
(tokenloom/sampling/defaults.py): the same policy as the server, the playground and ``LLM``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from tokenloom.sampling.defaults import FALLBACK, SamplingDefaults

_DEFAULT = "default: the model's recommended setting, else {}"


def sampling_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group(
        "sampling (see SamplingParams; a flag left out takes the model's recommended setting, else llama.cpp's default)"
    )
    fallback = FALLBACK.values
    g.add_argument(
        "--temp",
        "--temperature",
        type=float,
        default=None,
        dest="temperature",
        help=f"0 = greedy ({_DEFAULT.format(fallback['temperature'])})",
    )
    g.add_argument(
        "--top-k",
        type=int,
        default=None,
        help=f"keep the k most likely tokens, 0: off ({_DEFAULT.format(fallback['top_k'])})",
    )
    g.add_argument(
        "--top-p",
        type=float,
        default=None,
        help=f"nucleus sampling mass, 1: off ({_DEFAULT.format(fallback['top_p'])})",
    )
    g.add_argument(
        "--min-p",
        type=float,
        default=None,
        help=f"drop tokens below min_p x the top probability, 0: off ({_DEFAULT.format(fallback['min_p'])})",
    )
    g.add_argument(
        "--repetition-penalty",
        type=float,
        default=None,
        help=f"1: off ({_DEFAULT.format(fallback['repetition_penalty'])})",
    )
    g.add_argument("--frequency-penalty", type=float, default=0.0)
    g.add_argument("--presence-penalty", type=float, default=0.0)
    g.add_argument("--seed", type=int, default=None, help="same seed, same output")
    g.add_argument("-n", "--max-tokens", type=int, default=256, help="new tokens at most (default: 256)")
    g.add_argument("--min-tokens", type=int, default=0, help="no EOS/stop ids before this many tokens")
    g.add_argument(
        "--stop",
        action="append",
        default=[],
        metavar="TEXT",
        help="stop when this text appears (repeatable; cut from the output; in bash, a newline is $'\\n')",
    )
    g.add_argument("--stop-token-id", action="append", type=int, default=[], dest="stop_token_ids", metavar="ID")
    g.add_argument("--ignore-eos", action="store_true", help="keep going past EOS")
    chain_flags(p)
    s = p.add_argument_group("structured output (one of)").add_mutually_exclusive_group()
    s.add_argument("--json", action="store_true", dest="json_object", help="the output is a JSON object")
    s.add_argument(
        "--json-schema",
        default=None,
        metavar="SCHEMA",
        help="the output is JSON valid against this schema (a .json file, or JSON text)",
    )
    s.add_argument("--regex", default=None, help="the whole output matches this regular expression")
    s.add_argument("--grammar", default=None, metavar="FILE", help="the output follows this Lark grammar file")


def chain_flags(p: argparse.ArgumentParser) -> None:
    """The rest of the sampler chain (llama.cpp's flag names where it has them); each off by default."""
    g = p.add_argument_group("loop breakers and more samplers (off unless given)")
    g.add_argument(
        "--no-repeat-ngram-size",
        type=int,
        default=None,
        metavar="N",
        help="never repeat an n-gram of the prompt + output (HF)",
    )
    g.add_argument(
        "--dry-multiplier",
        type=float,
        default=None,
        help="DRY: penalize tokens that extend a repeat, by multiplier x base^(length - allowed); 0.8 "
        "is a common start",
    )
    g.add_argument("--dry-base", type=float, default=None, help="DRY's growth per repeated token (default 1.75)")
    g.add_argument("--dry-allowed-length", type=int, default=None, help="DRY: repeats this long are free (default 2)")
    g.add_argument(
        "--dry-penalty-last-n",
        type=int,
        default=None,
        help="DRY looks at this many last tokens (-1: all, the default; 0: off)",
    )
    g.add_argument(
        "--dry-sequence-breaker",
        action="append",
        default=None,
        dest="dry_sequence_breakers",
        metavar="TEXT",
        help='a repeat never spans this text (repeatable; default \n : " *)',
    )
    g.add_argument(
        "--repeat-last-n",
        "--repetition-penalty-range",
        type=int,
        default=None,
        dest="repetition_penalty_range",
        help="the penalties see this many last tokens (0: all)",
    )
    g.add_argument(
        "--bad-word",
        action="append",
        default=None,
        dest="bad_words",
        metavar="WORD",
        help="never generate this word (repeatable)",
    )
    g.add_argument(
        "--typical-p",
        "--typical",
        type=float,
        default=None,
        dest="typical_p",
        help="locally typical sampling mass (1: off)",
    )
    g.add_argument("--top-n-sigma", type=float, default=None, help="keep logits within n std devs of the top")
    g.add_argument("--xtc-probability", type=float, default=None, help="exclude top choices: how often (0: off)")
    g.add_argument("--xtc-threshold", type=float, default=None, help="... of tokens above this probability (0.1)")
    g.add_argument("--epsilon-cutoff", type=float, default=None, help="drop tokens below this probability")
    g.add_argument("--eta-cutoff", type=float, default=None, help="entropy-scaled epsilon cutoff (HF)")
    g.add_argument(
        "--mirostat",
        type=int,
        default=None,
        choices=(0, 1, 2),
        help="mirostat version (replaces top-k ... eta; default 0: off)",
    )
    g.add_argument(
        "--mirostat-tau",
        "--mirostat-ent",
        type=float,
        default=None,
        dest="mirostat_tau",
        help="mirostat's target surprise (default 5)",
    )
    g.add_argument(
        "--mirostat-eta",
        "--mirostat-lr",
        type=float,
        default=None,
        dest="mirostat_eta",
        help="mirostat's learning rate (default 0.1)",
    )
    g.add_argument(
        "--samplers",
        default=None,
        metavar="A;B;...",
        help="the filters' order, e.g. llama.cpp's 'top_k;typ_p;top_p;min_p;xtc;temperature' (default "
        "temperature;top_n_sigma;top_k;typical_p;top_p;min_p;xtc;epsilon_cutoff;eta_cutoff)",
    )


CHAIN_FLAGS = (
    "no_repeat_ngram_size",
    "dry_multiplier",
    "dry_base",
    "dry_allowed_length",
    "dry_penalty_last_n",
    "dry_sequence_breakers",
    "repetition_penalty_range",
    "bad_words",
    "typical_p",
    "top_n_sigma",
    "xtc_probability",
    "xtc_threshold",
    "epsilon_cutoff",
    "eta_cutoff",
    "mirostat",
    "mirostat_tau",
    "mirostat_eta",
    "samplers",
)


def _read_flag_file(flag: str, path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError as e:
        raise ValueError(f"{flag}: cannot read {path!r} ({e.strerror or e})") from None


def _schema_text(value: str) -> str:
    """--json-schema's JSON: the value itself when it is JSON text, else the file it names."""
    stripped = value.lstrip()
    if stripped.startswith(("{", "[")) or stripped in ("true", "false"):
        return value
    if not Path(value).is_file():
        raise ValueError(f"--json-schema: no file {value!r} (give a .json file, or the schema as JSON text)")
    return _read_flag_file("--json-schema", value)


def structured_output(args: argparse.Namespace):
    """--json / --json-schema / --regex / --grammar -> StructuredOutput or None."""
    from tokenloom.structured import StructuredOutput

    if getattr(args, "json_object", False):
        return StructuredOutput.json()
    if getattr(args, "json_schema", None):
        text = _schema_text(args.json_schema)
        try:
            json.loads(text)
        except ValueError as e:
            where = "" if text is args.json_schema else f" in {args.json_schema!r}"
            raise ValueError(f"--json-schema: invalid JSON{where}: {e}") from None
        return StructuredOutput.json(text)
    if getattr(args, "regex", None):
        return StructuredOutput.regex(args.regex)
    if getattr(args, "grammar", None):
        return StructuredOutput.grammar(_read_flag_file("--grammar", args.grammar))
    return None


def _given(args: argparse.Namespace) -> dict[str, Any]:
    """The SamplingParams fields the flags set (None: left out, for the defaults to fill)."""
    chain = {name: value for name in CHAIN_FLAGS if (value := getattr(args, name, None)) is not None}
    return dict(
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        frequency_penalty=args.frequency_penalty,
        presence_penalty=args.presence_penalty,
        seed=args.seed,
        max_tokens=args.max_tokens,
        min_tokens=args.min_tokens,
        stop=args.stop,
        stop_token_ids=args.stop_token_ids,
        ignore_eos=args.ignore_eos,
        lora=one_adapter(args),
        **chain,
    )


def one_adapter(args: argparse.Namespace) -> str | None:
    """The name of the LoRA adapter `--lora NAME=PATH` gave (generate and chat run through it); None
    without one, a ValueError for several (one conversation runs one adapter)."""
    from tokenloom.config import parse_lora_modules

    adapters = parse_lora_modules(getattr(args, "lora", None) or [])
    if len(adapters) > 1:
        raise ValueError(f"--lora: this command runs one adapter, got {len(adapters)} ({', '.join(adapters)})")
    return next(iter(adapters), None)


def sampling_params(args: argparse.Namespace, defaults: SamplingDefaults = FALLBACK, constraint=None):
    """SamplingParams of the flags, those left out from `defaults` (the model's, once it is loaded;
    llama.cpp's to check the flags before it is). `constraint`: structured_output(args), if already made."""
    return defaults.params(**_given(args), structured_output=constraint or structured_output(args))
