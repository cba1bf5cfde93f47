"""Structured outputs (issue 30) offline: outputs that match their JSON schema, regex, choice or
grammar, sampled at temperature 1 from the embedded model (which writes Python, not JSON, so
only the mask makes them valid); the device's mask equal to llguidance's reference; a cut-off
output reports "length"; unconstrained neighbours are unchanged; errors name the field."""

import json
import re

import jsonschema
import numpy as np
import pytest
from llguidance.numpy import apply_token_bitmask_inplace
from serving import drive

import jaxkv
from jaxkv import Engine, SamplingParams, StructuredOutputsParams
from jaxkv.runtime.processors import apply_token_bitmask
from jaxkv.structured.finite import json_schema_endless, lark_endless
from jaxkv.structured.grammar import grammars_for

SHAPE = dict(page_size=8, num_pages=96, max_num_seqs=6, max_model_len=320,
             max_num_batched_tokens=64)
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "count": {"type": "integer", "minimum": -5, "maximum": 99},
        "kind": {"enum": ["a", "b", "c"]},
        "flags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3},
        "point": {"$ref": "#/$defs/point"},
        "either": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9},
                             {"type": "string", "enum": ["none"]}]},
    },
    "required": ["name", "count", "kind", "point"],
    "additionalProperties": False,
    "$defs": {"point": {"type": "object", "properties": {
        "x": {"type": "number", "minimum": 0, "maximum": 1}}, "required": ["x"],
        "additionalProperties": False}},
}
GBNF = 'root ::= "ok:" digit digit? digit? (";" [a-z])?\ndigit ::= [0-9]'
# More options than llguidance's 2000 Earley items per row (issue 43): a flat alternation
# of them failed at the first token
OPTIONS = [f"option-{i}" for i in range(2000)] + ["x", "x y"]


@pytest.fixture(scope="module")
def model():
    return jaxkv.load_default()


def _valid_json(schema):
    def check(text):
        jsonschema.validate(json.loads(text), schema)
        return True
    return check


CASES = {
    "json": ({"json": SCHEMA, "disable_any_whitespace": True}, _valid_json(SCHEMA)),
    "json_object": ({"json_object": True, "disable_any_whitespace": True},
                    lambda t: isinstance(json.loads(t), dict)),
    "regex": ({"regex": r"[a-z]{2,5}-[0-9]{2}"},
              lambda t: re.fullmatch(r"[a-z]{2,5}-[0-9]{2}", t) is not None),
    "choice": ({"choice": ["alpha", "beta", "gamma delta"]},
               lambda t: t in ("alpha", "beta", "gamma delta")),
    "grammar": ({"grammar": GBNF},
                lambda t: re.fullmatch(r"ok:[0-9]{1,3}(;[a-z])?", t) is not None),
    "large choice": ({"choice": OPTIONS}, set(OPTIONS).__contains__),
}


def test_params_errors_name_the_field():
    with pytest.raises(ValueError, match="exactly one of"):
        StructuredOutputsParams(json={"type": "object"}, regex="a")
    with pytest.raises(ValueError, match="exactly one of"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match=r"structured_outputs\.json: not JSON"):
        StructuredOutputsParams(json="{type: object}")
    with pytest.raises(ValueError, match=r"structured_outputs\.choice must be a non-empty"):
        StructuredOutputsParams(choice="yes")
    with pytest.raises(ValueError, match=r"SamplingParams\.structured_outputs\.regexp: unknown"):
        SamplingParams(structured_outputs={"regexp": "a"})
    for bad in (5, True, {"a": 1}, [], ["a", 2]):
        with pytest.raises(ValueError, match=r"structured_outputs\.choice must be"):
            StructuredOutputsParams(choice=bad)
    with pytest.raises(ValueError, match=r"structured_outputs\.json must be a JSON schema"):
        StructuredOutputsParams(json="false")
    with pytest.raises(ValueError, match="whitespace_pattern is for json"):
        StructuredOutputsParams(regex="a", whitespace_pattern=" ?")
    with pytest.raises(ValueError, match=r"SamplingParams\.min_tokens=2: not with structured"):
        SamplingParams(min_tokens=2, max_tokens=5, structured_outputs={"regex": "a+"})
    assert SamplingParams(structured_outputs={"json": '{"type": "object"}'}) \
        .structured_outputs == StructuredOutputsParams(json={"type": "object"})


def test_backend_errors_name_the_field_when_the_request_is_added(model):
    engine = Engine(model, **SHAPE)
    for so, field in (({"regex": "(a"}, "regex"), ({"json": {"type": "objekt"}}, "json"),
                      ({"grammar": "root ::= ("}, "grammar")):
        with pytest.raises(ValueError, match=rf"structured_outputs\.{field}: "):
            engine.add_request("x", prompt="x", sampling_params=SamplingParams(
                structured_outputs=so))
    assert not engine.has_unfinished_requests()
    with pytest.raises(ValueError, match="structured_outputs: the model has no tokenizer"):
        Engine(jaxkv.random_model(model.config), **SHAPE).add_request(
            "y", prompt_token_ids=[5], sampling_params=SamplingParams(
                structured_outputs={"regex": "a"}))


# Grammars that compile but can never end (issue 43): served, they ended at once with "" or
# wrote until max_tokens; each is refused when the request is added, naming its field.
ENDLESS = [
    ({"grammar": "start: start"}, "grammar"),
    ({"grammar": 'start: "a" start'}, "grammar"),
    ({"grammar": 'root ::= "(" inner ")"\ninner ::= root | "[" inner'}, "grammar"),
    ({"json": {"$ref": "#"}}, "json"),
    ({"json": {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}},
     "json"),
    ({"json": {"type": "array", "items": {"$ref": "#/$defs/x"}, "minItems": 1,
               "$defs": {"x": {"anyOf": [{"$ref": "#"}, {"allOf": [{"$ref": "#"}]}]}}}},
     "json"),
]
# Recursive ones that can end stay served
ENDING = [{"grammar": 'start: "a" start | "b"'},
          {"grammar": 'root ::= "(" root ")" | "x"'},
          {"json": {"type": "object", "properties": {"a": {"$ref": "#"}}}},
          {"json": {"anyOf": [{"type": "null"},
                              {"type": "array", "items": {"$ref": "#"}, "minItems": 1}]}}]


def test_grammars_that_can_never_end_are_refused_naming_the_field(model):
    engine = Engine(model, **SHAPE)
    for so, field in ENDLESS:
        with pytest.raises(ValueError, match=rf"structured_outputs\.{field}: .*(never|no )"):
            engine.add_request("x", prompt="x", sampling_params=SamplingParams(
                structured_outputs=so))
    assert not engine.has_unfinished_requests()
    for i, so in enumerate(ENDING):
        engine.add_request(f"ok{i}", prompt="x", sampling_params=SamplingParams(
            temperature=1.0, seed=i, max_tokens=24, structured_outputs=so))
    done = drive(engine)
    assert all(out.outputs[0].finish_reason in ("stop", "length") for out in done.values())
    assert engine.stats().kv_pages_used == 0


@pytest.mark.parametrize("grammar, endless", [
    ('start: "a" start | "b"', False),
    ('start: x+\nx: x "a"', True),  # one or more of a rule that never ends
    ('start: x*\nx: x "a"', False),  # none of it ends
    ('start: x{2,3}\nx: x', True),
    ('start: x ~ 0..2\nx: x', False),
    ('start: [x] "b"\nx: x', False),
    ('start: a\na: b\nb: a', True),
    ('// a comment\nstart: a # another\n  | b\na: a\nb: "q" %json {"a": "}"}', False),
    ('%ignore /\\s+/\nstart: "a" | start "b"', False),
    ('start: A\nA: "x" A', False),  # a terminal: llguidance's to judge
    ('start: _sep{x, ","}\n_sep{a, b}: a (b a)*\nx: "q"', False),  # unread: served
])
def test_lark_rules_that_can_never_end(grammar, endless):
    assert (lark_endless(grammar) is not None) == endless, lark_endless(grammar)


@pytest.mark.parametrize("schema, endless", [
    ({"type": ["object", "null"], "properties": {"a": {"$ref": "#"}}, "required": ["a"]},
     False),
    ({"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"type": "object", "properties": {
        "n": {"$ref": "#/$defs/a"}}, "required": ["n"]}}, "$ref": "#/$defs/a"}, True),
    ({"definitions": {"node": {"type": "object", "properties": {"kids": {
        "type": "array", "items": {"$ref": "#/definitions/node"}}}, "required": ["kids"]}},
      "$ref": "#/definitions/node"}, False),  # a node with no kids ends
    ({"type": "array", "prefixItems": [{"type": "null"}], "items": {"$ref": "#"},
      "minItems": 1}, False),
    ({"type": "array", "prefixItems": [{"type": "null"}], "items": {"$ref": "#"},
      "minItems": 2}, True),
    ({"type": "object", "properties": {"a": {"$ref": "https://x.org/s"}}, "required": ["a"]},
     False),  # not followed: served
])
def test_json_schemas_that_can_never_end(schema, endless):
    assert (json_schema_endless(schema) is not None) == endless, json_schema_endless(schema)


@pytest.mark.parametrize("n", [10_000, 100_000])
def test_a_choice_past_the_backends_limits_is_served_or_refused_at_intake(model, n):
    """Each matcher step of a choice of n options stays within llguidance's limits, or the
    request is refused when added, naming the field (never an error mid-generation)."""
    tok, cfg = model.tokenizer, model.config
    grammars = grammars_for(tok, cfg.vocab_size, cfg.eos_token_ids)
    options = [str(i) for i in range(n)]
    try:
        matcher = grammars.compile(StructuredOutputsParams(choice=options)).matcher()
    except ValueError as e:
        assert str(e).startswith("structured_outputs.choice: "), e
        return
    bitmask = np.zeros((1, (cfg.vocab_size + 31) // 32), np.int32)
    rng, taken = np.random.default_rng(0), []
    while not matcher.done:
        matcher.fill(bitmask, 0)
        bits = np.unpackbits(bitmask[0].view(np.uint8), bitorder="little")[:cfg.vocab_size]
        taken.append(int(rng.choice(np.flatnonzero(bits))))
        assert matcher.consume(taken[-1]), matcher.error
    assert tok.decode([t for t in taken if t not in cfg.eos_token_ids]) in options


def test_the_device_mask_equals_llguidance_reference():
    rng = np.random.default_rng(0)
    for v in (97, 4096):  # a vocabulary that is not a multiple of 32, and one that is
        w = (v + 31) // 32
        logits = rng.standard_normal((5, v)).astype(np.float32)
        mask = rng.integers(-2**31, 2**31, (5, w), dtype=np.int64).astype(np.int32)
        masked = np.array([True, True, False, True, False])
        want = logits.copy()
        ref = want[masked]
        apply_token_bitmask_inplace(ref, mask[masked])
        want[masked] = ref
        got = np.asarray(apply_token_bitmask(logits, mask, masked))
        np.testing.assert_array_equal(got, want)
        assert np.isneginf(got[0]).sum() > 0.3 * v  # random words ban about half


def test_a_matchers_mask_allows_exactly_the_prefixes_of_its_choices(model):
    tok, cfg = model.tokenizer, model.config
    grammars = grammars_for(tok, cfg.vocab_size, cfg.eos_token_ids)
    choices = ["alpha", "beta"]
    matcher = grammars.compile(StructuredOutputsParams(choice=choices)).matcher()
    bitmask = np.zeros((1, (cfg.vocab_size + 31) // 32), np.int32)
    matcher.fill(bitmask, 0)
    bits = np.unpackbits(bitmask[0].view(np.uint8), bitorder="little")[:cfg.vocab_size]
    allowed = set(np.flatnonzero(bits).tolist())
    want = {t for t in range(cfg.vocab_size)
            if (s := tok.decode([t])) and any(c.startswith(s) for c in choices)}
    assert allowed == want and allowed
    assert grammars.compile(StructuredOutputsParams(choice=choices)).params.choice == \
        tuple(choices)  # the second compile is a cache hit
    assert grammars.hits >= 1


@pytest.mark.parametrize("kind", list(CASES))
def test_sampled_outputs_match_their_constraint(model, kind):
    so, valid = CASES[kind]
    engine = Engine(model, **SHAPE)
    prompts = ["def parse(line):\n    ", "import os\n\nclass ", "x = [1, 2"]
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", prompt=p, sampling_params=SamplingParams(
            temperature=1.0, seed=i, n=2, max_tokens=160, structured_outputs=so))
    done = drive(engine)
    outs = [c for out in done.values() for c in out.outputs]
    texts = [c.text for c in outs]
    assert len(texts) == 2 * len(prompts)
    # Any JSON object is unbounded: a model that writes Python may not close one in
    # max_tokens (cut off: "length"); every other constraint here is bounded.
    ended = [c for c in outs if c.finish_reason == "stop"]
    assert len(ended) == len(outs) or kind == "json_object" and len(ended) >= 2
    for c in ended:
        assert valid(c.text), c.text
    assert len(set(texts)) > 1  # sampled, not one forced string
    assert engine.stats().kv_pages_used == 0


def test_a_grammar_left_with_no_token_is_an_error_that_says_why(model):
    """The logits processors ban every token the grammar allows: the request ends with
    "error" and a message naming structured_outputs; the engine serves on, no page held."""
    engine = Engine(model, **SHAPE)
    only = model.tokenizer.encode("zz")[0]
    engine.add_request("banned", prompt="x", sampling_params=SamplingParams(
        temperature=0, max_tokens=8, allowed_token_ids=[only],
        structured_outputs={"choice": ["yes", "no"]}))
    engine.add_request("fine", prompt="x", sampling_params=SamplingParams(
        temperature=0, max_tokens=4, structured_outputs={"choice": ["yes", "no"]}))
    done = drive(engine)
    assert done["banned"].outputs[0].finish_reason == "error"
    assert "structured_outputs.choice" in done["banned"].error
    assert "did allowed_token_ids ban" in done["banned"].error  # the one restriction it used
    assert done["fine"].outputs[0].text in ("yes", "no")
    assert engine.stats().kv_pages_used == 0


def test_a_rule_wider_than_the_parsers_row_is_refused_at_intake(model):
    """A rule of more alternatives than llguidance's Earley row holds would fail at the first
    token: refused when added, naming the field and the rule; the same options as a terminal
    are served."""
    engine = Engine(model, **SHAPE)
    wide = "start: " + " | ".join(json.dumps(c) for c in OPTIONS)
    with pytest.raises(ValueError, match=r"structured_outputs.grammar: rule start has \d+ alt"):
        engine.add_request("wide", prompt="x", sampling_params=SamplingParams(
            temperature=0, max_tokens=8, structured_outputs={"grammar": wide}))
    lexeme = "start: WORD\nWORD: " + " | ".join(json.dumps(c) for c in OPTIONS)
    engine.add_request("lexeme", prompt="x", sampling_params=SamplingParams(
        temperature=0, max_tokens=8, structured_outputs={"grammar": lexeme}))
    out = drive(engine)["lexeme"]
    assert out.outputs[0].finish_reason in ("stop", "length"), out.error
    assert any(c.startswith(out.outputs[0].text) for c in OPTIONS)
    assert engine.stats().kv_pages_used == 0


def test_a_refusal_mid_way_names_no_field_the_request_did_not_use(model):
    c = model.config
    grammar = grammars_for(model.tokenizer, c.vocab_size, c.eos_token_ids).compile(
        StructuredOutputsParams(choice=["yes", "no"]))
    matcher = grammar.matcher()
    bad = model.tokenizer.encode("zzz")[0]
    assert not matcher.consume(bad)
    why = matcher.refusal(bad)
    assert why.startswith("structured_outputs.choice: the grammar cannot go on with token")
    assert not re.search("logit_bias|allowed_token_ids|bad_words", why), why
    assert "did bad_words ban" in matcher.refusal(bad, ["bad_words"])


def test_a_cut_off_output_reports_length(model):
    engine = Engine(model, **SHAPE)
    engine.add_request("cut", prompt="x", sampling_params=SamplingParams(
        temperature=0, max_tokens=4, structured_outputs={"json": SCHEMA}))
    out = drive(engine)["cut"].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 4
    with pytest.raises(json.JSONDecodeError):
        json.loads(out.text)


def test_unconstrained_neighbours_are_unchanged_and_aborts_free_everything(model):
    """Greedy requests beside constrained ones (sharing a step, prefix-cached prompts,
    a constrained request aborted mid-way) decode exactly as alone."""
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = ["def parse(line):\n    ", "import os\n\nclass ", "def parse(line):\n    x"]

    def run(constrained: bool):
        engine = Engine(model, **SHAPE)
        for i, p in enumerate(prompts):
            engine.add_request(f"g{i}", prompt=p, sampling_params=greedy)
            if constrained:
                engine.add_request(f"c{i}", prompt=p, sampling_params=SamplingParams(
                    temperature=1.0, seed=i, max_tokens=40,
                    structured_outputs={"json": SCHEMA, "disable_any_whitespace": True}))
        outs = {}
        for step in range(400):
            if constrained and step == 3:
                engine.abort("c1")
            for out in engine.step():
                if out.finished:
                    outs[out.request_id] = out
            engine.check()
            if not engine.has_unfinished_requests():
                break
        assert engine.stats().kv_pages_used == 0
        return outs

    alone, mixed = run(False), run(True)
    for i in range(len(prompts)):
        assert mixed[f"g{i}"].outputs[0].token_ids == alone[f"g{i}"].outputs[0].token_ids
    assert mixed["c1"].outputs[0].finish_reason == "abort"


def test_disaggregated_serving_masks_the_first_token_and_the_rest(model):
    from jaxkv.disagg import DisaggregatedEngine, kv_transfer

    engine = DisaggregatedEngine(Engine(model, **SHAPE), Engine(model, **SHAPE),
                                 lockstep=True, transport=kv_transfer.PageMover)
    so, valid = CASES["regex"]
    for i in range(3):
        engine.add_request(f"d{i}", prompt="def f(x):\n    return", sampling_params=(
            SamplingParams(temperature=1.0, seed=i, max_tokens=40, structured_outputs=so)))
    done = drive(engine)
    assert all(valid(out.outputs[0].text) for out in done.values())


REPEATS = "x = 1\ny = 2\nx = 1\ny = 2\nx = 1\ny = 2\n"
PAIRS = r"(x = [0-9]\ny = [0-9]\n){2,8}"


def _pairs_run(model, temperature, spec=None):
    """A constrained request and an unconstrained neighbour on a prompt that repeats itself
    (n-gram drafts find it): {id: (text, drafted, accepted)}."""
    engine = Engine(model, **SHAPE, **({} if spec is None else {"speculative_config": spec}))
    engine.add_request("c", prompt=REPEATS, sampling_params=SamplingParams(
        temperature=temperature, seed=1, max_tokens=60, structured_outputs={"regex": PAIRS}))
    engine.add_request("u", prompt=REPEATS, sampling_params=SamplingParams(
        temperature=temperature, seed=2, max_tokens=40, ignore_eos=True))
    return {k: (o.outputs[0].text, o.metrics.num_draft_tokens, o.metrics.num_accepted_tokens)
            for k, o in drive(engine).items()}


NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "disable_by_batch_size": None,
         "min_draft_tokens": 1}


def test_constrained_requests_speculate_with_ngram_drafts_masked_per_position(model):
    """n-gram speculation of a constrained request: drafts cut at the first token the grammar
    refuses, every verified position masked by the grammar after the drafts before it. Greedy,
    the outputs are those of the engine without speculation, and drafts were accepted; at
    temperature 1 the output still matches."""
    plain = _pairs_run(model, 0)
    spec = _pairs_run(model, 0, NGRAM)
    assert {k: v[0] for k, v in spec.items()} == {k: v[0] for k, v in plain.items()}
    assert re.fullmatch(r"(x = [0-9]\ny = [0-9]\n)+(x = [0-9]\n)?", spec["c"][0])  # cut off
    assert spec["c"][1] > 0 and spec["c"][2] > 0  # it drafted, and drafts were accepted
    sampled = _pairs_run(model, 1.0, NGRAM)
    assert re.fullmatch(PAIRS, sampled["c"][0]) and sampled["c"][1] > 0


def test_ngram_drafts_of_a_constrained_request_end_before_the_first_refused_token(model):
    """The proposal itself: the n-gram continuation is cut where the grammar would refuse a
    token (verifying past it would waste the positions)."""
    from types import SimpleNamespace

    from jaxkv.config import SpeculativeConfig
    from jaxkv.spec import proposer_for
    from jaxkv.spec.speculator import Speculator

    tok, c = model.tokenizer, model.config
    grammar = grammars_for(tok, c.vocab_size, c.eos_token_ids).compile(
        StructuredOutputsParams(regex=r"(x = [0-9]\n)+"))
    # the output so far "x", and in the prompt "x = 3; ": n-gram drafts " = 3; "
    prompt = tok.encode("y = 0\nx = 3; ")
    output = tok.encode("x")
    matcher = grammar.matcher()
    for t in output:
        assert matcher.consume(t)
    req = SimpleNamespace(token_ids=prompt + output, num_output_tokens=len(output),
                          sampling_params=SamplingParams(max_tokens=50), grammar=None)
    spec = Speculator(proposer_for(SpeculativeConfig(
        method="ngram", num_speculative_tokens=4, prompt_lookup_min=1, prompt_lookup_max=1)))
    free = spec.propose(req, room=8)
    req.grammar = matcher
    cut = spec.propose(req, room=8)
    assert tok.decode(free).startswith(" = 3;")
    assert tok.decode(cut) == " = 3" and free[:len(cut)] == cut


@pytest.mark.parametrize("spec", [
    {"method": "self", "num_speculative_tokens": 3},
    {"method": "draft_model", "num_speculative_tokens": 3, "quantization": "int8"}],
    ids=["self", "draft_model"])
def test_drafts_from_the_device_are_read_back_cut_and_masked(model, spec):
    """self and draft_model: a constrained request's drafts appear on the device; they are
    read back, cut at the first refused token and their positions masked. Greedy, the outputs
    are those without speculation, and the constrained request's drafts were accepted."""
    plain = _pairs_run(model, 0)
    got = _pairs_run(model, 0, {**spec, "disable_by_batch_size": None})
    assert {k: v[0] for k, v in got.items()} == {k: v[0] for k, v in plain.items()}
    assert got["c"][1] > 0 and got["c"][2] > 0 and got["u"][1] > 0


def test_the_masks_of_draft_positions_equal_consuming_the_drafts_one_by_one(model):
    """`GrammarCompiler.fill_with_drafts` against llguidance stepped by hand: the mask at
    position j is the grammar's after the first j drafts; the matcher's state is kept."""
    c = model.config
    compiler = grammars_for(model.tokenizer, c.vocab_size, c.eos_token_ids)
    grammar = compiler.compile(StructuredOutputsParams(json=SCHEMA))
    drafts = model.tokenizer.encode('{"name": "ab", "count": 3')
    words = (c.vocab_size + 31) // 32
    want = np.zeros((len(drafts) + 1, words), np.int32)
    stepped = grammar.matcher()
    for j, t in enumerate(drafts):
        stepped.fill(want, j)
        assert stepped.consume(t)
    stepped.fill(want, len(drafts))
    m, other = grammar.matcher(), grammar.matcher()
    got = np.zeros((len(drafts) + 3, words), np.int32)
    compiler.fill_with_drafts([(m, 2, drafts), (other, 0, [])], got)
    np.testing.assert_array_equal(got[2:], want)
    np.testing.assert_array_equal(got[0], want[0])  # no drafts: the mask from the start
    assert not got[1].any()
    assert m.valid_prefix(drafts) == len(drafts)  # unchanged: all of them still fit
    assert m.valid_prefix(drafts[:3] + drafts[:1]) == 3


def test_after_warmup_constrained_batches_compile_nothing(model):
    """Warmup compiles the masked draw for every row bucket: batches of 1 to 6 constrained
    rows (buckets 1, 4, 6) beside unconstrained ones then compile nothing."""
    from jaxkv.runtime.compiles import count_compiles

    engine = Engine(model, **SHAPE)
    assert ("sample_masked", 6) in engine.programs()
    engine.warmup()
    so, valid = CASES["regex"]
    with count_compiles() as compiles:
        for n in (1, 3, 6):
            for i in range(n):
                engine.add_request(f"{n}-{i}", prompt="def f(x):\n    return", sampling_params=(
                    SamplingParams(temperature=float(i % 2), seed=i, max_tokens=30,
                                   structured_outputs=so if i < n - 1 or n == 1 else None)))
            done = drive(engine)
            assert all(valid(o.outputs[0].text) for k, o in done.items() if k != f"{n}-{n - 1}"
                       or n == 1)
    assert compiles.count == 0


def test_constrained_outputs_over_int8_kv_with_logprobs(model):
    """int8 KV pages and per-token logprobs (of the raw logits: the masked-out tokens keep
    theirs) beside a grammar."""
    engine = Engine(model, **SHAPE, kv_cache_dtype="int8")
    so, valid = CASES["json"]
    for i in range(2):
        engine.add_request(f"q{i}", prompt="def parse(line):\n    ", sampling_params=(
            SamplingParams(temperature=1.0, seed=i, max_tokens=160, logprobs=2,
                           structured_outputs=so)))
    for out in drive(engine).values():
        c = out.outputs[0]
        assert c.finish_reason == "stop" and valid(c.text)
        assert len(c.logprobs) == len(c.token_ids)
        assert all(t in e and e[t].logprob <= 0 for t, e in zip(c.token_ids, c.logprobs,
                                                                strict=True))
