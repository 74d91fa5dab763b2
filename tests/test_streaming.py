"""The streaming step: a delta per request per step, incremental text and stop strings, and abort."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from engine.core.config import default_model_dirs
from engine.core.detokenizer import IncrementalDetokenizer
from engine.core.stopping import StopChecker
from tests.conftest import VOCAB, spec
from tests.helpers_models import make_char_tokenizer, make_tiny_checkpoint
from workers.loader import load_tokenizer

LONG = 4000


class CountingTokenizer:
    """Counts the tokens every decode call reads: quadratic re-decoding shows as ~n^2/2."""

    def __init__(self, tok) -> None:
        self.tok = tok
        self.decoded = 0

    def decode(self, ids, **kw):
        self.decoded += len(ids)
        return self.tok.decode(ids, **kw)

    def encode(self, text, **kw):
        return self.tok.encode(text, **kw)


@pytest.fixture(scope="module")
def long_context(tmp_path_factory) -> str:
    """The character-tokenizer model with room for a 4,000-token output."""
    return make_tiny_checkpoint(tmp_path_factory.mktemp("long") / "target", family="llama", vocab_size=VOCAB,
                                seed=5, num_hidden_layers=1, with_tokenizer=True,
                                max_position_embeddings=LONG + 64)


@pytest.fixture(scope="module")
def bpe():
    return load_tokenizer(default_model_dirs()[0])  # byte-level BPE: multi-byte characters span tokens


def _by_request(deltas) -> dict[str, list]:
    out: dict[str, list] = {}
    for d in deltas:
        out.setdefault(d.request_id, []).append(d)
    return out


# ------------------------------------------------------------------------------------------- detokenization
def test_multibyte_characters_come_out_whole(bpe) -> None:
    text = "héllo wörld — naïve café 你好世界 😀🚀 ok"
    ids = bpe.encode(text)
    assert any("\ufffd" in bpe.decode([t]) for t in ids), "no token splits a character: the test shows nothing"
    detok = IncrementalDetokenizer(bpe)
    pieces = [detok.append(t) for t in ids]
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) + detok.flush() == detok.text == bpe.decode(ids)


def test_flush_keeps_a_cut_character(bpe) -> None:
    ids = bpe.encode("ab😀")
    detok = IncrementalDetokenizer(bpe)
    held = [detok.append(t) for t in ids[:-1]]
    assert "".join(held) + detok.flush() == bpe.decode(ids[:-1])  # the cut emoji decodes as U+FFFD, once


# --------------------------------------------------------------------------------------------- stop strings
def _feed(checker: StopChecker, ids: list[int], chunk: int) -> tuple[list[int], bool, str]:
    """Feed ``ids`` a chunk at a time, as rounds do; returns (kept, stopped, streamed text)."""
    kept, streamed = [], []
    for i in range(0, len(ids), chunk):
        k, stopped = checker.truncate(ids[i:i + chunk], 1 << 30)
        kept += k
        if stopped:
            return kept, True, "".join(streamed) + checker.take_text(True)
        streamed.append(checker.take_text(False))
    return kept, False, "".join(streamed) + checker.take_text(True)


@pytest.mark.parametrize("chunk", [1, 2, 3, 7])
def test_stop_string_spanning_tokens(bpe, chunk: int) -> None:
    text = "the quick brown fox — jumps wörld over 😀 the lazy dog"
    ids = bpe.encode(text)
    stop = "wörld"
    assert not any(stop in bpe.decode([t]) for t in ids), "the stop string must span several tokens"
    checker = StopChecker(set(), [stop, "never"], bpe)
    kept, stopped, streamed = _feed(checker, ids, chunk)
    assert stopped and checker.stop_string_hit == stop
    # The token completing the stop string is the last one kept; the text stops where the string begins.
    n = next(i for i in range(1, len(ids) + 1) if stop in bpe.decode(ids[:i]))
    assert kept == ids[:n]
    assert streamed == checker.text == text[: text.index(stop)]


@pytest.mark.parametrize("chunk", [1, 4])
def test_streamed_text_never_shows_a_stop_string(chunk: int) -> None:
    tok = make_char_tokenizer(VOCAB)
    text = "abcabcabXYcabZZ"
    ids = tok.encode(text)
    checker = StopChecker(set(), ["cabZ", "XYc"], tok)
    seen = ""
    for i in range(0, len(ids), chunk):
        _, stopped = checker.truncate(ids[i:i + chunk], 1 << 30)
        seen += checker.take_text(stopped)
        assert "X" not in seen  # the start of "XYc" is held back until it is known not to be a stop
        if stopped:
            break
    assert stopped and checker.stop_string_hit == "XYc" and seen == checker.text == "abcabcab"


def test_stop_token_and_max_tokens_with_text() -> None:
    tok = make_char_tokenizer(VOCAB)
    ids = tok.encode("hello world")
    checker = StopChecker({ids[4]}, [], tok)  # "o"
    kept, stopped = checker.truncate(ids, 100)
    assert stopped and kept == ids[:5] and checker.take_text(True) == "hello"
    checker = StopChecker(set(), ["zz"], tok)
    kept, stopped = checker.truncate(ids, 3)
    assert not stopped and kept == ids[:3] and checker.take_text(True) == "hel"


def test_a_special_stop_token_ends_the_request_but_is_not_text(bpe) -> None:
    """EOS (a chat model's <|im_end|>) stays in the token ids, not in the text; an ordinary stop token is text."""
    eos = bpe.eos_token_id
    ids = bpe.encode("def f():\n    return 1")
    checker = StopChecker({eos}, [], bpe)
    kept, stopped = checker.truncate(ids + [eos, ids[0]], 100)
    assert stopped and kept == ids + [eos]
    assert checker.take_text(True) == "def f():\n    return 1"
    checker = StopChecker({ids[0]}, [], bpe)
    kept, stopped = checker.truncate(ids, 100)
    assert stopped and kept == ids[:1] and checker.take_text(True) == bpe.decode(ids[:1])


# ------------------------------------------------------------------------------------------------- the engine
@pytest.mark.slow
def test_a_4000_token_output_with_a_stop_string_at_the_end(long_context: str) -> None:
    llm = LLM(long_context)
    greedy = {"max_tokens": LONG, "temperature": 0, "ignore_eos": True}
    full = llm.generate(["hello"], SamplingParams(**greedy))[0]
    text = full.text
    assert len(full.token_ids) == LONG and text == llm.tokenizer.decode(full.token_ids)
    # The shortest tail of the text that occurs nowhere earlier: a stop string completed by the last token.
    stop = next((text[-n:] for n in range(2, 200) if text.find(text[-n:]) == len(text) - n), None)
    assert stop is not None, f"every tail of the output repeats; pick another prompt: {text[-80:]!r}"
    counting = CountingTokenizer(llm.engine.tokenizer)
    llm.engine.tokenizer = counting
    deltas = list(llm.stream(["hello"], SamplingParams(**greedy, stop=["\x00never", stop])))
    last = deltas[-1]
    assert last.finished and last.finish_reason == "stop" and last.num_output_tokens == LONG
    assert last.metrics is not None and last.metrics["plain_decode_rounds"] >= 1  # no draft: plain rounds
    assert all(not d.finished and d.metrics is None for d in deltas[:-1])
    assert [t for d in deltas for t in d.new_token_ids] == full.token_ids
    assert "".join(d.new_text for d in deltas) == text[: len(text) - len(stop)]
    # Linear: a few tokens decoded per token (re-decoding the output each time would read ~8,000,000).
    assert counting.decoded < 8 * LONG, counting.decoded


@pytest.mark.parametrize("speculative", [None, "chain", "tree-pipelined"])
def test_deltas_concatenate_to_the_outputs(with_tokenizer: str, speculative) -> None:
    cfg = {None: None, "chain": spec(with_tokenizer, 3),
           "tree-pipelined": {**spec(with_tokenizer, None, [2, 1, 1]), "pipeline": True}}[speculative]
    llm = LLM(with_tokenizer, cfg)
    prompts = ["hello world", "abc", "The quick brown fox"]
    params = [SamplingParams(max_tokens=40, temperature=0.9, seed=s, ignore_eos=True) for s in range(3)]
    texts = [o.text for o in llm.generate(prompts, params)]
    # Requests 1 and 2 stop at a string from the middle of their own text (two characters: two tokens).
    for i in (1, 2):
        params[i] = SamplingParams(max_tokens=40, temperature=0.9, seed=i, ignore_eos=True, stop=[texts[i][20:22]])
    outs = llm.generate(prompts, params)
    assert {o.finish_reason for o in outs} == {"stop", "length"}
    streams = _by_request(llm.stream(prompts, params))
    assert sorted(streams) == ["0", "1", "2"]
    for i, out in enumerate(outs):
        ds = streams[str(i)]
        assert [d.finished for d in ds] == [False] * (len(ds) - 1) + [True]
        assert [t for d in ds for t in d.new_token_ids] == out.token_ids
        assert "".join(d.new_text for d in ds) == out.text
        assert ds[-1].finish_reason == out.finish_reason
        assert {**ds[-1].metrics, "ttft_s": None} == {**out.metrics, "ttft_s": None}
        assert [d.num_output_tokens for d in ds] == list(_cumsum(len(d.new_token_ids) for d in ds))
        assert all(d.num_prompt_tokens == len(out.prompt_token_ids) for d in ds)


def _cumsum(xs):
    total = 0
    for x in xs:
        total += x
        yield total


@pytest.mark.parametrize("pipeline", [False, True])
def test_abort_frees_blocks(llama, pipeline: bool) -> None:
    llm = LLM(llama.target, {**spec(llama.perturbed, 3), "pipeline": pipeline}, max_num_seqs=2, block_size=4)
    engine = llm.engine
    sched = engine.scheduler
    params = SamplingParams(max_tokens=60, temperature=0.8, seed=3, ignore_eos=True)
    for i in range(3):
        engine.add_request(f"r{i}", [1, 5 + i, 9, 12], params)
    with pytest.raises(ValueError, match="request_id: 'r1' is already in use"):
        engine.add_request("r1", [1, 2], params)
    for _ in range(3):
        engine.step()
    running = {r.request_id: r for r in sched.running}
    assert set(running) == {"r0", "r1"} and [r.request_id for r in sched.waiting] == ["r2"]
    seq = running["r1"].seq_id
    assert seq in sched.target_blocks.tables and seq in sched.draft_blocks.tables
    used = sched.target_blocks.num_blocks - sched.target_blocks.num_free
    assert engine.abort_request("r1") and engine.abort_request("r2")  # one running, one queued
    assert not engine.abort_request("nope")
    deltas = _by_request(engine.step())
    for rid in ("r1", "r2"):
        (d,) = deltas[rid]
        assert d.finished and d.finish_reason == "abort" and d.new_token_ids == [] and d.metrics is not None
    assert [r.request_id for r in sched.running] == ["r0"] and not sched.waiting
    assert seq not in sched.target_blocks.tables and seq not in sched.draft_blocks.tables
    assert sched.target_blocks.num_blocks - sched.target_blocks.num_free < used
    assert not engine.abort_request("r1")  # finished: nothing to abort
    rest = []
    while engine.has_unfinished:
        rest += engine.step()
    assert rest[-1].request_id == "r0" and rest[-1].finish_reason == "length" and rest[-1].num_output_tokens == 60
    for pool in (sched.target_blocks, sched.draft_blocks):
        assert pool.num_free == pool.num_blocks and not pool.tables


def test_closing_a_stream_early_aborts_the_rest(llama) -> None:
    llm = LLM(llama.target, spec(llama.perturbed, 2))
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    alone = llm.generate([[1, 4, 5]], params)[0].token_ids
    stream = llm.stream([[1, 2, 3], [1, 4, 5]], params)
    first = next(stream)
    assert not first.finished and first.new_token_ids
    stream.close()
    assert not llm.engine.has_unfinished
    sched = llm.engine.scheduler
    assert sched.target_blocks.num_free == sched.target_blocks.num_blocks
    # The engine is clean: the same ids run again and give what they give alone.
    assert llm.generate([[1, 2, 3], [1, 4, 5]], params)[1].token_ids == alone
