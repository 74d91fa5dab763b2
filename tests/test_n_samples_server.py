"""n > 1 over HTTP with the official ``openai`` client: n choices per prompt in OpenAI's order (index i * n + j),
streamed and not; greedy choices identical, seeded ones reproducible and different; n past the server's max_n
and best_of > n are 400s naming the field."""

from __future__ import annotations

import httpx
import pytest

from tests.test_logprobs_server import served  # noqa: F401  (the module's server fixture)

pytestmark = pytest.mark.slow  # builds two engines and a uvicorn server (~6 s)

MSG = [{"role": "user", "content": "hi"}]


def test_completions_n_choices_in_openai_order(served) -> None:  # noqa: F811
    client = served[1]
    r = client.completions.create(model="tiny", prompt=["ab", "cd"], n=3, max_tokens=5, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == list(range(6))
    texts = [c.text for c in r.choices]
    assert texts[0] == texts[1] == texts[2] and texts[3] == texts[4] == texts[5]
    alone = client.completions.create(model="tiny", prompt="cd", max_tokens=5, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert texts[3] == alone.choices[0].text
    assert r.usage.completion_tokens == 30 and r.usage.prompt_tokens == 4  # the prompt counts once

    sampled = dict(model="tiny", prompt="ab", n=4, max_tokens=12, temperature=1.0, seed=5,
                   extra_body={"ignore_eos": True})
    a = [c.text for c in client.completions.create(**sampled).choices]
    b = [c.text for c in client.completions.create(**sampled).choices]
    assert a == b and len(set(a)) == 4
    events = list(client.completions.create(**sampled, stream=True))
    streamed = ["".join(e.choices[0].text for e in events if e.choices and e.choices[0].index == i)
                for i in range(4)]
    assert streamed == a


def test_chat_n_choices_streamed_and_not(served) -> None:  # noqa: F811
    client = served[1]
    kw = dict(model="tiny", messages=MSG, n=3, max_tokens=6, temperature=1.0, seed=9,
              extra_body={"ignore_eos": True})
    r = client.chat.completions.create(**kw)
    assert [c.index for c in r.choices] == [0, 1, 2] and len({c.message.content for c in r.choices}) == 3
    chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    texts = ["".join(c.choices[0].delta.content or "" for c in chunks if c.choices and c.choices[0].index == i)
             for i in range(3)]
    assert texts == [c.message.content for c in r.choices]
    assert chunks[-1].usage.completion_tokens == 18


@pytest.mark.parametrize("path, body, param, words", [
    ("/v1/completions", {"prompt": "x", "n": 17}, "n", "max_n = 16"),
    ("/v1/completions", {"prompt": "x", "n": 0}, "n", "greater than or equal to 1"),
    ("/v1/completions", {"prompt": "x", "n": 2, "best_of": 3}, "best_of", "choose on the client"),
    ("/v1/chat/completions", {"messages": MSG, "n": 17}, "n", "max_n"),
])
def test_limits(served, path, body, param, words) -> None:  # noqa: F811
    r = httpx.post(served[0].url + path, json=body, timeout=30)
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == param and words in err["message"], err
    ok = httpx.post(served[0].url + "/v1/completions", json={"prompt": "x", "n": 2, "best_of": 2, "max_tokens": 1},
                    timeout=30)
    assert ok.status_code == 200 and len(ok.json()["choices"]) == 2
