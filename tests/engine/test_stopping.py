"""Stop strings, stop ids, EOS, max_tokens, and streaming deltas."""

from __future__ import annotations

import pytest

from tokenloom import SamplingParams
from tokenloom.engine.detokenizer import IncrementalDetokenizer
from tokenloom.engine.stopping import StopStringMatcher

STORY = "Once upon a time, there was a little"  # greedy: " girl named Emma who loved to play in the sun."


def feed_all(matcher: StopStringMatcher, deltas: list[str]) -> tuple[list[str], bool]:
    emitted, stopped = [], False
    for d in deltas:
        out, stopped = matcher.feed(d)
        emitted.append(out)
        if stopped:
            break
    if not stopped:
        emitted.append(matcher.flush())
    return emitted, stopped


class TestStopStringMatcher:
    def test_stop_split_across_deltas(self):
        emitted, stopped = feed_all(StopStringMatcher(["lo Wo"]), ["Hel", "lo W", "orld"])
        assert stopped and "".join(emitted) == "Hel"

    def test_stop_at_very_start(self):
        emitted, stopped = feed_all(StopStringMatcher(["He"]), ["H", "ello"])
        assert stopped and "".join(emitted) == ""

    def test_overlapping_stops_earliest_wins(self):
        m = StopStringMatcher(["bcd", "abc"])
        emitted, stopped = feed_all(m, ["xab", "cde"])
        assert stopped and "".join(emitted) == "x" and m.matched == "abc"

    def test_same_start_longest_wins(self):
        m = StopStringMatcher(["ab", "abc"])
        feed_all(m, ["xabc"])
        assert m.text == "x" and m.matched == "abc"

    def test_partial_match_is_held_back_then_released(self):
        m = StopStringMatcher(["abc"])
        assert m.feed("xxab") == ("xx", False)  # "ab" could start "abc"
        assert m.feed("d") == ("abd", False)  # it did not
        assert m.flush() == ""

    def test_partial_match_released_at_end(self):
        emitted, stopped = feed_all(StopStringMatcher(["abc"]), ["xa", "b"])
        assert not stopped and "".join(emitted) == "xab"


def test_multibyte_characters_never_break(smol_llm):
    tk = smol_llm.tokenizer
    text = " 😀 日本語 ünï 🎉🎉"
    ids = tk.encode(text)
    pieces = [tk.decode([i]) for i in ids]
    assert any("\ufffd" in p for p in pieces), "test needs a character split across tokens"
    detok = IncrementalDetokenizer(tk, tk.encode("Hi"), stop=[])
    deltas = [detok.push(i)[0] for i in ids] + [detok.finish()]
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == text


def test_stop_string_inside_a_token_span(smol_llm):
    out = smol_llm.generate(STORY, SamplingParams(temperature=0, max_tokens=30, stop=["med Em"]))[0].outputs[0]
    assert out.text == " girl na"
    assert (out.finish_reason, out.stop_reason) == ("stop", "med Em")


def test_stop_string_at_start_of_output(smol_llm):
    out = smol_llm.generate(STORY, SamplingParams(temperature=0, max_tokens=30, stop=[" girl"]))[0].outputs[0]
    assert out.text == "" and out.finish_reason == "stop" and len(out.token_ids) == 1


def test_overlapping_stop_strings_in_engine(smol_llm):
    params = SamplingParams(temperature=0, max_tokens=30, stop=["Emma who", "named Emma"])
    out = smol_llm.generate(STORY, params)[0].outputs[0]
    assert out.text == " girl " and out.stop_reason == "named Emma"


def test_stop_token_id_ends_and_is_not_shown(smol_llm):
    full = smol_llm.generate(STORY, SamplingParams(temperature=0, max_tokens=8))[0].outputs[0]
    stop_id = full.token_ids[3]
    out = smol_llm.generate(STORY, SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[stop_id]))[0].outputs[0]
    assert out.token_ids == full.token_ids[:4]
    assert out.stop_reason == stop_id and out.finish_reason == "stop"
    assert out.text == smol_llm.tokenizer.decode(full.token_ids[:3])


def test_max_tokens_one(smol_llm):
    out = smol_llm.generate(STORY, SamplingParams(temperature=0, max_tokens=1))[0].outputs[0]
    assert len(out.token_ids) == 1 and out.finish_reason == "length" and out.text == " girl"


def test_eos_and_ignore_eos(smol_llm):
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    done = smol_llm.chat(chat, SamplingParams(temperature=0, max_tokens=40))[0].outputs[0]
    assert done.finish_reason == "stop" and done.token_ids[-1] in smol_llm.engine.eos_token_ids
    assert "<|im_end|>" not in done.text
    longer = smol_llm.chat(chat, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))[0].outputs[0]
    assert len(longer.token_ids) == 20 and longer.finish_reason == "length"


def test_min_tokens_postpones_eos(smol_llm):
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    short = smol_llm.chat(chat, SamplingParams(temperature=0, max_tokens=40))[0].outputs[0]
    out = smol_llm.chat(chat, SamplingParams(temperature=0, max_tokens=40, min_tokens=len(short.token_ids) + 3))
    assert len(out[0].outputs[0].token_ids) >= len(short.token_ids) + 3


def test_stream_holds_back_partial_stop_and_matches_generate(smol_llm):
    params = SamplingParams(temperature=0, max_tokens=30, stop=["Emma who"])
    deltas = list(smol_llm.stream(STORY, params))
    assert "".join(deltas) == smol_llm.generate(STORY, params)[0].outputs[0].text == " girl named "
    assert not any("Emma" in d for d in deltas)
    assert len(deltas) > 1


def test_stream_equals_generate_without_stops(smol_llm):
    params = SamplingParams(temperature=0, max_tokens=25)
    assert "".join(smol_llm.stream(STORY, params)) == smol_llm.generate(STORY, params)[0].outputs[0].text


def test_seeded_sampling_reproduces_in_any_batch(smol_llm):
    params = SamplingParams(temperature=1.0, top_p=0.95, seed=1234, max_tokens=20)
    alone = smol_llm.generate(STORY, params)[0].outputs[0].token_ids
    again = smol_llm.generate(STORY, params)[0].outputs[0].token_ids
    batched = smol_llm.generate(["The sea", STORY, "Hello"], params)[1].outputs[0].token_ids
    assert alone == again == batched
    other_seed = smol_llm.generate(STORY, SamplingParams(temperature=1.0, top_p=0.95, seed=99, max_tokens=20))
    assert other_seed[0].outputs[0].token_ids != alone


def test_n_samples_get_distinct_seeds(smol_llm):
    out = smol_llm.generate(STORY, SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=12))[0]
    assert [o.index for o in out.outputs] == [0, 1, 2]
    assert len({tuple(o.token_ids) for o in out.outputs}) > 1
    first = smol_llm.generate(STORY, SamplingParams(temperature=1.0, seed=5, max_tokens=12))[0].outputs[0]
    assert out.outputs[0].token_ids == first.token_ids


def test_batched_real_model_equals_single(smol_llm):
    prompts = [STORY, "The three primary colors are", "def fibonacci(n):"]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=0)
    batched = smol_llm.generate(prompts, params)
    for p, b in zip(prompts, batched):
        single = smol_llm.generate(p, params)[0].outputs[0]
        assert b.outputs[0].token_ids == single.token_ids
        lb = [d[t] for d, t in zip(b.outputs[0].logprobs, b.outputs[0].token_ids)]
        ls = [d[t] for d, t in zip(single.logprobs, single.token_ids)]
        assert lb == pytest.approx(ls, abs=1e-4)
