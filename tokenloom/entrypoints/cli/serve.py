"""`tokenloom serve`: the HTTP server's command, its flags (the server's, the models served by
name, admission control, the engine's) and its start-up checks, made before any model loads."""

from __future__ import annotations

import argparse
import sys

from tokenloom.entrypoints.cli.common import check_engine_flags, check_port_free, engine_flags, make_llm
from tokenloom.tool_calling.formats import FORMATS
from tokenloom.tool_calling.reasoning import PARSERS as REASONING_PARSERS


def cmd_serve(args: argparse.Namespace) -> int:
    import os

    from tokenloom.engine.args import EngineArgs
    from tokenloom.engine.async_engine import AsyncLLMEngine
    from tokenloom.entrypoints.server import build_app, graceful, served_names
    from tokenloom.entrypoints.server.admission import AdmissionLimits
    from tokenloom.entrypoints.server.catalog import engine_loader, known_models
    from tokenloom.tool_calling.messages import load_tools

    check_engine_flags(args)
    check_port_free(args.host, args.port)  # before the (slow) model load
    playground_tools = load_tools(args.tools) if args.tools else None  # a bad file fails before the model loads
    limits = AdmissionLimits(  # checked before the model loads: a bad bound fails at once
        max_seqs_per_request=args.max_seqs_per_request,
        max_pending_seqs=args.max_pending_seqs,
        max_pending_tokens=args.max_pending_tokens,
        max_running_per_request=args.max_running_per_request,
        max_running_per_client=args.max_running_per_client,
        default_max_tokens=args.default_max_tokens,
    )
    policy = _load_policy(args)  # checked before the model loads too
    engine = AsyncLLMEngine.build(lambda: make_llm(args).engine)  # built on the thread that steps it
    engine.prepare_for_serving()
    api_key = args.api_key or os.environ.get("TOKENLOOM_API_KEY")
    name, *aliases = served_names(args.model, engine.model_path, args.served_model_name)
    primary_path = engine.model_path
    load_engine = engine_loader(EngineArgs.from_cli_args(args), primary_path)
    app = build_app(
        engine,
        name,
        model_aliases=tuple(aliases),
        api_key=api_key,
        max_body_bytes=args.max_body_bytes,
        body_timeout_s=args.body_timeout,
        body_deadline_s=args.body_deadline,
        limits=limits,
        allowed_hosts=_allowed_hosts(args, api_key),
        log_json=args.log_format == "json",
        tool_call_parser=args.tool_call_parser,
        reasoning_parser=args.reasoning_parser,
        playground_tools=playground_tools,
        catalog=lambda: known_models(primary_path),
        load_engine=load_engine,
        load_policy=policy,
    )
    del engine  # the app holds it now: were it kept here, its memory would outlive its unloading
    base = f"http://{args.host}:{args.port}"
    others = [n for n in app.state.models.entries if n != name]
    more = f"; {len(others)} more by name, loaded on first use: {', '.join(others)}" if others else ""
    if app.state.models.adapters:
        more += f"; LoRA adapters by name: {', '.join(app.state.models.adapters)}"
    print(
        f"tokenloom: serving {name!r} on {base}/v1 (playground: {base}/){' (API key required)' if api_key else ''}"
        + more,
        file=sys.stderr,
    )
    graceful.serve(
        app,
        app.state.models,
        header_timeout_s=args.body_timeout,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        access_log=False,  # ours: a line per request
        timeout_graceful_shutdown=args.shutdown_timeout,
        limit_concurrency=args.max_connections,
        proxy_headers=True,
        forwarded_allow_ips=args.forwarded_allow_ips,
    )
    return 0


_POLICY_FLAGS = {"max_loaded": "--max-loaded-models", "load_timeout_s": "--load-timeout"}


def _load_policy(args: argparse.Namespace):
    """The LoadPolicy serve's flags give; a ValueError naming the flag for a bad one."""
    from tokenloom.entrypoints.server.load_policy import LoadPolicy

    try:
        return LoadPolicy(
            keep_alive_s=args.keep_alive,
            max_loaded=args.max_loaded_models,
            memory_bytes=args.models_memory,
            load_timeout_s=args.load_timeout,
            kv_bound_bytes=args.kv_cache_memory or 1 << 30,
        )
    except ValueError as e:
        field = str(e).split(" ", 1)[0]
        raise ValueError(_POLICY_FLAGS.get(field, field) + str(e)[len(field) :]) from None


def _allowed_hosts(args: argparse.Namespace, api_key: str | None) -> tuple[str, ...] | None:
    """--allowed-hosts, else: bound to a loopback address with no API key, only local names (a web page
    could otherwise reach the server through DNS rebinding); else any."""
    from tokenloom.entrypoints.server.middleware import LOCAL_HOSTS

    if args.allowed_hosts:
        return tuple(h.strip() for h in args.allowed_hosts.split(",") if h.strip())
    if api_key is None and args.host in ("127.0.0.1", "localhost", "::1"):
        return LOCAL_HOSTS
    return None


def _duration(text: str) -> float:
    """--keep-alive's value: seconds, or a duration as ollama takes it (5m, 1h30m, -1)."""
    from tokenloom.entrypoints.server.load_policy import duration_seconds

    try:
        return duration_seconds(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _model_flags(serve: argparse.ArgumentParser) -> None:
    """serve's flags for the models it loads on demand (tokenloom/entrypoints/server/served_models.py)."""
    from tokenloom.entrypoints.server.load_policy import LoadPolicy

    d = LoadPolicy()
    group = serve.add_argument_group(
        "models by name",
        "every model `tokenloom list` shows is served by name; one is loaded when a request first names it",
    )
    group.add_argument(
        "--keep-alive",
        type=_duration,
        default=d.keep_alive_s,
        metavar="DURATION",
        help="unload a model (other than --model) idle this long: seconds or 5m, 1h; -1 never "
        "(default: 5m; a request's keep_alive sets its model's)",
    )
    group.add_argument(
        "--max-loaded-models",
        type=int,
        default=d.max_loaded,
        metavar="N",
        help=f"models loaded at once; another unloads the least recently used idle one (default: {d.max_loaded})",
    )
    group.add_argument(
        "--models-memory",
        type=_gib_flag,
        default=None,
        metavar="GIB",
        help="memory the loaded models may hold, weights on disk plus each KV cache's budget (default: 80%% of RAM)",
    )
    group.add_argument(
        "--load-timeout",
        type=float,
        default=d.load_timeout_s,
        metavar="S",
        help=f"how long a request waits for its model to load before a 503 (default: {d.load_timeout_s:g})",
    )


def _gib_flag(text: str) -> int:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of GiB") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: give a positive number of GiB")
    return int(value * 2**30)


def _admission_flags(serve: argparse.ArgumentParser) -> None:
    """serve's bounds on the work it accepts (tokenloom/entrypoints/server/admission.py)."""
    from tokenloom.entrypoints.server.admission import AdmissionLimits

    d = AdmissionLimits()
    group = serve.add_argument_group(
        "admission control",
        "how much work the server accepts, and turns between requests (beyond a bound: 400, or 429 with Retry-After)",
    )
    group.add_argument(
        "--max-seqs-per-request",
        type=int,
        default=d.max_seqs_per_request,
        metavar="N",
        help=f"prompts x n x beams in one request (default: {d.max_seqs_per_request})",
    )
    group.add_argument(
        "--max-pending-seqs",
        type=int,
        default=d.max_pending_seqs,
        metavar="N",
        help=f"sequences accepted and not finished, all requests (default: {d.max_pending_seqs})",
    )
    group.add_argument(
        "--max-pending-tokens",
        type=int,
        default=d.max_pending_tokens,
        metavar="N",
        help=f"prompt tokens of those sequences (default: {d.max_pending_tokens})",
    )
    group.add_argument(
        "--max-running-per-request",
        type=int,
        default=d.max_running_per_request,
        metavar="N",
        help="a request's sequences in the running batch at once, so one request cannot take "
        f"every slot (default: {d.max_running_per_request})",
    )
    group.add_argument(
        "--max-running-per-client",
        type=int,
        default=d.max_running_per_client,
        metavar="N",
        help="a client's sequences in the running batch at once over all its requests; a "
        "client is its requests' 'user' field, else its address "
        f"(default: {d.max_running_per_client})",
    )
    group.add_argument(
        "--default-max-tokens",
        type=int,
        default=d.default_max_tokens,
        metavar="N",
        help=f"new tokens for requests that give no max_tokens (default: {d.default_max_tokens})",
    )
    group.add_argument(
        "--body-timeout",
        type=float,
        default=30.0,
        metavar="S",
        help="request headers not all in S seconds after the request began, or a body that "
        "stops arriving for S seconds, are answered 408 (default: 30)",
    )
    group.add_argument(
        "--body-deadline",
        type=float,
        default=120.0,
        metavar="S",
        help="a request body not all there S seconds after it began (however steadily it "
        "trickles in) is answered 408 (default: 120)",
    )
    group.add_argument(
        "--forwarded-allow-ips",
        default="127.0.0.1",
        metavar="IPS",
        help="peers trusted as reverse proxies (comma-separated, * for any): a request through "
        "one is the client X-Forwarded-For names, for per-client turns and the log "
        "(default: 127.0.0.1, as uvicorn)",
    )


def add_serve(sub) -> None:
    """`serve`: the HTTP server's flags, its admission bounds and the engine's."""
    serve = sub.add_parser(
        "serve",
        help="OpenAI-compatible HTTP server (completions, chat, metrics)",
        description="Serve OpenAI's API (/v1/chat/completions, /v1/completions, /v1/responses, /v1/models), "
        "ollama's (/api/chat, /api/generate, /api/tags, /api/pull, ...), Anthropic's (/v1/messages), /health "
        "and /metrics (Prometheus). --model is loaded at start; every model `tokenloom list` shows is served "
        "by name too, loaded when a request first names it (each on its own continuously batched engine).",
    )
    serve.add_argument("--host", default="127.0.0.1", help="interface to bind (default: 127.0.0.1, local only)")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' on /v1 (default: $TOKENLOOM_API_KEY, or none)",
    )
    serve.add_argument(
        "--served-model-name",
        default=None,
        help="the model id clients use (default: the name it was pulled by, and its file name)",
    )
    serve.add_argument("--max-body-bytes", type=int, default=4 << 20, help="largest request body (default: 4 MiB)")
    serve.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        metavar="S",
        help="on SIGINT/SIGTERM, let requests in flight finish for this long, then abort them",
    )
    _admission_flags(serve)
    _model_flags(serve)
    serve.add_argument(
        "--tool-call-parser",
        default="auto",
        choices=["auto", *FORMATS],
        help="how replies write tool calls (default: read from the chat template; generic: "
        "tokenloom offers the tools in a system message of its own; harmony: gpt-oss; deepseek_v3: "
        "DeepSeek-V3/R1; deepseek_v31: DeepSeek-V3.1; command_r7b: Command R7B; mistral_v11: Mistral "
        "Small 3.2, Devstral, Magistral; qwen3_coder: Qwen3-Coder's XML tags)",
    )
    serve.add_argument(
        "--reasoning-parser",
        default="auto",
        choices=list(REASONING_PARSERS),
        help="<think> reasoning (or harmony's analysis channel: gpt-oss) as reasoning_content (default: "
        "from the template)",
    )
    serve.add_argument(
        "--tools",
        default=None,
        metavar="FILE.json",
        help="tools the playground's chat offers (an OpenAI-style JSON list; API clients send their own)",
    )
    serve.add_argument(
        "--log-format",
        default="text",
        choices=["text", "json"],
        help="the per-request log line as key=value text or one JSON object (default: text)",
    )
    serve.add_argument(
        "--allowed-hosts",
        default=None,
        metavar="H1,H2",
        help="Host header names answered (default: localhost names when bound to a loopback "
        "address without --api-key, else any)",
    )
    serve.add_argument(
        "--max-connections",
        type=int,
        default=1024,
        metavar="N",
        help="open connections and requests at once; more are answered 503 (default: 1024)",
    )
    engine_flags(serve, "serve", defaults={"fair_share_seqs": 32})  # many requests: the 1 GiB KV cache
    serve.set_defaults(func=cmd_serve)
