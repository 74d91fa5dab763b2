"""Bad input is refused with an error that names the field and the limit; requests stop where they should."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from engine.core.config import SpeculativeConfig
from engine.llm import LLM
from scheduler.sampling_params import SamplingParams
from tests.conftest import VOCAB, spec
from tests.helpers_models import make_tiny_checkpoint

EOS = 2


@pytest.fixture(scope="module")
def llm(llama) -> LLM:
    return LLM(llama.target, max_model_len=16)


# ------------------------------------------------------------------------------------------------ sampling params
@pytest.mark.parametrize(("kwargs", "message"), [
    ({"max_tokens": 0}, r"max_tokens must be >= 1, got 0"),
    ({"max_tokens": -3}, r"max_tokens must be >= 1, got -3"),
    ({"max_tokens": 2.5}, r"max_tokens must be an integer, got 2.5"),
    ({"temperature": -0.1}, r"temperature must be >= 0, got -0.1"),
    ({"temperature": float("nan")}, r"temperature must be a finite number"),
    ({"top_p": 0.0}, r"top_p must be in \(0, 1\], got 0.0"),
    ({"top_p": 1.5}, r"top_p must be in \(0, 1\], got 1.5"),
    ({"top_k": -2}, r"top_k must be -1 or 0 \(off\) or between 1 and 2147483647, got -2"),
    ({"min_p": -0.5}, r"min_p must be in \[0, 1\], got -0.5"),
    ({"min_p": 1.5}, r"min_p must be in \[0, 1\], got 1.5"),
    ({"stop": [""]}, r"stop must be a string or a list of non-empty strings"),
    ({"stop_token_ids": ["x"]}, r"stop_token_ids must be an integer"),
    ({"ignore_eos": "yes"}, r"ignore_eos must be true or false"),
])
def test_sampling_params_limits(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_sampling_params_accept_the_edges() -> None:
    p = SamplingParams(max_tokens=1, temperature=0, top_p=1.0, top_k=-1, min_p=1.0, stop="x")
    assert p.greedy and p.stop == ["x"]
    assert SamplingParams(top_k=1, min_p=0.0, top_p=1e-6).top_k == 1
    assert SamplingParams(top_k=0).top_k == -1  # 0 is "off", as in Hugging Face generation configs


# -------------------------------------------------------------------------------------------------------- prompts
def test_prompt_longer_than_the_context(llm: LLM) -> None:
    with pytest.raises(ValueError, match=r"prompt: 16 tokens, the model's context is 16"):
        llm.generate([list(range(3, 19))], SamplingParams(max_tokens=1))
    # One token shorter fits, and generation stops at the context with "length".
    out = llm.generate([list(range(3, 18))], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))[0]
    assert len(out.token_ids) == 1 and out.finish_reason == "length"


@pytest.mark.parametrize("bad", [VOCAB, VOCAB + 7, -1])
def test_token_ids_outside_the_vocabulary(llm: LLM, bad: int) -> None:
    with pytest.raises(ValueError, match=rf"prompt_token_ids: \[{bad}\] outside the vocabulary \[0, {VOCAB}\)"):
        llm.generate([[1, 5, bad]], SamplingParams(max_tokens=1))


def test_empty_prompt_and_text_without_tokenizer(llm: LLM) -> None:
    with pytest.raises(ValueError, match="prompt: must contain at least one token"):
        llm.engine.add_request("x", [], SamplingParams())
    with pytest.raises(ValueError, match="no tokenizer"):
        llm.engine.add_request("x", "hello", SamplingParams())
    with pytest.raises(ValueError, match="stop strings need a tokenizer"):
        llm.engine.add_request("x", [1, 2], SamplingParams(stop=["a"]))
    assert not llm.engine.has_unfinished  # nothing half-queued


def test_request_larger_than_the_kv_pool(llama) -> None:
    llm = LLM(llama.target, block_size=4, num_kv_tokens=32)
    with pytest.raises(ValueError, match=r"max_tokens \(40\).* exceeds the KV cache capacity of 32 tokens"):
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=40))


# ------------------------------------------------------------------------------------------ speculative config
@pytest.mark.parametrize(("cfg", "message"), [
    ({"model": "d", "num_speculative_tokens": 3, "tree_width": 2},
     r"unknown speculative_config key\(s\) \['tree_width'\]"),
    ({"model": "d", "num_speculative_tokens": 3, "tree_branching": [2, 2]},
     r"tree_branching must be a list of 3 integers .*num_speculative_tokens=3.*got \[2, 2\]"),
    ({"model": "d", "num_speculative_tokens": 0}, r"num_speculative_tokens must be an integer in \[1, 32\], got 0"),
    ({"model": "d", "tree_sampling": "topk"}, r"tree_sampling must be one of .*'iid'.*got 'topk'"),
    ({"model": "d", "method": "medusa"}, r"speculative_config.method must be one of"),
    ({"num_speculative_tokens": 2}, r"speculative_config.model is required"),
    ({"model": "d", "num_speculative_tokens": 2, "tree_branching": [8, 8], "max_tree_nodes": 64},
     r"tree_branching \[8, 8\] makes 72 nodes per round, above max_tree_nodes=64"),
    ({"model": "d", "num_speculative_tokens": 2, "tree_branching": [2, 0]}, r"tree branching entries must be"),
    ("{not json", r"speculative_config is not valid JSON"),
    ({"model": "d", "adaptive": "yes"}, r"speculative_config.adaptive must be true or false, got 'yes'"),
    ({"model": "d", "adaptive_cost_cache": 1}, r"speculative_config.adaptive_cost_cache must be true or false, got 1"),
    ({"model": "d", "num_speculative_tokens": 4, "num_speculative_tokens_per_batch_size": {"1": 5}},
     r"num_speculative_tokens_per_batch_size: depths must be integers in \[0, num_speculative_tokens=4\]"),
    ({"model": "d", "num_speculative_tokens_per_batch_size": {"zero": 2}},
     r"num_speculative_tokens_per_batch_size: batch sizes must be integers >= 1"),
    ({"model": "d", "num_speculative_tokens_per_batch_size": 3}, r"num_speculative_tokens_per_batch_size must map"),
    ({"model": "d", "adaptive": True, "num_speculative_tokens_per_batch_size": {"1": 2}},
     r"num_speculative_tokens_per_batch_size is a fixed schedule: it cannot be combined with adaptive=true"),
])
def test_speculative_config_errors(cfg, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig.parse(cfg)


def test_speculative_config_from_json() -> None:
    cfg = SpeculativeConfig.parse('{"method": "draft_model", "model": "d", "num_speculative_tokens": 3, '
                                  '"tree_branching": [2, 1, 1]}')
    assert cfg.tree_shape.branching == (2, 1, 1) and cfg.tree_shape.num_nodes == 6


def test_adaptive_is_the_default_and_the_batch_size_table() -> None:
    default = SpeculativeConfig.parse({"model": "d"})
    assert default.is_adaptive and default.num_speculative_tokens == 8  # K_max: the policy goes shallower
    fixed = SpeculativeConfig.parse({"model": "d", "adaptive": False})
    assert not fixed.is_adaptive and fixed.num_speculative_tokens == 4
    assert SpeculativeConfig.parse({"model": "d", "num_speculative_tokens": 3}).is_adaptive  # K_max 3
    tree = SpeculativeConfig.parse({"model": "d", "tree_branching": [2, 1, 1]})
    assert tree.is_adaptive and tree.num_speculative_tokens == 3  # the tree's depth
    cfg = SpeculativeConfig.parse({"model": "d", "num_speculative_tokens_per_batch_size": {"16": 2, "1": 4,
                                                                                        "64": 0}})
    assert not cfg.is_adaptive and cfg.batch_size_schedule == ((1, 4), (16, 2), (64, 0))  # a fixed schedule
    assert cfg.num_speculative_tokens == 4
    pairs = SpeculativeConfig.parse({"model": "d", "num_speculative_tokens_per_batch_size": [[8, 1]]})
    assert pairs.batch_size_schedule == ((8, 1),)


def test_missing_draft_directory(llama, tmp_path) -> None:
    with pytest.raises(ValueError, match="speculative_config.model directory .* does not exist"):
        LLM(llama.target, spec(str(tmp_path / "nope"), 2))


def test_draft_with_a_larger_vocabulary_is_refused(llama, tmp_path) -> None:
    big = make_tiny_checkpoint(tmp_path / "big", family="llama", vocab_size=VOCAB + 32, seed=7, num_hidden_layers=1)
    with pytest.raises(ValueError, match=rf"draft's vocabulary \({VOCAB + 32} tokens\) is larger than the "
                                         rf"target's \({VOCAB}\)"):
        LLM(llama.target, spec(big, 2))


def test_draft_with_a_different_tokenizer_is_refused(with_tokenizer: str, tmp_path) -> None:
    draft = make_tiny_checkpoint(tmp_path / "draft", family="llama", vocab_size=VOCAB, seed=8, num_hidden_layers=1,
                                 with_tokenizer=True)
    LLM(with_tokenizer, spec(draft, 2))  # the same character tokenizer: accepted
    other = str(tmp_path / "other")
    shutil.copytree(draft, other)
    path = os.path.join(other, "tokenizer.json")
    with open(path) as f:
        tok = json.load(f)
    vocab = tok["model"]["vocab"]
    vocab["a"], vocab["b"] = vocab["b"], vocab["a"]  # two tokens trade ids
    with open(path, "w") as f:
        json.dump(tok, f)
    with pytest.raises(ValueError, match=r"tokenizer differs from the target's \(2 tokens map to other ids"):
        LLM(with_tokenizer, spec(other, 2))


# --------------------------------------------------------------------------------------------------- stopping
def _greedy(llm: LLM, prompts, n: int, **kw) -> list:
    return llm.generate(prompts, SamplingParams(max_tokens=n, temperature=0, **kw))


@pytest.mark.parametrize("speculative", [None, "chain", "tree"])
def test_stop_token_ids_and_eos(llama, speculative) -> None:
    cfg = {None: None, "chain": spec(llama.target, 4), "tree": spec(llama.target, None, [2, 2, 1])}[speculative]
    llm = LLM(llama.target, cfg)
    prompt = [1, 40, 41, 42]
    full = _greedy(llm, [prompt], 24, ignore_eos=True)[0]
    assert full.finish_reason == "length" and len(full.token_ids) == 24
    stop_tok = full.token_ids[9]
    cut = full.token_ids.index(stop_tok) + 1
    out = _greedy(llm, [prompt], 24, ignore_eos=True, stop_token_ids=[stop_tok])[0]
    assert out.token_ids == full.token_ids[:cut] and out.finish_reason == "stop"

    # EOS stops a request unless ignore_eos: find prompts whose greedy continuation emits it.
    prompts = [[1, 3 + (7 * s) % 120, 3 + (13 * s) % 120, 3 + (29 * s) % 120, 3 + s] for s in range(40)]
    fulls = _greedy(llm, prompts, 16, ignore_eos=True)
    with_eos = [(p, f.token_ids) for p, f in zip(prompts, fulls, strict=True) if EOS in f.token_ids]
    assert with_eos, "no test prompt reaches EOS; pick others"
    stopped = _greedy(llm, [p for p, _ in with_eos], 16)
    for (_, toks), out in zip(with_eos, stopped, strict=True):
        assert out.token_ids == toks[: toks.index(EOS) + 1] and out.finish_reason == "stop"
    assert all(f.finish_reason == "length" for f in fulls)


@pytest.mark.parametrize("speculative", [False, True])
def test_stop_strings_end_generation_and_are_left_out_of_the_text(with_tokenizer: str, speculative: bool) -> None:
    llm = LLM(with_tokenizer, spec(with_tokenizer, 4) if speculative else None)
    tok = llm.tokenizer
    full = _greedy(llm, ["hello world"], 30, ignore_eos=True)[0]
    text = full.text
    assert full.text == tok.decode(full.token_ids)
    printable = [i for i in range(2, len(text) - 2) if text[i:i + 2].isprintable() and text[i:i + 2].strip()]
    assert printable, f"no usable stop string in {text!r}"
    stop = text[printable[len(printable) // 2]:][:2]
    first = text.index(stop)
    n = next(i for i in range(1, 31) if stop in tok.decode(full.token_ids[:i]))
    out = _greedy(llm, ["hello world"], 30, ignore_eos=True, stop=[stop, "never-matches"])[0]
    assert out.finish_reason == "stop"
    assert out.text == text[:first]
    assert out.token_ids == full.token_ids[:n]
    out = _greedy(llm, ["hello world"], n - 1, ignore_eos=True, stop=[stop])[0]
    assert out.finish_reason == "length" and out.text == text[: len(tok.decode(full.token_ids[: n - 1]))]


def test_a_refused_batch_leaves_nothing_behind(llama) -> None:
    """A generate() call refused half-way queues nothing: the next call returns exactly its own outputs."""
    llm = LLM(llama.target)
    greedy = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    alone = llm.generate([[1, 7, 8]], greedy)[0].token_ids
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate([[1, 2, 3, 4, 5, 6], [1, VOCAB]], greedy)
    assert not llm.engine.has_unfinished
    outs = llm.generate([[1, 7, 8]], greedy)
    assert len(outs) == 1 and outs[0].token_ids == alone


@pytest.mark.parametrize("speculative", [False, True])
def test_max_tokens_ends_with_length(llama, speculative: bool) -> None:
    llm = LLM(llama.target, spec(llama.perturbed, 3) if speculative else None)
    for n in (1, 2, 7):
        outs = llm.generate([[1, 2, 3], [1, 50, 51, 52, 53]], SamplingParams(max_tokens=n, temperature=0.8, seed=n,
                                                                             ignore_eos=True))
        assert [len(o.token_ids) for o in outs] == [n, n] and {o.finish_reason for o in outs} == {"length"}
        assert all(o.finished for o in outs)
