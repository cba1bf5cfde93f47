"""Text as it streams: incremental detokenization, stop strings, and output kinds.

The tokenizer is the embedded model's byte-level BPE, which splits non-ASCII characters
across tokens, so a token-by-token decode would emit broken characters."""

import dataclasses

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import jaxkv
from jaxkv import Engine, RequestOutputKind, SamplingParams
from jaxkv.engine.detokenizer import IncrementalDetokenizer

TEXTS = ["héllo wörld, 日本語のテキスト", "naïve café — “quoted” ✓ done", "plain ascii text here"]
ENGINE = dict(page_size=16, num_pages=64, max_num_seqs=16, max_model_len=544,
              max_num_batched_tokens=512)  # the shapes of test_engine.py's embedded-model tests


@pytest.fixture(scope="module")
def model():
    return jaxkv.load_default()


class CountingTokenizer:
    """Records how many ids every decode call gets."""

    def __init__(self, tok):
        self.tok, self.calls = tok, []

    def decode(self, ids, **kw):
        self.calls.append(len(ids))
        return self.tok.decode(ids, **kw)


@pytest.mark.parametrize("text", TEXTS)
def test_incremental_text_never_breaks_a_character_and_decodes_a_window(model, text):
    tok = model.tokenizer
    ids = tok.encode(text)
    assert any("\ufffd" in tok.decode([i]) for i in ids) or text.isascii()
    counting = CountingTokenizer(tok)
    d = IncrementalDetokenizer(counting, tok.encode("Say:"))
    seen = []
    for i in ids:
        d.push(i)
        assert "\ufffd" not in d.text and text.startswith(d.text)
        seen.append(d.text)
    assert d.text == tok.decode(ids, skip_special_tokens=True)
    assert len(set(seen)) > len(ids) // 3  # it streamed, not all at the end
    assert max(counting.calls) <= 5 + 4  # a window, never the whole sequence


def test_stop_string_across_tokens_cuts_the_text(model):
    tok = model.tokenizer
    ids = tok.encode("one two three four five")
    stop = "o thr"  # spans " two" and " three"
    for keep, want in ((False, "one tw"), (True, "one two thr")):
        d = IncrementalDetokenizer(tok, [], stop=[stop, "zzz"], include_stop_str_in_output=keep)
        n = 0
        while d.push(ids[n]) or not d.find_stop():
            n += 1
        assert d.text == want and d.stop_reason == stop
        assert tok.decode(ids[:n + 1]).startswith("one two thr")  # found at the first chance
        with pytest.raises(ValueError, match="after a stop string"):
            d.push(ids[-1])


@pytest.fixture(scope="module")
def reference(model):
    """40 greedy tokens of a prompt, and their text."""
    engine = Engine(model, **ENGINE)
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    engine.add_request("ref", prompt="Once upon a time", sampling_params=sp)
    out = None
    while engine.has_unfinished_requests():
        for o in engine.step():
            out = o
    ids = out.outputs[0].token_ids
    assert out.outputs[0].text == model.decode(ids)
    return ids, out.outputs[0].text


def _serve(model, sp, prompt="Once upon a time"):
    engine = Engine(model, **ENGINE)
    engine.add_request("r", prompt=prompt, sampling_params=sp)
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
        engine.check()
    assert engine.stats().kv_pages_used == 0
    return outs


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_ends_the_request(model, reference, include):
    ids, text = reference
    words = text.split()
    stop = " ".join(words[3:5])[1:]  # mid-word start: spans tokens
    at = text.index(stop)
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[stop],
                        include_stop_str_in_output=include)
    final = _serve(model, sp)[-1].outputs[0]
    assert final.finish_reason == "stop" and final.stop_reason == stop
    assert final.text == text[:at + len(stop) * include]
    # Token ids keep the token that completed the stop string, and nothing after it.
    n = len(final.token_ids)
    assert final.token_ids == ids[:n] and n < len(ids)
    assert stop in model.decode(ids[:n]) and stop not in model.decode(ids[:n - 1])


def test_stop_string_waits_for_min_tokens(model, reference):
    ids, text = reference
    first = model.decode(ids[:3])
    stop = first.strip()[:3]
    assert stop in first
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=stop,
                        min_tokens=20)
    final = _serve(model, sp)[-1].outputs[0]
    n = len(final.token_ids)
    assert n > 20 and final.token_ids == ids[:n]  # not at its first occurrence
    assert final.finish_reason == "length" or final.stop_reason == stop


def test_delta_outputs_add_up_to_the_cumulative_ones(model, reference):
    ids, text = reference
    stop = text.split()[6]
    base = dict(temperature=0, max_tokens=40, ignore_eos=True, stop=[stop, "never-seen"])
    cumulative = _serve(model, SamplingParams(**base))
    delta = _serve(model, SamplingParams(**base, output_kind=RequestOutputKind.DELTA))
    final = _serve(model, SamplingParams(**base, output_kind=RequestOutputKind.FINAL_ONLY))
    assert len(final) == 1 and final[0].finished and len(delta) == len(cumulative) > 2
    whole = cumulative[-1].outputs[0]
    assert final[0].outputs[0] == whole
    assert sum((o.outputs[0].token_ids for o in delta), []) == whole.token_ids
    assert "".join(o.outputs[0].text for o in delta) == whole.text
    for o in cumulative[:-1]:  # running: text held back by len(longest stop) - 1 characters
        shown = o.outputs[0].text
        assert whole.text.startswith(shown) or stop in model.decode(o.outputs[0].token_ids)
        full = model.decode(o.outputs[0].token_ids)
        assert len(shown) <= max(0, len(full) - (len("never-seen") - 1))


def test_llm_generate_returns_whole_outputs_whatever_the_kind(model, reference):
    ids, text = reference
    llm = jaxkv.LLM(model, **{k: v for k, v in ENGINE.items() if k != "num_pages"}, warmup=False)
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True,
                        output_kind=RequestOutputKind.DELTA)
    (out,) = llm.generate("Once upon a time", sp, use_tqdm=False)
    assert out.outputs[0].token_ids == ids and out.outputs[0].text == text


def test_stop_strings_need_a_tokenizer(tiny_model):
    engine = Engine(tiny_model, page_size=16, num_pages=8, max_num_seqs=4, max_model_len=128,
                    max_num_batched_tokens=16)
    with pytest.raises(ValueError, match=r"SamplingParams.stop=\('x',\): stop strings need"):
        engine.add_request("a", prompt_token_ids=[5, 6], sampling_params=SamplingParams(
            stop="x"))
    with pytest.raises(ValueError, match=r"SamplingParams.stop="):
        SamplingParams(stop=["ok", ""])
    with pytest.raises(ValueError, match=r"SamplingParams.output_kind="):
        SamplingParams(output_kind="delta")
    assert SamplingParams(stop=["ab", "abcd"]).stop_buffer == 3
    assert SamplingParams(stop=["ab", "abcd"], include_stop_str_in_output=True).stop_buffer == 0


def test_a_text_shorter_than_the_hold_sends_nothing(model):
    """The audit's case: one token per step (logprobs), a stop string longer than the text so
    far. Nothing of a stop string's start may go out before the text is past it."""
    prompt = "the cat sat on the mat. the cat sat on the mat. the"
    for stop in (" on the", " cid is"):
        sp = SamplingParams(temperature=0, max_tokens=30, stop=[stop], logprobs=2,
                            output_kind=RequestOutputKind.DELTA)
        outs = _serve(model, sp, prompt)
        whole = _serve(model, dataclasses.replace(sp, output_kind=RequestOutputKind.CUMULATIVE),
                       prompt)[-1].outputs[0].text
        _check_stream([o.outputs[0].text for o in outs], whole)


def _check_stream(deltas: list[str], whole: str) -> None:
    """Every prefix of the stream is a prefix of the final text, and the whole stream is it."""
    sent = ""
    for d in deltas:
        sent += d
        assert whole.startswith(sent), (deltas, whole)
    assert sent == whole, (deltas, whole)


@pytest.fixture(scope="module")
def engines(model):
    """One plain engine and one speculating (n-gram) engine, shared by every example."""
    spec = {"method": "ngram", "num_speculative_tokens": 3, "disable_by_batch_size": None,
            "min_draft_tokens": 1}
    return {"plain": Engine(model, **ENGINE), "ngram": Engine(model, **ENGINE,
                                                              speculative_config=spec)}


@st.composite
def stream_cases(draw, text):
    """Requests with stop strings cut from the reference text (so they are hit) or not, with
    and without logprobs (one token a step), include_stop_str_in_output, n > 1, min_tokens."""
    cases = []
    for _ in range(draw(st.integers(1, 3))):
        stops = []
        for _ in range(draw(st.integers(0, 3))):
            at = draw(st.integers(0, len(text) - 2))
            stops.append(text[at:at + draw(st.integers(1, 12))])
        stops += draw(st.lists(st.sampled_from(["never-seen-anywhere", "q", "\n", ". "]),
                               max_size=1))
        n = draw(st.sampled_from([1, 1, 2]))
        min_tokens = draw(st.sampled_from([0, 0, 3]))
        cases.append(dict(
            stop=stops or None, n=n, seed=draw(st.integers(0, 2**31)),
            temperature=draw(st.sampled_from([0.0, 0.7])) if n == 1 else 0.8,
            max_tokens=draw(st.integers(max(min_tokens, 1), 40)), ignore_eos=draw(st.booleans()),
            logprobs=draw(st.sampled_from([None, 2])),
            include_stop_str_in_output=draw(st.booleans()),
            min_tokens=min_tokens))
    return draw(st.sampled_from(["plain", "ngram"])), cases


def _check_stream_cases(engines, kind, cases):
    engine = engines[kind]
    for i, kw in enumerate(cases):  # each request twice: streamed, and whole (same seed)
        engine.add_request(f"d{i}", prompt="Once upon a time", sampling_params=SamplingParams(
            **kw, output_kind=RequestOutputKind.DELTA))
        engine.add_request(f"w{i}", prompt="Once upon a time", sampling_params=SamplingParams(
            **kw, output_kind=RequestOutputKind.FINAL_ONLY))
    deltas, whole = {}, {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id.startswith("d"):
                for c in out.outputs:
                    deltas.setdefault((out.request_id[1:], c.index), []).append(c)
            else:
                whole.update({(out.request_id[1:], c.index): c for c in out.outputs})
        engine.check()
    assert engine.stats().kv_pages_used == 0
    assert deltas.keys() == whole.keys() and whole
    for key, pieces in deltas.items():
        final = whole[key]
        assert sum((c.token_ids for c in pieces), []) == final.token_ids
        _check_stream([c.text for c in pieces], final.text)
        assert pieces[-1].finish_reason == final.finish_reason
        assert pieces[-1].stop_reason == final.stop_reason


@settings(max_examples=8, deadline=None, suppress_health_check=[
    HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_streamed_deltas_join_to_the_final_text(engines, reference, data):
    kind, cases = data.draw(stream_cases(reference[1]))
    _check_stream_cases(engines, kind, cases)


@pytest.mark.slow
@settings(max_examples=80, deadline=None, suppress_health_check=[
    HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_streamed_deltas_join_to_the_final_text_sweep(engines, reference, data):
    kind, cases = data.draw(stream_cases(reference[1]))
    _check_stream_cases(engines, kind, cases)
