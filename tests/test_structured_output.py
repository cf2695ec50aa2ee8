"""Structured output in the in-process engine, on the tiny random Qwen2-VL (its free text is noise,
so only the grammar makes an answer parse): JSON schemas greedy and sampled in one batch, the
closer near the end of the token budget, constrained and free requests sharing a batch,
preemption under a small KV pool, bad constraints rejected before anything is queued,
`SamplingParams` folding, grammar-complete stops, regex / choice / GBNF / Lark grammars."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from vlm_engine.engine import Engine
from vlm_engine.sampling_params import SamplingParams
from vlm_engine.structured.spec import (
    StructuredOutput,
    StructuredOutputError,
    canonical_json,
    from_response_format,
    from_structured_outputs,
)
from testkit.json_schemas import CHOICES, EXAMPLES, REGEXES, SCHEMAS

FORMATS = jsonschema.Draft202012Validator.FORMAT_CHECKER
# jsonschema checks "date-time" only with an optional package; RFC 3339 section 5.6, by hand.
RFC3339_DATE_TIME = re.compile(
    r"\d{4}-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])[Tt ]([01]\d|2[0-3]):[0-5]\d:([0-5]\d|60)(\.\d+)?([Zz]|[+-]([01]\d|2[0-3]):[0-5]\d)"
)

# Varied features: nesting, arrays of objects with bounds, formats, oneOf/const, recursive $ref,
# prefixItems, nullable types, enums inside arrays.
BATCH_SCHEMAS = [
    "nested_object",
    "array_of_objects",
    "string_formats",
    "one_of_shapes",
    "recursive_tree",
    "tuple_prefix_items",
    "nullable_fields",
    "image_description",
]


def user(text: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": text}]


def check_json(text: str, schema: dict[str, Any], where: Any) -> Any:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise AssertionError(f"{where}: output does not parse ({exc}): {text!r}") from None
    try:
        jsonschema.validate(value, schema, format_checker=FORMATS)
    except jsonschema.ValidationError as exc:
        raise AssertionError(f"{where}: output does not validate ({exc.message}): {text!r}") from None
    _check_date_times(value, schema, where)
    return value


def _check_date_times(value: Any, schema: dict[str, Any], where: Any) -> None:
    props = schema.get("properties", {}) if isinstance(schema, dict) else {}
    if isinstance(value, dict):
        for key, sub in props.items():
            if key in value and isinstance(sub, dict) and sub.get("format") == "date-time":
                assert RFC3339_DATE_TIME.fullmatch(value[key]), (where, key, value[key])


@pytest.fixture(scope="module")
def engine(tiny_vlm_dir: Path) -> Engine:
    return Engine(str(tiny_vlm_dir), dtype="float32", kv_cache_tokens=32768, max_num_seqs=64)


def assert_idle(engine: Engine) -> None:
    assert not engine.scheduler.has_unfinished
    assert not engine.scheduler.running and not engine.scheduler.waiting and not engine.scheduler.requests
    assert engine.pool.num_used == 0 and engine.pool.num_free == engine.pool.num_pages


# ---- JSON schemas -------------------------------------------------------------------------------


@pytest.mark.slow
def test_schemas_greedy_and_sampled_in_one_batch(engine: Engine) -> None:
    convs, params, where = [], [], []
    for name in BATCH_SCHEMAS:
        for temperature, seed in ((0.0, None), (1.0, 11), (1.0, 12)):
            convs.append(user(f"Describe {name} as JSON."))
            params.append(SamplingParams(max_tokens=512, temperature=temperature, seed=seed, json_schema=SCHEMAS[name]))
            where.append((name, temperature, seed))
    outs = engine.chat(convs, params)
    for out, (name, temperature, seed) in zip(outs, where):
        check_json(out.text, SCHEMAS[name], (name, temperature, seed, out.finish_reason))
        assert out.finish_reason == "stop", (name, temperature, out.text)
        assert 0 < len(out.token_ids) <= 512
    # Sampling really sampled: the two seeds of a schema with free strings give different answers.
    texts = {w: o.text for w, o in zip(where, outs)}
    assert any(texts[(n, 1.0, 11)] != texts[(n, 1.0, 12)] for n in BATCH_SCHEMAS)
    assert_idle(engine)


def test_json_object_and_example_shapes(engine: Engine) -> None:
    """response_format json_object gives an object; every example in the set is valid (test oracle)."""
    for name, example in EXAMPLES.items():
        jsonschema.validate(example, SCHEMAS[name], format_checker=FORMATS)
    outs = engine.chat(
        [user("json"), user("json please")],
        [
            SamplingParams(max_tokens=128, temperature=t, seed=5, response_format={"type": "json_object"})
            for t in (0.0, 1.0)
        ],
    )
    for out in outs:
        assert isinstance(json.loads(out.text), dict), out.text
        assert out.finish_reason == "stop"


# ---- the closer -----------------------------------------------------------------------------------


@pytest.mark.parametrize("max_tokens", [40, 48, 60])
def test_closer_finishes_inside_a_small_budget(engine: Engine, max_tokens: int) -> None:
    names = ["simple_object", "bounded_array", "any_json_object", "number_ranges", "one_of_shapes"]
    convs, params, where = [], [], []
    for name in names:
        for temperature, seed in ((0.0, None), (1.0, 1), (1.0, 2), (1.5, 3)):
            convs.append(user(f"{name} {seed}"))
            params.append(
                SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed, json_schema=SCHEMAS[name])
            )
            where.append((name, temperature, seed, max_tokens))
    for out, w in zip(engine.chat(convs, params), where):
        check_json(out.text, SCHEMAS[w[0]], w)
        assert out.finish_reason == "stop", (w, out.text)
        assert len(out.token_ids) <= max_tokens, w


def test_budget_below_the_shortest_answer_ends_with_length(engine: Engine) -> None:
    # Shortest completions in the tiny vocabulary: nested_invoice ~370 tokens, string_formats ~110.
    cases = [("nested_invoice", 60), ("string_formats", 50), ("nested_invoice", 1)]
    params = [
        SamplingParams(max_tokens=m, temperature=t, seed=4, json_schema=SCHEMAS[n])
        for n, m in cases
        for t in (0.0, 1.0)
    ]
    outs = engine.chat([user("invoice")] * len(params), params)
    for out, sp in zip(outs, params):
        assert out.finish_reason == "length", (sp.max_tokens, out.text)
        assert len(out.token_ids) == sp.max_tokens
        assert out.text.startswith("{"), out.text  # a prefix of an answer, cut off
        with pytest.raises(json.JSONDecodeError):
            json.loads(out.text)
    assert_idle(engine)
    # The engine keeps serving constrained requests afterwards.
    out = engine.chat([user("x")], SamplingParams(max_tokens=64, temperature=0, json_schema=SCHEMAS["simple_object"]))[
        0
    ]
    check_json(out.text, SCHEMAS["simple_object"], "after length")


# ---- batching -------------------------------------------------------------------------------------


def test_free_requests_unchanged_by_constrained_neighbours(engine: Engine) -> None:
    free_prompts = [f"Tell me about item {i}." for i in range(4)]
    free = SamplingParams(max_tokens=24, temperature=0)
    alone = [engine.chat([user(p)], free)[0].token_ids for p in free_prompts]
    constrained = [
        SamplingParams(max_tokens=200, temperature=0, json_schema=SCHEMAS["nested_object"]),
        SamplingParams(max_tokens=200, temperature=1.0, seed=3, json_schema=SCHEMAS["array_of_objects"]),
        SamplingParams(max_tokens=32, temperature=1.0, seed=4, regex=REGEXES["us_phone"]),
        SamplingParams(max_tokens=8, temperature=0, choice=CHOICES["scene"]),
    ]
    convs: list[list[dict[str, Any]]] = []
    params: list[SamplingParams] = []
    for i, prompt in enumerate(free_prompts):  # interleaved: free, constrained, free, ...
        convs += [user(prompt), user(f"constrained {i}")]
        params += [free, constrained[i]]
    outs = engine.chat(convs, params)
    assert [outs[i].token_ids for i in range(0, len(outs), 2)] == alone
    assert all(len(a) > 0 for a in alone)
    check_json(outs[1].text, SCHEMAS["nested_object"], "mixed nested_object")
    check_json(outs[3].text, SCHEMAS["array_of_objects"], "mixed array_of_objects")
    assert re.fullmatch(REGEXES["us_phone"], outs[5].text), outs[5].text
    assert outs[7].text in CHOICES["scene"], outs[7].text
    # The free requests' text is not JSON-shaped by accident (the masks did not leak into them).
    assert not all(outs[i].text.startswith("{") for i in range(0, len(outs), 2))


@pytest.mark.slow
def test_preemption_keeps_constrained_outputs_valid(tiny_vlm_dir: Path, engine: Engine) -> None:
    names = [
        "simple_object",
        "nested_object",
        "bounded_array",
        "array_of_objects",
        "ref_defs",
        "booleans",
        "ocr_regions",
        "tool_call",
    ]
    convs = [user(f"Describe {name} as JSON.") for name in names for _ in range(2)]
    params = [
        SamplingParams(max_tokens=160, temperature=t, seed=s, json_schema=SCHEMAS[name])
        for name in names
        for t, s in ((0.0, None), (1.0, 21))
    ]
    # 16 requests of up to ~26 + 160 tokens (12 pages of 16) against 32 pages: preemption is certain.
    tight = Engine(str(tiny_vlm_dir), dtype="float32", kv_cache_tokens=512, max_num_seqs=16)
    assert tight.pool.num_pages == 32
    ids = [tight.add_request(tight.process_messages(c), sp) for c, sp in zip(convs, params)]
    requests = {rid: tight.scheduler.requests[rid] for rid in ids}
    final: dict[str, Any] = {}
    max_used = 0
    while len(final) < len(ids):
        for out in tight.step():
            if out.finished:
                final[out.request_id] = out
        max_used = max(max_used, tight.pool.num_used)
        assert tight.pool.num_used <= tight.pool.num_pages
    assert tight.scheduler.num_preemptions > 0
    preempted = [rid for rid in ids if requests[rid].num_preemptions > 0]
    assert preempted, "no request was preempted"
    for rid, conv, sp in zip(ids, convs, params):
        out = final[rid]
        name = names[ids.index(rid) // 2]
        check_json(out.text, SCHEMAS[name], (name, sp.temperature, requests[rid].num_preemptions))
        assert out.finish_reason == "stop", (name, out.text)
    assert max_used == tight.pool.num_pages  # the pool really ran full
    assert tight.pool.num_used == 0 and not tight.scheduler.has_unfinished
    # A preempted greedy request resumes with its grammar state intact: the same tokens as a
    # roomy engine that never preempted.
    greedy = [i for i, sp in enumerate(params) if sp.greedy]
    roomy = engine.chat([convs[i] for i in greedy], [params[i] for i in greedy])
    assert [final[ids[i]].token_ids for i in greedy] == [o.token_ids for o in roomy]


# ---- bad input ------------------------------------------------------------------------------------

BAD = [
    pytest.param(SamplingParams(json_schema={"type": "frobnicate"}), "frobnicate", id="bad-type"),
    pytest.param(
        SamplingParams(json_schema={"type": "array", "items": {"type": "integer"}, "uniqueItems": True}),
        "uniqueItems",
        id="uniqueItems",
    ),
    pytest.param(SamplingParams(json_schema={"$ref": "#/$defs/missing"}), "missing", id="missing-ref"),
    pytest.param(SamplingParams(json_schema={"type": "string", "pattern": "(("}), "regex", id="bad-pattern"),
    pytest.param(SamplingParams(regex="[a-z"), "regex", id="bad-regex"),
    pytest.param(SamplingParams(grammar="start: nowhere"), "nowhere", id="lark-undefined-rule"),
    pytest.param(
        SamplingParams(grammar="root ::= undefined_rule"), "undefined_rule", id="gbnf-undefined-rule"
    ),
    pytest.param(SamplingParams(grammar='root ::= "unterminated'), "", id="gbnf-syntax-error"),
]


@pytest.mark.parametrize(("bad", "words"), BAD)
def test_bad_constraints_raise_before_anything_is_queued(engine: Engine, bad: SamplingParams, words: str) -> None:
    ok = SamplingParams(max_tokens=8, temperature=0, json_schema=SCHEMAS["simple_object"])
    for params in ([bad], [ok, bad, ok], [ok, ok, bad]):
        with pytest.raises(StructuredOutputError) as info:
            engine.generate(["one", "two", "three"][: len(params)], params)
        assert isinstance(info.value, ValueError)
        assert words in info.value.message, info.value.message
        assert_idle(engine)
    # Through add_request too: rejected, nothing queued.
    with pytest.raises(StructuredOutputError):
        engine.add_request("hello", bad)
    assert_idle(engine)
    # The engine still serves.
    out = engine.generate(["hello"], ok)[0]
    assert out.finish_reason in ("stop", "length") and out.token_ids


def test_bad_constraint_forms_raise_at_construction() -> None:
    with pytest.raises(StructuredOutputError):
        SamplingParams(json_schema="{not json")
    with pytest.raises(StructuredOutputError):
        SamplingParams(json_schema=[1, 2])  # type: ignore[arg-type]
    with pytest.raises(StructuredOutputError):
        SamplingParams(choice=[])
    with pytest.raises(StructuredOutputError):
        SamplingParams(choice=["a", ""])
    with pytest.raises(StructuredOutputError):
        SamplingParams(regex="")
    with pytest.raises(StructuredOutputError):
        SamplingParams(grammar="   ")
    with pytest.raises(StructuredOutputError) as info:
        SamplingParams(response_format={"type": "yaml"})
    assert info.value.param == "response_format"
    with pytest.raises(StructuredOutputError):
        StructuredOutput("xml", "")


# ---- SamplingParams folding ---------------------------------------------------------------------


def test_sampling_params_fold_every_form() -> None:
    schema = SCHEMAS["simple_object"]
    as_schema = StructuredOutput("json_schema", canonical_json(schema))
    assert SamplingParams(json_schema=schema).structured_output == as_schema
    assert SamplingParams(json_schema=json.dumps(schema)).structured_output == as_schema
    rf = {"type": "json_schema", "json_schema": {"name": "person", "schema": schema, "strict": True}}
    assert SamplingParams(response_format=rf).structured_output == as_schema
    assert SamplingParams(response_format={"type": "json_object"}).structured_output == StructuredOutput("json_object")
    assert SamplingParams(response_format={"type": "text"}).structured_output is None
    assert SamplingParams(response_format={"type": "json_schema", "json_schema": {"name": "n"}}).structured_output == (
        StructuredOutput("json_schema", canonical_json({"type": "object"}))
    )
    assert SamplingParams(regex=r"\d+").structured_output == StructuredOutput("regex", r"\d+")
    choice = SamplingParams(choice=["yes", "no"]).structured_output
    assert choice == StructuredOutput("choice", json.dumps(["yes", "no"])) and choice.choices == ["yes", "no"]
    assert SamplingParams(choice=("a", "b")).structured_output.choices == ["a", "b"]
    assert SamplingParams(grammar='root ::= "a"').structured_output == StructuredOutput("grammar", 'root ::= "a"')
    direct = StructuredOutput.regex("[0-9]+")
    assert SamplingParams(structured_output=direct).structured_output is direct
    assert SamplingParams().structured_output is None
    # The conveniences are cleared once folded.
    sp = SamplingParams(json_schema=schema)
    assert sp.json_schema is sp.regex is sp.choice is sp.grammar is sp.response_format is None
    # vLLM's structured_outputs form gives the same specs.
    assert from_structured_outputs({"json": schema}) == as_schema
    assert from_structured_outputs({"choice": ["yes", "no"]}) == choice
    assert from_structured_outputs({"json_object": True}) == StructuredOutput("json_object")
    assert from_structured_outputs({"regex": "a", "json_object": False}) == StructuredOutput("regex", "a")
    assert from_response_format(None) is None


@pytest.mark.parametrize(
    "kwargs",
    [
        {"json_schema": {"type": "object"}, "regex": "a"},
        {"response_format": {"type": "json_object"}, "choice": ["a"]},
        {"structured_output": StructuredOutput.regex("a"), "grammar": 'root ::= "a"'},
        {"regex": "a", "choice": ["a"]},
        {"json_schema": {"type": "object"}, "response_format": {"type": "json_object"}},
    ],
)
def test_two_constraints_raise(kwargs: dict[str, Any]) -> None:
    with pytest.raises(StructuredOutputError, match="at most one"):
        SamplingParams(**kwargs)


def test_structured_outputs_needs_exactly_one() -> None:
    for value in ({"regex": "a", "choice": ["b"]}, {}, {"json_object": False}):
        with pytest.raises(StructuredOutputError, match="exactly one") as info:
            from_structured_outputs(value)
        assert info.value.param == "structured_outputs"


def test_params_stay_hashable() -> None:
    a = SamplingParams(max_tokens=9, json_schema={"type": "object", "properties": {"a": {"type": "array"}}})
    b = SamplingParams(
        max_tokens=9,
        response_format={
            "type": "json_schema",
            "json_schema": {"schema": {"type": "object", "properties": {"a": {"type": "array"}}}},
        },
    )
    assert hash(a) == hash(b) and a == b
    params = {a, b, SamplingParams(choice=["x", "y"]), SamplingParams(regex="x"), SamplingParams(grammar='start: "x"')}
    assert len(params) == 4
    assert hash(SamplingParams(choice=["x", "y"])) == hash(SamplingParams(choice=("x", "y")))
    assert {StructuredOutput.choice(["x"]): 1}[StructuredOutput("choice", '["x"]')] == 1


# ---- the grammar stops the request; regex / choice / grammars ----------------------------------


def test_choice_is_exact_and_stops_without_extra_tokens(engine: Engine) -> None:
    params = [
        SamplingParams(max_tokens=16, temperature=t, seed=s, choice=["yes", "no"])
        for t, s in ((0.0, None), (1.0, 1), (1.0, 2), (2.0, 3))
    ]
    params += [SamplingParams(max_tokens=16, temperature=1.0, seed=s, choice=CHOICES["scene"]) for s in range(4)]
    outs = engine.chat([user(f"question {i}") for i in range(len(params))], params)
    for out, sp in zip(outs, params):
        choices = sp.structured_output.choices
        assert out.text in choices, out.text
        assert out.finish_reason == "stop"
        # The grammar ended it: no EOS was sampled, and the tokens spell exactly the choice.
        assert not set(out.token_ids) & engine.eos_token_ids, out.token_ids
        assert out.stop_reason is None
        assert engine.tokenizer.decode(out.token_ids) == out.text
        assert len(out.token_ids) <= len(out.text)  # sampled spellings may split the word, never pad it
    assert_idle(engine)


def test_regex_outputs_fullmatch(engine: Engine) -> None:
    names = list(REGEXES)
    params = [SamplingParams(max_tokens=64, temperature=t, seed=9, regex=REGEXES[n]) for n in names for t in (0.0, 1.0)]
    outs = engine.chat([user(f"{n}") for n in names for _ in (0, 1)], params)
    for out, sp, name in zip(outs, params, [n for n in names for _ in (0, 1)]):
        assert re.fullmatch(sp.structured_output.spec, out.text), (name, out.text)
        assert len(out.token_ids) <= 64
        if name == "word_list":
            # `[a-z]+` stays accepting forever: a model that never samples EOS runs to the budget.
            assert out.finish_reason in ("stop", "length"), name
        else:
            assert out.finish_reason == "stop", (name, out.text)
    # Fixed-length patterns (and one ending in "."), end by the grammar, before any EOS.
    for out, name in zip(outs, [n for n in names for _ in (0, 1)]):
        if name in ("us_phone", "hex_colour", "iso_date", "yes_no_reason"):
            assert not set(out.token_ids) & engine.eos_token_ids, (name, out.token_ids)
            assert out.stop_reason is None


def test_regex_closer_in_a_tight_budget(engine: Engine) -> None:
    """Regexes that need a closing "." get it inside a small budget. The closer's completions
    here are 'n, n, n, nnntnnnt.' (18 tokens) and 'nnntnnntnnnt.' (13); budgets from there up."""
    cases = [(r"[a-z]{1,8}(, [a-z]{1,8}){0,3}\.", m) for m in (18, 21, 26)] + [
        (r"[a-z]{1,12}\.", m) for m in (13, 16, 20)
    ]
    params = [
        SamplingParams(max_tokens=m, temperature=t, seed=s, regex=p)
        for p, m in cases
        for t in (1.0, 2.0)
        for s in range(3)
    ]
    for out, sp in zip(engine.chat([user("words")] * len(params), params), params):
        assert re.fullmatch(sp.structured_output.spec, out.text), (sp.structured_output.spec, sp.max_tokens, out.text)
        assert len(out.token_ids) <= sp.max_tokens
        assert out.finish_reason == "stop", (sp.max_tokens, out.text)


def test_grammar_completed_on_the_last_token_is_stop(engine: Engine) -> None:
    # Digits are single tokens in this vocabulary: "[0-9]{3}" takes exactly 3 tokens, an ISO date 10.
    cases = [(r"[0-9]{3}", 3), (REGEXES["iso_date"], 10)]
    params = [SamplingParams(max_tokens=m, temperature=0, regex=p) for p, m in cases]
    outs = engine.chat([user("digits"), user("date")], params)
    for out, (pattern, m) in zip(outs, cases):
        assert re.fullmatch(pattern, out.text) and len(out.token_ids) == m, out.text
    assert [o.finish_reason for o in outs] == ["stop", "stop"]


def test_closer_keeps_an_accepting_output_accepting(engine: Engine) -> None:
    """Top-level numbers: accepting after one digit, but "." or "e" then need more tokens."""
    params = [
        SamplingParams(max_tokens=m, temperature=2.0, seed=s, regex=r"[0-9]+(\.[0-9]+)?")
        for m in (2, 3, 5)
        for s in range(30)
    ]
    params += [
        SamplingParams(max_tokens=m, temperature=2.0, seed=s, json_schema={"type": "number"})
        for m in (2, 3, 5)
        for s in range(30)
    ]
    outs = engine.generate([f"n {i}" for i in range(len(params))], params)
    bad = []
    for out, sp in zip(outs, params):
        if sp.structured_output.kind == "regex":
            good = re.fullmatch(r"[0-9]+(\.[0-9]+)?", out.text) is not None
        else:
            try:
                good = isinstance(json.loads(out.text), (int, float))
            except json.JSONDecodeError:
                good = False
        if not good:
            bad.append((sp.structured_output.kind, sp.max_tokens, out.finish_reason, out.text))
    assert not bad, bad


@pytest.mark.parametrize("pattern", [r"[a-z]+\.", r"[a-z]+(, [a-z]+)*\."])
def test_closer_handles_an_unbounded_run_before_a_terminator(engine: Engine, pattern: str) -> None:
    params = [SamplingParams(max_tokens=12, temperature=1.0, seed=s, regex=pattern) for s in range(4)]
    for out in engine.chat([user("words")] * len(params), params):
        assert re.fullmatch(pattern, out.text), out.text
        assert out.finish_reason == "stop"


GBNF = r"""
root   ::= "(" number ("," number)* ")"
number ::= [1-9] [0-9]{0,2}
"""
LARK = r"""
start: greeting " " NAME "!"
greeting: "hello" | "hi"
NAME: /[a-z]{2,8}/
"""


def test_gbnf_and_lark_grammars(engine: Engine) -> None:
    params = [
        SamplingParams(max_tokens=48, temperature=t, seed=s, grammar=g)
        for g in (GBNF, LARK)
        for t, s in ((0.0, None), (1.0, 5), (1.0, 6))
    ]
    outs = engine.chat([user("grammar")] * len(params), params)
    for out in outs[:3]:
        assert re.fullmatch(r"\([1-9][0-9]{0,2}(,[1-9][0-9]{0,2})*\)", out.text), out.text
        assert out.finish_reason == "stop"
    for out in outs[3:]:
        assert re.fullmatch(r"(hello|hi) [a-z]{2,8}!", out.text), out.text
        assert out.finish_reason == "stop"
        assert not set(out.token_ids) & engine.eos_token_ids  # "!" completes the grammar
