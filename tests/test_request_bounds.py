"""Per-request values that the workers cannot represent are refused for that request only (issue 12).

The engine must survive every one of them: a refused value is a ValueError from ``add_request`` (a per-line
error in a batch), never a failed step that would take every request in flight with it.
"""

from __future__ import annotations

import threading

import pytest

from engine.execution import codec
from engine.llm import LLM
from scheduler.sampling_params import SamplingParams
from tests.conftest import VOCAB
from workers.messages import SamplingSpec


@pytest.fixture(scope="module")
def llm(llama) -> LLM:
    return LLM(llama.target, max_model_len=32)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"top_k": 1 << 63}, r"top_k must be -1 or 0 \(off\) or between 1 and 2147483647"),
    ({"seed": 1 << 63}, r"seed must be a 64-bit integer"),
    ({"seed": -(1 << 63) - 1}, r"seed must be a 64-bit integer"),
    ({"temperature": 1e9}, r"temperature must be <= 100"),
    ({"temperature": 10 ** 400}, r"temperature must be a finite number, got an integer of"),
    ({"temperature": float("inf")}, r"temperature must be a finite number"),
    ({"max_tokens": 1 << 40}, r"max_tokens must be <= 2147483648"),
    ({"stop_token_ids": [-1]}, r"stop_token_ids must be token ids >= 0"),
])
def test_sampling_params_bounds(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_the_edges_of_the_ranges_are_accepted_and_cross_the_msgpack_wire() -> None:
    for seed in (0, (1 << 63) - 1, -(1 << 63)):
        p = SamplingParams(seed=seed, temperature=100.0, top_k=2147483647)
        spec = SamplingSpec(p.temperature, p.top_k, p.top_p, p.min_p, p.seed)
        assert codec.decode(codec.encode(spec)) == spec  # the zmq transport to Ray workers


@pytest.mark.parametrize(("field", "value", "message"), [
    ("top_k", VOCAB + 1, rf"top_k must be -1 or 0 \(off\) or between 1 and the vocabulary size, {VOCAB}, got"),
    ("top_k", 1 << 63, r"between 1 and the vocabulary size, 128, got"),
    ("seed", 1 << 64, r"seed must be a 64-bit integer"),
    ("temperature", float("nan"), r"temperature must be a finite number"),
    ("max_tokens", 0, r"max_tokens must be >= 1"),
])
def test_a_field_changed_after_construction_is_refused_at_add_request(llm: LLM, field: str, value, message) -> None:
    bad = SamplingParams(max_tokens=3, temperature=0)
    setattr(bad, field, value)
    with pytest.raises(ValueError, match=message):
        llm.generate([[1, 2, 3], [4, 5]], [SamplingParams(max_tokens=3, temperature=0), bad])
    # Nothing was queued and the engine still works.
    assert not llm.engine.has_unfinished
    (out,) = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=3, temperature=0))
    assert len(out.token_ids) == 3


def test_top_k_equal_to_the_vocabulary_and_a_64_bit_seed_run(llm: LLM) -> None:
    outs = llm.generate([[1, 2, 3]] * 2, [SamplingParams(max_tokens=4, top_k=VOCAB, seed=(1 << 63) - 1),
                                          SamplingParams(max_tokens=4, seed=-(1 << 63))])
    assert [len(o.token_ids) for o in outs] == [4, 4]


def test_a_lone_surrogate_prompt_is_a_per_request_error(with_tokenizer: str) -> None:
    llm = LLM(with_tokenizer, max_model_len=64)
    with pytest.raises(ValueError, match=r"prompt: not valid Unicode text \(surrogates not allowed at character 2\)"):
        llm.engine.add_request("x", "ab\ud800c", SamplingParams(max_tokens=2))
    assert not llm.engine.has_unfinished
    (out,) = llm.generate("abc", SamplingParams(max_tokens=2, temperature=0))
    assert len(out.token_ids) == 2


def test_generate_from_two_threads_gives_each_caller_its_own_results(llm: LLM) -> None:
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    prompts = {name: [[1, 5 + i, 9 + j] for j in range(4)] for i, name in enumerate(("a", "b"))}
    expected = {name: [o.token_ids for o in llm.generate(p, params)] for name, p in prompts.items()}
    got: dict[str, list] = {}
    errors: list[BaseException] = []
    start = threading.Barrier(2)

    def call(name: str) -> None:
        try:
            start.wait(timeout=30)
            for _ in range(3):
                outs = llm.generate(prompts[name], params)
                assert [o.token_ids for o in outs] == expected[name]
            got[name] = outs
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=call, args=(n,)) for n in prompts]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    assert set(got) == {"a", "b"}


def test_a_second_call_in_the_thread_of_an_unfinished_stream_is_refused(llm: LLM) -> None:
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    stream = llm.stream([[1, 2, 3]], params)
    next(stream)
    with pytest.raises(RuntimeError, match="already running a generate\\(\\) or stream\\(\\) in this thread"):
        llm.generate([[4, 5]], params)
    stream.close()  # aborts the rest; the LLM is free again
    (out,) = llm.generate([[4, 5]], params)
    assert len(out.token_ids) == 4
