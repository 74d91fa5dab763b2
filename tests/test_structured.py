"""Structured outputs on the built-in pair: answers that finish with "stop" match their grammar (JSON schemas with
bounded strings validate with jsonschema); greedy with a grammar and speculation (chain, tree) == greedy with the
grammar alone; sampled answers under a grammar have the same law with speculation on and off (two-sample
chi-square); a grammar request and a plain one share a batch without touching each other; bad grammars are refused
when queued."""

from __future__ import annotations

import json
import re
from collections import Counter

import jsonschema
import pytest

from engine.llm import LLM
from scheduler.sampling_params import SamplingParams

pytestmark = pytest.mark.slow  # three engines on the built-in pair (the char tokenizer of the tiny test models
#                                has a decoder llguidance cannot read)

PROMPTS = ["Once upon a time", "The answer is", "hello", "A list of fruits:"]
SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer"}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string", "maxLength": 4},
                                               "maxItems": 3},
                                      "ok": {"type": "boolean"}}, "required": ["tags", "ok"],
     "additionalProperties": False},
]

def _spec(kind: str) -> dict | str:
    from engine.core.config import DEFAULT_MODELS_DIR

    if kind == "none":
        return "none"
    base = {"method": "draft_model", "model": str(DEFAULT_MODELS_DIR / "draft"), "num_speculative_tokens": 3,
            "adaptive": False}  # a fixed depth: no start-up profiling, and every round speculates
    return base if kind == "chain" else {**base, "tree_branching": [2, 2, 1]}


@pytest.fixture(scope="module")
def engines():
    llms = {k: LLM(None, _spec(k)) for k in ("none", "chain", "tree")}
    yield llms
    for llm in llms.values():
        llm.shutdown()


def _check(text: str, spec: dict) -> None:
    if "json" in spec:
        jsonschema.validate(json.loads(text), spec["json"])
    elif "regex" in spec:
        assert re.fullmatch(spec["regex"], text), text
    elif "choice" in spec:
        assert text in spec["choice"], text


GRAMMARS = [{"json": s} for s in SCHEMAS] + [{"regex": r"[a-z]{2,6}-[0-9]{1,3}"},
                                             {"choice": ["yes", "no", "maybe so"]}, {"json_object": True}]


@pytest.mark.parametrize("grammar", GRAMMARS, ids=["schema1", "schema2", "regex", "choice", "json_object"])
def test_greedy_answers_match_the_grammar_and_speculation_changes_nothing(engines, grammar) -> None:
    params = SamplingParams(max_tokens=48, temperature=0, structured_outputs=grammar)
    outs = {k: engines[k].generate(PROMPTS, params) for k in engines}
    for k in ("chain", "tree"):
        assert [o.token_ids for o in outs[k]] == [o.token_ids for o in outs["none"]], k
    stopped = [o for o in outs["none"] if o.finish_reason == "stop"]
    assert stopped, "no answer finished within max_tokens"
    for o in stopped:
        text = o.text.removesuffix("</s>") if o.text else o.text
        _check(text, grammar)
    for o in outs["none"]:
        assert o.finish_reason in ("stop", "length")


@pytest.mark.slow  # 3 x 300 sampled requests (~90 s on the loaded 2-core machine)
def test_sampled_answers_match_and_keep_their_law_under_speculation(engines) -> None:
    from scipy.stats import chi2_contingency

    grammar = {"regex": r"(cat|dog|bird|fish)s?"}
    n = 300
    counts = {}
    for k in ("none", "chain", "tree"):
        params = [SamplingParams(max_tokens=8, temperature=1.0, seed=1000 * i + 7, structured_outputs=grammar)
                  for i in range(n)]
        outs = engines[k].generate([PROMPTS[0]] * n, params)
        for o in outs:
            if o.finish_reason == "stop":
                _check(o.text, grammar)
        counts[k] = Counter(o.text for o in outs)
    keys = sorted(set().union(*counts.values()))
    for k in ("chain", "tree"):
        table = [[counts["none"][t] + 0.5 for t in keys], [counts[k][t] + 0.5 for t in keys]]
        assert chi2_contingency(table).pvalue > 1e-3, (k, counts["none"], counts[k])


def test_a_grammar_request_and_a_plain_one_share_a_batch(engines) -> None:
    plain = SamplingParams(max_tokens=24, temperature=0)
    alone = engines["chain"].generate([PROMPTS[1]], plain)[0].token_ids
    mixed = engines["chain"].generate([PROMPTS[0], PROMPTS[1]],
                                      [SamplingParams(max_tokens=24, temperature=0,
                                                      structured_outputs={"json": SCHEMAS[0]}), plain])
    assert mixed[1].token_ids == alone
    assert mixed[0].text.startswith("{")


@pytest.mark.parametrize("grammar, words", [
    ({"json": "{not json"}, "not valid JSON"),
    ({"regex": "(unclosed"}, "does not compile"),
    ({"grammar": "start: undefined_rule"}, "does not compile"),
    ({"json": {"type": "object"}, "regex": "a"}, "exactly one"),
    ({"choice": []}, "choice"),
])
def test_bad_grammars_are_refused_when_queued(engines, grammar, words) -> None:
    with pytest.raises(ValueError, match=words):
        engines["none"].engine.add_request("bad", "x", SamplingParams(structured_outputs=grammar))
    assert not engines["none"].engine.has_unfinished


def test_a_grammar_that_cannot_finish_ends_with_length(engines) -> None:
    grammar = {"regex": r"[a-z]{30}"}
    out = engines["chain"].generate(["x"], SamplingParams(max_tokens=5, temperature=0,
                                                          structured_outputs=grammar))[0]
    assert out.finish_reason == "length" and re.fullmatch(r"[a-z]*", out.text)


def test_generate_job_lines_take_structured_outputs(engines) -> None:
    import io

    from engine.jobs.generate import run_batch

    lines = [json.dumps({"id": "a", "prompt": "x", "max_tokens": 8, "temperature": 0,
                         "structured_outputs": {"choice": ["yes", "no"]}}),
             json.dumps({"id": "b", "prompt": "x", "structured_outputs": {"regex": "("}})]
    out = io.StringIO()
    run_batch(engines["none"].engine, lines, out, {}, progress=False)
    a, b = (json.loads(s) for s in out.getvalue().splitlines())
    assert a["text"] in ("yes", "no") and "does not compile" in b["error"]
