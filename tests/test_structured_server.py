"""Structured outputs over HTTP with the official ``openai`` client on the built-in pair: response_format with a
JSON schema (bounded strings) and json_object, vLLM's guided_* and structured_outputs fields, speculation on and
off: every answer that finishes with "stop" parses and validates; a schema that does not compile is a 400."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pytest

from tests.helpers_server import SubprocessServer

pytestmark = pytest.mark.slow  # `specserve serve` subprocesses on the built-in pair

SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                           "population": {"type": "integer"},
                                           "sights": {"type": "array", "maxItems": 2,
                                                      "items": {"type": "string", "maxLength": 6}}},
          "required": ["city", "population", "sights"], "additionalProperties": False}


@pytest.fixture(scope="module", params=["spec", "nospec"])
def server(request):
    args = () if request.param == "spec" else ("--speculative-config", "none")
    srv = SubprocessServer(*args, env={"OMP_NUM_THREADS": "1"})
    yield srv, openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=120)
    srv.stop()


def test_json_schema_answers_validate(server) -> None:
    srv, client = server
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA, "strict": True}}
    r = client.chat.completions.create(model="specserve-default", messages=[{"role": "user", "content": "A city?"}],
                                       max_tokens=80, temperature=0.8, seed=3, n=4, response_format=fmt)
    assert len(r.choices) == 4
    stopped = [c for c in r.choices if c.finish_reason == "stop"]
    assert stopped
    for c in stopped:
        jsonschema.validate(json.loads(c.message.content), SCHEMA)
    r = client.completions.create(model="specserve-default", prompt="Data:", max_tokens=60, temperature=0,
                                  extra_body={"response_format": {"type": "json_object"}})
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].text), dict)


def test_vllm_guided_fields(server) -> None:
    srv, client = server
    r = client.completions.create(model="specserve-default", prompt="Pick:", max_tokens=10, temperature=0,
                                  extra_body={"guided_choice": ["red", "green", "blue"]})
    assert r.choices[0].text in ("red", "green", "blue")
    r = client.completions.create(model="specserve-default", prompt="Code:", max_tokens=10, temperature=0,
                                  extra_body={"guided_regex": "[A-Z]{3}-[0-9]{2}"})
    assert re.fullmatch("[A-Z]{3}-[0-9]{2}", r.choices[0].text)
    r = client.completions.create(model="specserve-default", prompt="Code:", max_tokens=10, temperature=0,
                                  extra_body={"structured_outputs": {"regex": "[a-z]{4}"}})
    assert re.fullmatch("[a-z]{4}", r.choices[0].text)


@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "structured_outputs"),
    ({"response_format": {"type": "yaml"}}, "response_format"),
    ({"guided_regex": "(", }, "structured_outputs"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
])
def test_bad_grammars_are_400s(server, body, param) -> None:
    srv, _ = server
    r = httpx.post(srv.url + "/v1/completions", json={"prompt": "x", **body}, timeout=60)
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == param, err
