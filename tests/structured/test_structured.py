"""Structured output through llguidance: every output parses and validates, in mixed batches,
through the Python API, the CLI flags' parser and the server's response_format."""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest
import torch

from tests.helpers.server_harness import ThreadedServer, wait_until_idle
from tokenloom import SamplingParams
from tokenloom.structured import StructuredOutput

PERSON = {
    "type": "object",
    "additionalProperties": False,
    "required": ["name", "age", "role"],
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["engineer", "artist", "doctor"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3},
    },
}
ASK = [{"role": "user", "content": "Describe a person as JSON with name, age and role."}]


def test_sampled_json_always_validates_across_seeds_mixed_with_free_text(smol_llm):
    person = StructuredOutput.json(PERSON)
    constrained = [SamplingParams(temperature=1.0, seed=s, max_tokens=160, structured_output=person) for s in range(12)]
    free = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompt = smol_llm.tokenizer.encode_chat(ASK)
    free_alone = smol_llm.generate([prompt], free)[0].outputs[0].token_ids
    outs = smol_llm.generate([prompt] * 13, constrained + [free])
    for out in outs[:12]:
        o = out.outputs[0]
        assert o.finish_reason == "stop", o.text
        jsonschema.validate(json.loads(o.text), PERSON)
    assert outs[12].outputs[0].token_ids == free_alone  # the free request is untouched
    assert len({o.outputs[0].text for o in outs[:12]}) > 3  # really sampled


def test_a_schema_keeps_its_declared_key_order(smol_llm):
    """ "reasoning" declared before "answer" comes out first (OpenAI, llama.cpp and vLLM keep the
    schema's order), nested objects too; the same keys in another order are another constraint."""
    inner = {
        "type": "object",
        "required": ["zeta", "alpha"],
        "additionalProperties": False,
        "properties": {"zeta": {"type": "integer"}, "alpha": {"type": "integer"}},
    }
    schema = {
        "type": "object",
        "required": ["reasoning", "answer", "detail"],
        "additionalProperties": False,
        "properties": {
            "reasoning": {"type": "string", "maxLength": 40},
            "answer": {"type": "string", "maxLength": 10},
            "detail": inner,
        },
    }
    params = SamplingParams(temperature=0, max_tokens=120, structured_output=StructuredOutput.json(schema))
    text = smol_llm.chat([{"role": "user", "content": "Is 7 prime? Reason, then answer."}], params)[0].outputs[0].text
    data = json.loads(text)
    assert list(data) == ["reasoning", "answer", "detail"] and list(data["detail"]) == ["zeta", "alpha"]
    flipped = dict(schema, properties={k: schema["properties"][k] for k in ("answer", "reasoning", "detail")})
    assert StructuredOutput.json(flipped) != StructuredOutput.json(schema)
    assert StructuredOutput.json(json.dumps(schema, indent=2)) == StructuredOutput.json(schema)  # spacing aside


def test_regex_json_object_and_grammar(smol_llm):
    phone = SamplingParams(
        temperature=0.8, seed=1, max_tokens=20, structured_output=StructuredOutput.regex(r"\d{3}-\d{4}")
    )
    for out in smol_llm.generate(["My phone number is "] * 4, [phone] * 4):
        assert re.fullmatch(r"\d{3}-\d{4}", out.outputs[0].text)
    obj = smol_llm.chat(ASK, SamplingParams(temperature=0, max_tokens=120, structured_output=StructuredOutput.json()))
    assert isinstance(json.loads(obj[0].outputs[0].text), dict)
    lark = 'start: "The answer is " ANSWER "."\nANSWER: "yes" | "no"'
    out = smol_llm.generate(
        ["Is the sky blue?"],
        SamplingParams(temperature=0, max_tokens=10, structured_output=StructuredOutput.grammar(lark)),
    )
    assert out[0].outputs[0].text in ("The answer is yes.", "The answer is no.")


def test_compiled_grammars_are_cached_and_bad_ones_are_clear_errors(smol_llm):
    grammars = smol_llm.engine.core.grammars
    spec = StructuredOutput.json({"type": "object", "properties": {"x": {"type": "integer"}}})
    grammars.grammar(spec)
    before = grammars.compiled
    smol_llm.generate(["{"], SamplingParams(max_tokens=8, temperature=0, structured_output=spec))
    assert grammars.compiled == before  # cached: not compiled again
    for bad in [
        StructuredOutput("json_schema", "{not json"),
        StructuredOutput.regex("(unclosed"),
        StructuredOutput.grammar("start: undefined_rule"),
    ]:
        with pytest.raises(ValueError, match="invalid"):
            smol_llm.generate(["x"], SamplingParams(max_tokens=4, structured_output=bad))
    with pytest.raises(ValueError, match="kind"):
        StructuredOutput("xml", "<a/>")
    assert smol_llm.engine.core.block_manager.num_used_blocks == 0


def test_each_request_gets_its_own_matcher_copied_from_the_cached_one(smol_llm):
    """Matchers handed out for one cached grammar are independent: tokens one consumes do not
    move another, nor the next one handed out (they start at the constraint's beginning)."""
    grammars = smol_llm.engine.core.grammars
    spec = StructuredOutput.regex(r"(yes|no)")
    tok = smol_llm.tokenizer
    yes = tok.encode("yes")
    first, second = grammars.matcher(spec), grammars.matcher(spec)
    assert first.consume_tokens(yes) and first.is_accepting()
    assert not second.is_accepting() and not second.is_error()
    third = grammars.matcher(spec)
    assert not third.is_accepting() and third.consume_tokens(tok.encode("no")) and third.is_accepting()


def test_json_whitespace_between_tokens_is_bounded(smol_llm):
    """Between JSON tokens: a space, or up to two newlines and 20 indentation characters; a model
    cannot spend its tokens on whitespace forever. A schema's own x-guidance whitespace_pattern wins."""
    grammars, tok = smol_llm.engine.core.grammars, smol_llm.tokenizer

    def accepts(spec: StructuredOutput, text: str) -> bool:
        ids = tok.encode(text)
        return grammars.matcher(spec).validate_tokens(ids) == len(ids)

    obj = StructuredOutput.json()
    assert accepts(obj, "{\n" + " " * 20 + '"a": 1,\n\n  "b": [1, 2]\n}')
    assert not accepts(obj, "{" + " " * 30)
    assert not accepts(obj, '{"a": 1\n\n\n')
    free = StructuredOutput.json({"type": "object", "x-guidance": {"whitespace_pattern": "[ ]*"}})
    assert accepts(free, "{" + " " * 30)


def test_server_response_format_and_guided_extensions(smol_llm):
    from tokenloom.engine.async_engine import AsyncLLMEngine
    from tokenloom.entrypoints.server import build_app

    with ThreadedServer(build_app(AsyncLLMEngine(smol_llm.engine), "smol")) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
        resp = client.chat.completions.create(
            model="smol", messages=ASK, max_tokens=160, temperature=0.7, seed=0, response_format=fmt
        )
        jsonschema.validate(json.loads(resp.choices[0].message.content), PERSON)
        stream = client.chat.completions.create(
            model="smol",
            messages=ASK,
            max_tokens=160,
            temperature=0,
            response_format={"type": "json_object"},
            stream=True,
        )
        text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        assert isinstance(json.loads(text), dict)
        comp = client.completions.create(
            model="smol",
            prompt="Call me at ",
            max_tokens=24,
            temperature=0,
            extra_body={"guided_regex": r"\(\d{3}\) \d{3}-\d{4}"},
        )
        assert re.fullmatch(r"\(\d{3}\) \d{3}-\d{4}", comp.choices[0].text)
        for body, param in [
            (
                {
                    "response_format": {
                        "type": "json_schema",
                        "json_schema": {
                            "name": "x",
                            "schema": {"type": "object", "properties": {"a": {"type": "frobnicate"}}},
                        },
                    }
                },
                "response_format",
            ),
            ({"response_format": {"type": "xml"}}, "response_format"),
            ({"extra_body": {"guided_regex": "(oops"}}, "guided_regex"),
            ({"extra_body": {"guided_regex": "a", "guided_grammar": 'start: "a"'}}, "guided_grammar"),
        ]:
            with pytest.raises(openai.BadRequestError) as err:
                client.chat.completions.create(model="smol", messages=ASK, max_tokens=8, **body)
            assert err.value.body["param"] == param, err.value.body
        assert wait_until_idle(url) == 0


def test_cli_flags_build_the_constraint(tmp_path):
    from tokenloom.entrypoints.cli.commands import build_parser
    from tokenloom.entrypoints.cli.sampling import sampling_params

    schema_file = tmp_path / "person.json"
    schema_file.write_text(json.dumps(PERSON))

    def parse(*flags):
        return sampling_params(build_parser().parse_args(["generate", *flags, "hi"])).structured_output

    assert parse("--json-schema", str(schema_file)) == StructuredOutput.json(PERSON)
    assert parse("--json-schema", '{"type": "object"}') == StructuredOutput.json({"type": "object"})
    assert parse("--json") == StructuredOutput.json()
    assert parse("--regex", "a+") == StructuredOutput.regex("a+")
    assert parse() is None
    with pytest.raises(SystemExit):
        parse("--json", "--regex", "a")  # mutually exclusive


def test_the_tokenizer_text_is_made_only_when_a_grammar_needs_it(tiny_model_dir):
    """GrammarCompiler takes a callable for the tokenizer's JSON and calls it on first use only
    (a 151k-token vocabulary's text and trie are ~33 MB a process without constraints never needs)."""
    from tokenloom.structured.grammars import GrammarCompiler
    from tokenloom.structured.spec import StructuredOutput
    from tokenloom.tokenizer import Tokenizer

    tok = Tokenizer.from_folder(tiny_model_dir("llama_gqa"))
    made = []
    compiler = GrammarCompiler(lambda: made.append(1) or tok.backend.to_str(), tok.vocab_size, [0])
    assert made == []
    compiler.matcher(StructuredOutput("regex", "ab+"))
    compiler.matcher(StructuredOutput("regex", "c+"))
    assert made == [1]


@pytest.mark.parametrize("vocab", [1, 31, 32, 33, 1000])
def test_bitmask_application_matches_llguidance_reference(vocab):
    """masks.apply_bitmask against llguidance's own numpy implementation (random words, a vocabulary
    that does and does not fill its last word, logits wider than the mask)."""
    import numpy as np
    from llguidance.numpy import apply_token_bitmask_inplace

    from tokenloom.structured.masks import apply_bitmask

    g = torch.Generator().manual_seed(vocab)
    words = (vocab + 31) // 32
    mask = torch.randint(-(2**31), 2**31 - 1, (3, words), generator=g, dtype=torch.int64).to(torch.int32)
    for width in (vocab, vocab + 5):  # logits past the mask: all -inf
        logits = torch.randn(3, width, generator=g)
        ours, theirs = logits.clone(), logits.numpy().copy()
        apply_bitmask(ours, mask)
        apply_token_bitmask_inplace(theirs, mask.numpy())
        assert np.array_equal(ours.numpy(), theirs)
        assert torch.isinf(ours).any() and torch.isfinite(ours).any()
