"""EAGLE drafting through the engine: greedy output is the target's, token for token, chains and dynamic trees.

The heads are trained here in seconds (training/eagle.py) on the tiny target's own continuations, so they accept
much of the time and the accepted-path bookkeeping (features of accepted rows, no kept draft KV) really runs; a
random head beside them accepts almost nothing and must change nothing either.
"""

from __future__ import annotations

import pytest

from engine.core.config import SpeculativeConfig
from engine.llm import LLM
from scheduler.sampling_params import SamplingParams
from tests.conftest import hf_greedy_continuations
from training.eagle import EagleTrainConfig, train_head
from training.eagle_layout import random_head
from workers.model_config import ModelConfig

PROMPTS = [[1], [1, 17, 44, 9, 83], [1] + list(range(20, 32)), [1] + [(7 * i) % 120 + 3 for i in range(29)]]
MAX_TOKENS = 32
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def heads(llama, tmp_path_factory) -> dict[str, str]:
    """A trained head (full vocabulary), a trained head over a trimmed vocabulary (d2t), a random head."""
    root = tmp_path_factory.mktemp("eagle-heads")
    llm = LLM(llama.target, "none", max_num_seqs=32)
    # The test prompts' own greedy continuations among them: what matters here is that candidates are accepted
    # (the bookkeeping of accepted paths runs), not how the head generalises.
    prompts = PROMPTS + [[1, 3 + i, 50 + (i * 7) % 70] for i in range(28)]
    params = [SamplingParams(max_tokens=64, temperature=0.0 if i % 2 or i < len(PROMPTS) else 1.0, seed=i,
                             ignore_eos=True) for i in range(len(prompts))]
    seqs = [p + o.token_ids for p, o in zip(prompts, llm.generate(prompts, params), strict=True)]
    cfg = EagleTrainConfig(minutes=1.0, steps=200, batch=8, seq_len=32, lr=5e-3)
    full = train_head(llama.target, seqs, str(root / "full"), cfg, log=lambda *_: None)
    assert full["train_top1"] > 0.3, full  # the head learned the target's continuations
    train_head(llama.target, seqs, str(root / "trimmed"), EagleTrainConfig(**{**cfg.__dict__, "draft_vocab": 96}),
               log=lambda *_: None)
    rand = random_head(root / "random", ModelConfig.from_pretrained(llama.target), seed=5)
    return {"full": str(root / "full"), "trimmed": str(root / "trimmed"), "random": rand}


@pytest.fixture(scope="module")
def expected(llama) -> list[list[int]]:
    return hf_greedy_continuations(llama.target, PROMPTS, MAX_TOKENS)


def eagle(head: str, k: int, **kw) -> dict:
    return {"method": "eagle3", "model": head, "num_speculative_tokens": k, "adaptive": False, **kw}


CASES = {  # name -> (head, speculative config keys)
    "chain3": ("full", {"k": 3}),
    "chain5-trimmed-vocab": ("trimmed", {"k": 5}),
    "dynamic-tree-K4-N10-top3": ("full", {"k": 4, "num_draft_tokens": 10, "eagle_topk": 3}),
    "dynamic-tree-K3-N6-top2-trimmed": ("trimmed", {"k": 3, "num_draft_tokens": 6, "eagle_topk": 2}),
    "chain4-random-head": ("random", {"k": 4}),
    "chain4-adaptive": ("full", {"k": 4, "adaptive": True, "adaptive_warmup_s": 0}),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_greedy_equals_no_speculation(llama, heads, expected, case: str) -> None:
    head, keys = CASES[case]
    keys = dict(keys)
    llm = LLM(llama.target, eagle(heads[head], keys.pop("k"), **keys), block_size=4)
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == expected
    stats = llm.engine.stats
    if head != "random" and "adaptive" not in keys:
        assert stats.mean_acceptance_length > 1.25, stats.as_dict()  # accepted paths really ran


def test_greedy_under_preemption_and_joining(llama, heads, expected) -> None:
    """A KV pool so small that requests are preempted (their features re-made by the re-prefill), requests
    joining a running batch."""
    llm = LLM(llama.target, eagle(heads["full"], 4, num_draft_tokens=8, eagle_topk=2), block_size=4,
              num_kv_tokens=96)
    engine = llm.engine
    preempted: list[int] = []
    schedule = engine.scheduler.schedule

    def counting(*args):  # observes the scheduler's decisions, changes nothing
        batch = schedule(*args)
        preempted.extend(r.seq_id for r in batch.preempted)
        return batch

    engine.scheduler.schedule = counting
    engine.add_request("0", PROMPTS[0], GREEDY)
    engine.add_request("1", PROMPTS[1], GREEDY)
    outs = {}
    for _ in range(3):
        outs.update({o.request_id: o for o in engine.step_finished()})
    engine.add_request("2", PROMPTS[2], GREEDY)
    engine.add_request("3", PROMPTS[3], GREEDY)
    for _ in range(2000):
        if not engine.has_unfinished:
            break
        outs.update({o.request_id: o for o in engine.step_finished()})
    assert [outs[str(i)].token_ids for i in range(4)] == expected
    assert preempted, "the pool was meant to force preemption"


def test_a_shared_prefix_is_recomputed_for_the_head(llama, heads, expected) -> None:
    """A cached target prefix would leave the head without its features: with a head the engine does not cache
    prefixes (no hit is counted, the second request sharing a prompt gets the same greedy output), where the same
    engine without the head hits."""
    shared = PROMPTS[3]
    for spec, hits in ((eagle(heads["full"], 3), 0), ("none", None)):
        llm = LLM(llama.target, spec, block_size=4)
        first = llm.generate([shared], GREEDY)[0].token_ids
        second = llm.generate([shared], GREEDY)[0].token_ids
        assert first == second == expected[3]
        got = llm.engine.scheduler.prefix_stats.hits
        assert got == hits if hits is not None else got > 0, (spec, got)


def test_refusals_say_what_to_change(llama, heads) -> None:
    with pytest.raises(ValueError, match="pipelin"):
        SpeculativeConfig.parse(eagle(heads["full"], 3, pipeline=True))
    with pytest.raises(ValueError, match="num_draft_tokens"):
        SpeculativeConfig.parse(eagle(heads["full"], 4, num_draft_tokens=2))
    with pytest.raises(ValueError, match="eagle3"):
        SpeculativeConfig.parse({"method": "draft_model", "model": heads["full"], "num_draft_tokens": 8})
    with pytest.raises(ValueError, match="draft_process"):
        SpeculativeConfig.parse(eagle(heads["full"], 3, draft_process=True))


# ------------------------------------------------------------------------------------------ the real SmolLM2
@pytest.mark.slow
@pytest.mark.parametrize("quantization", ["gguf", "none"])
def test_smollm2_greedy_equals_no_speculation(tmp_path, quantization: str) -> None:
    """SmolLM2-135M (4-bit, and dequantized to float32) with a random EAGLE-3 head over a trimmed vocabulary (its
    embedding read from the GGUF file): exactly its own no-speculation output, chains and dynamic trees."""
    from tests.helpers_gguf import smollm2_path

    smol = smollm2_path()
    tcfg = ModelConfig.from_pretrained(smol)
    head = random_head(tmp_path / "head", tcfg, seed=2, draft_ids=list(range(0, tcfg.vocab_size, 7)))
    prompts = [[1, 504, 3458, 282, 4053, 30], [1, 17, 3958, 314, 253]]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    plain = LLM(smol, "none", quantization=quantization).generate(prompts, params)
    for keys in ({}, {"num_draft_tokens": 6, "eagle_topk": 2}):
        llm = LLM(smol, eagle(head, 3, **keys), quantization=quantization)
        assert [o.token_ids for o in llm.generate(prompts, params)] == [o.token_ids for o in plain]


def test_builtin_target_uses_its_shipped_head() -> None:
    """`"method": "eagle3"` without a model on the built-in target: its shipped head, greedy output unchanged,
    and it accepts (a head trained for this target, engine/default_models/target-eagle3)."""
    prompts = [[0, 755, 1019, 12, 301], [0, 45, 1290, 33]]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    plain = [o.token_ids for o in LLM(None, "none").generate(prompts, params)]
    llm = LLM(None, {"method": "eagle3", "num_speculative_tokens": 4, "adaptive": False})
    assert llm.engine.config.speculative.model.endswith("target-eagle3")
    assert [o.token_ids for o in llm.generate(prompts, params)] == plain
    assert llm.engine.stats.mean_acceptance_length > 1.5, llm.engine.stats.as_dict()


@pytest.mark.slow
def test_smollm2_uses_its_shipped_head() -> None:
    """`--target smollm2` with `"method": "eagle3"` and no model: engine/default_models/smollm2-eagle3, greedy output
    unchanged, and it accepts (held-out 1.72 at K = 4 over 64 tokens; a random head accepts ~1.0)."""
    import json

    from engine.core.config import DEFAULT_MODELS_DIR
    from engine.drafting.eagle import shipped_head
    from tests.helpers_gguf import smollm2_path

    smol = smollm2_path()
    with open(DEFAULT_MODELS_DIR / "smollm2-draft" / "heldout_prompts.jsonl") as f:
        prompts = [json.loads(f.readline())["prompt_token_ids"]]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    plain = [o.token_ids for o in LLM(smol, "none").generate(prompts, params)]
    llm = LLM(smol, {"method": "eagle3", "model": shipped_head("smollm2"), "num_speculative_tokens": 4,
                     "adaptive": False})
    assert [o.token_ids for o in llm.generate(prompts, params)] == plain
    assert llm.engine.stats.mean_acceptance_length > 1.2, llm.engine.stats.as_dict()
