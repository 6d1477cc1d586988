"""EngineArgs: every engine option written once, read the same way by Python, the CLI and serve."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from tokenloom.config import SpeculativeConfig
from tokenloom.engine.args import GPU_DECODE_STEPS, EngineArgs
from tokenloom.entrypoints.cli.commands import build_parser
from tokenloom.entrypoints.cli.common import check_engine_flags


def parse(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(list(argv))


@pytest.mark.parametrize("command", [None, "serve"])
def test_a_parser_without_overrides_has_the_fields_defaults(command):
    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser, command)
    namespace = parser.parse_args([])
    assert EngineArgs.from_cli_args(namespace) == EngineArgs()
    if command == "serve":  # serve shows every option
        assert all(hasattr(namespace, f.name) for f in dataclasses.fields(EngineArgs))


def test_flags_read_back_into_the_fields_they_name():
    args = EngineArgs.from_cli_args(
        parse(
            "generate",
            "hi",
            "-m",
            "m.gguf",
            "-t",
            "3",
            "-c",
            "512",
            "--kv-cache-memory",
            "0.5",
            "--no-prefix-caching",
            "--speculative",
            "ngram,k=3",
            "--quantization",
            "int8",
            "--kv-cache-dtype",
            "int8",
            "--block-size",
            "32",
            "--decode-steps",
            "2",
            "--device",
            "cpu",
            "--dtype",
            "float32",
        )
    )
    assert args == EngineArgs(
        model="m.gguf",
        cpu_threads=3,
        max_model_len=512,
        kv_cache_memory=512 << 20,
        enable_prefix_caching=False,
        speculative="ngram,k=3",
        quantization="int8",
        kv_cache_dtype="int8",
        block_size=32,
        decode_steps=2,
        device="cpu",
        dtype="float32",
        kv_cache_contexts=1,
    )


def test_commands_change_defaults_in_one_place():
    session = EngineArgs.from_cli_args(parse("generate", "hi"))
    serve = EngineArgs.from_cli_args(parse("serve"))
    assert session.kv_cache_contexts == 1 and session.fair_share_seqs is None  # one conversation
    assert serve.kv_cache_contexts is None and serve.fair_share_seqs == 32  # many clients, 1 GiB
    assert serve.max_num_seqs == EngineArgs().max_num_seqs == 64
    assert EngineArgs.from_cli_args(parse("serve", "--max-num-seqs", "8")).max_num_seqs == 8
    with pytest.raises(SystemExit):  # the batch limits are serve's flags only
        parse("generate", "hi", "--max-num-seqs", "8")
    with pytest.raises(TypeError, match="max_seqs"):
        EngineArgs.add_cli_args(argparse.ArgumentParser(), defaults={"max_seqs": 1})


def test_every_option_has_a_flag_and_help():
    for f in dataclasses.fields(EngineArgs):
        assert f.metadata["flags"] and f.metadata["help"], f.name


def test_the_config_holds_what_the_options_say(tmp_path):
    config = EngineArgs(
        model=str(tmp_path),
        max_num_seqs=4,
        max_num_batched_tokens=256,
        block_size=8,
        kv_cache_memory=64 << 20,
        enable_prefix_caching=False,
        speculative="ngram,k=2",
        device="cpu",
        cpu_threads=1,
    ).create_engine_config()
    assert config.model == str(tmp_path) and config.device == "cpu" and config.cpu_threads == 1
    assert (config.scheduler.max_num_seqs, config.scheduler.max_num_batched_tokens) == (4, 256)
    assert config.scheduler.decode_steps == 1  # the CPU decodes one token a step by default
    assert (config.cache.block_size, config.cache.kv_cache_memory, config.cache.enable_prefix_caching) == (
        8,
        64 << 20,
        False,
    )
    assert config.speculative == SpeculativeConfig(method="ngram", k=2)
    assert GPU_DECODE_STEPS > 1


@pytest.mark.parametrize(
    ("option", "value"),
    [("max_num_seqs", 0), ("decode_steps", 0), ("cpu_threads", -1), ("tensor_parallel_size", 0), ("block_size", 0)],
)
def test_a_bad_value_names_its_option(option, value):
    with pytest.raises(ValueError, match=option):
        EngineArgs(**{option: value}).check()


def test_a_bad_flag_is_named_as_the_command_line_spells_it():
    with pytest.raises(ValueError, match="^--decode-steps must be >= 1, got 0"):
        check_engine_flags(parse("generate", "hi", "--decode-steps", "0"))
    with pytest.raises(ValueError, match="speculative"):
        check_engine_flags(parse("generate", "hi", "--speculative", "lookahead"))


def test_an_unknown_option_is_a_type_error_before_any_load():
    from tokenloom import LLM

    with pytest.raises(TypeError, match="max_seqs"):
        LLM("no/such/model", max_seqs=4)


@pytest.mark.parametrize(("option", "value"), [("max_num_seqs", True), ("decode_steps", 2.0), ("block_size", "16")])
def test_an_option_of_the_wrong_type_is_a_type_error(option, value):
    with pytest.raises(TypeError, match=f"{option} must be an integer"):
        EngineArgs(**{option: value}).check()
