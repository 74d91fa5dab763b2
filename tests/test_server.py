"""``specserve serve`` on the built-in pair, driven by the official ``openai`` client.

One server per module (a subprocess on an ephemeral loopback port); greedy results are compared with
``LLM.generate`` on the same prompts in this process.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest

from engine.core.config import DEFAULT_MODELS_DIR
from scheduler.sampling_params import SamplingParams
from tests.helpers_server import SubprocessServer, metric_value, wait_until

pytestmark = pytest.mark.slow  # a `specserve serve` subprocess on the built-in pair

MODEL = "specserve-default"
PROMPTS = [json.loads(line)["prompt"] for line in (DEFAULT_MODELS_DIR / "prompts.jsonl").read_text().splitlines()]
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def server():
    srv = SubprocessServer("--max-queue", "128", env={"OMP_NUM_THREADS": "1"})
    yield srv
    assert srv.stdout_lines.empty(), "stdout carries only the 'serving on' line"
    # SIGTERM: uvicorn shuts down gracefully, then exits by the signal it caught (-15).
    assert srv.stop() in (0, -15) and "Traceback" not in srv.stderr, srv.stderr[-3000:]


@pytest.fixture(scope="module")
def llm():
    from engine import LLM

    with LLM() as llm:
        yield llm


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _greedy(n: int = MAX_TOKENS) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0)


def test_models(client) -> None:
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]


def test_greedy_completions_equal_llm_generate(client, llm) -> None:
    prompts = PROMPTS[:3]
    expected = [o.text for o in llm.generate(prompts, _greedy())]
    batch = client.completions.create(model=MODEL, prompt=prompts, max_tokens=MAX_TOKENS, temperature=0)
    assert [c.text for c in sorted(batch.choices, key=lambda c: c.index)] == expected
    assert batch.usage.completion_tokens == sum(len(o.token_ids) for o in llm.generate(prompts, _greedy()))
    spec = batch.model_extra["spec_decode"]
    assert spec["rounds"] > 0 and spec["mean_acceptance_length"] > 1  # speculation is on, and it is reported
    # One prompt, streamed: the deltas concatenate to the same text.
    chunks = list(client.completions.create(model=MODEL, prompt=prompts[0], max_tokens=MAX_TOKENS, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected[0]
    assert chunks[-1].usage.completion_tokens > 0 and chunks[-1].model_extra["spec_decode"]["rounds"] > 0


def test_token_id_prompts(client, llm) -> None:
    ids = llm.tokenizer.encode(PROMPTS[3])
    expected = llm.generate([ids], _greedy())[0].text
    out = client.completions.create(model=MODEL, prompt=ids, max_tokens=MAX_TOKENS, temperature=0)
    assert out.choices[0].text == expected and out.usage.prompt_tokens == len(ids)


def test_chat_uses_the_builtin_template(client, llm) -> None:
    messages = [{"role": "system", "content": "Python standard library"},
                {"role": "user", "content": "Return the n-th Fibonacci number."}]
    rendered = llm.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered == "# Python standard library\n# Return the n-th Fibonacci number.\n"
    expected = llm.generate([rendered], _greedy())[0].text
    full = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=MAX_TOKENS, temperature=0)
    assert full.choices[0].message.content == expected and full.choices[0].finish_reason in ("length", "stop")
    assert full.usage.prompt_tokens == len(llm.tokenizer.encode(rendered))
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=MAX_TOKENS,
                                                 temperature=0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected


def test_64_concurrent_streams(server, llm) -> None:
    prompts = [PROMPTS[i % 16] for i in range(64)]
    expected = {p: o.text for p, o in zip(PROMPTS[:16], llm.generate(PROMPTS[:16], _greedy()), strict=True)}

    async def one(aclient: openai.AsyncOpenAI, prompt: str) -> str:
        stream = await aclient.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                                  stream=True)
        return "".join([c.choices[0].text async for c in stream])

    async def run() -> list[str]:
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                                      timeout=300) as aclient:
            return await asyncio.wait_for(asyncio.gather(*[one(aclient, p) for p in prompts]), 600)

    texts = asyncio.run(run())
    assert texts == [expected[p] for p in prompts]


def test_disconnect_mid_stream_frees_the_request(server) -> None:
    body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=60) as http, http.stream("POST", server.url + "/v1/completions", json=body) as r:
        lines = r.iter_lines()
        for _ in range(6):
            next(lines)
        running = metric_value(http.get(server.url + "/metrics").text, "specserve:num_requests_running")
        assert running == 1
    # Closing the response closed the connection: the server aborts the request and the engine frees it.
    text = wait_until(lambda: (t := httpx.get(server.url + "/metrics").text)
                      and metric_value(t, "specserve:num_requests_running") == 0 and t, timeout_s=60,
                      what="the running count to drop to 0")
    assert metric_value(text, "specserve:request_success_total", {"finished_reason": "abort"}) >= 1
    assert metric_value(text, "specserve:kv_cache_usage_perc") == 0


@pytest.mark.parametrize("kwargs, words", [
    ({"prompt": "def f():\n    pass\n" * 200}, ["prompt", "context is 512"]),
    ({"prompt": "def f():", "max_tokens": 600}, ["max_tokens", "context of 512"]),
    ({"prompt": "def f():", "top_p": 0}, ["top_p", "(0, 1]"]),
    ({"prompt": "def f():", "temperature": -0.5}, ["temperature", ">= 0"]),
    ({"prompt": [[1, 5000]]}, ["prompt_token_ids", "4096"]),
    ({"prompt": "def f():", "logprobs": 21}, ["logprobs", "20"]),
    ({"prompt": "def f():", "n": 17}, ["n", "16"]),
    ({"prompt": "def f():", "n": 2, "best_of": 3}, ["best_of", "not supported"]),
    ({"prompt": "def f():", "extra_body": {"top_k": 0.5}}, ["top_k"]),
])
def test_400s_name_the_field(client, kwargs, words) -> None:
    extra = kwargs.pop("extra_body", None)
    with pytest.raises(openai.BadRequestError) as exc:
        client.completions.create(model=MODEL, max_tokens=kwargs.pop("max_tokens", 4), extra_body=extra, **kwargs)
    message = exc.value.body["message"]
    assert all(w in message for w in words), message


def test_a_lone_surrogate_is_a_400_naming_the_field(server) -> None:
    """JSON may escape a lone surrogate ("\\ud800"): it has no UTF-8, so no tokens; a 400, not a 500."""
    body = b'{"model": "%s", "prompt": "def f(\\ud800):", "max_tokens": 2}' % MODEL.encode()
    r = httpx.post(server.url + "/v1/completions", content=body, headers={"Content-Type": "application/json"})
    assert r.status_code == 400, r.text
    assert "prompt" in r.json()["error"]["message"] and "surrogate" in r.json()["error"]["message"]
    chat = (b'{"model": "%s", "messages": [{"role": "user", "content": "\\udfff"}], "max_tokens": 2}'
            % MODEL.encode())
    r = httpx.post(server.url + "/v1/chat/completions", content=chat, headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and "messages" in r.json()["error"]["message"], r.text


def test_health_metrics_and_a_wrong_model(server, client) -> None:
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    text = httpx.get(server.url + "/metrics").text
    assert metric_value(text, "specserve:spec_decode_num_drafts_total") > 0
    assert metric_value(text, "specserve:spec_decode_num_accepted_tokens_per_pos_total", {"position": "0"}) > 0
    # The default server runs the adaptive policy (K_max 8): which depths it chose depends on the machine's
    # measured costs, but it chose some, and some speculative ones on these short greedy requests.
    depths = {d: metric_value(text, "specserve:spec_decode_chosen_depth_total", {"depth": str(d)}) or 0
              for d in range(9)}
    assert sum(n for d, n in depths.items() if d > 0) > 0, depths
    assert metric_value(text, "specserve:generation_tokens_total") > 0
    assert metric_value(text, "specserve:time_to_first_token_seconds_count") > 0
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt="x", max_tokens=1)
