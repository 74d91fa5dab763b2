"""Greedy output is the target's greedy output, whatever the speculation, batching, chunking or preemption.

Reference: transformers ``generate`` (greedy, no EOS stop) on the target checkpoint. Every engine run below must
reproduce it token for token: without speculation, with chains of K = 1, 3, 5, with trees of several shapes,
with a draft that agrees with the target nowhere (a different random model), everywhere (the target itself)
and partly (the target with a little noise on its weights).
"""

from __future__ import annotations

import pytest
import torch

from engine.core.config import CacheConfig, EngineConfig, SpeculativeConfig
from engine.core.llm_engine import LLMEngine
from engine.llm import LLM
from scheduler.sampling_params import SamplingParams
from scheduler.scheduler import Scheduler, SchedulerConfig
from tests.conftest import marked_slow, random_plans, run_to_completion, spec

MAX_TOKENS = 32
PROMPTS = [[1], [1, 17, 44, 9, 83], [1] + list(range(20, 32)), [1] + [(7 * i) % 120 + 3 for i in range(29)]]
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)

SHAPES = {  # name -> (K for a chain, tree branching)
    "chain1": (1, None),
    "chain3": (3, None),
    "chain5": (5, None),
    "tree221": (None, [2, 2, 1]),
    "tree3111": (None, [3, 1, 1, 1]),
    "tree222": (None, [2, 2, 2]),
}


def hf_greedy(path: str, prompts: list[list[int]], n: int) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None  # ignore_eos: generate the full n tokens
    outs = []
    for p in prompts:
        with torch.no_grad():
            ids = torch.tensor([p])  # an explicit mask: generate would otherwise mask prompt tokens equal to pad
            g = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                            pad_token_id=0)
        out = g[0, len(p):].tolist()
        assert len(out) == n
        outs.append(out)
    return outs


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def family(request: pytest.FixtureRequest):
    models = request.getfixturevalue(request.param)
    return models, hf_greedy(models.target, PROMPTS, MAX_TOKENS)


@pytest.fixture(scope="module")
def llama_expected(llama) -> list[list[int]]:
    return hf_greedy(llama.target, PROMPTS, MAX_TOKENS)


def record_rounds(engine) -> list[tuple[list[int], list[int]]]:
    """(tree parents, accepted nodes) of every verified round, read at the executor's message boundary."""
    rounds: list[tuple[list[int], list[int]]] = []
    pending: list[list[int]] = []
    ex = engine.executor
    submit, wait = ex.submit_target, ex.wait_target

    def submit_target(msg):
        pending[:] = [s.tree_parents for s in msg.seqs]
        return submit(msg)

    def wait_target():
        out = wait()
        rounds.extend(zip(list(pending), [r.accepted_nodes for r in out.results], strict=True))
        return out

    ex.submit_target, ex.wait_target = submit_target, wait_target
    return rounds


def full_acceptance(max_tokens: int, depth: int) -> tuple[int, int]:
    """(speculative rounds, accepted tokens) of one request whose every candidate is accepted."""
    left, rounds, accepted = max_tokens - 1, 0, 0  # the first token comes from the prefill
    while left > 0:
        d = min(depth, left - 1)  # a round never drafts past max_tokens
        rounds += d > 0
        accepted += d
        left -= d + 1
    return rounds, accepted


def _generate(target: str, speculative: dict | None, prompts=PROMPTS, params=GREEDY, **kw):
    llm = LLM(target, speculative, **kw)
    llm.engine.rounds_seen = record_rounds(llm.engine)
    outs = llm.generate(prompts, params)
    return [o.token_ids for o in outs], llm.engine


def test_no_speculation_equals_transformers(family) -> None:
    models, expected = family
    got, _ = _generate(models.target, None)
    assert got == expected


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_speculation_with_a_different_draft(family, shape: str) -> None:
    models, expected = family
    k, branching = SHAPES[shape]
    got, engine = _generate(models.target, spec(models.draft, k, branching))
    assert got == expected
    assert engine.stats.num_rounds > 0


@pytest.mark.parametrize("shape", ["chain3", "tree221"])
def test_draft_equal_to_target_accepts_everything(family, shape: str) -> None:
    models, expected = family
    k, branching = SHAPES[shape]
    got, engine = _generate(models.target, spec(models.target, k, branching))
    assert got == expected
    depth = k or len(branching)
    # The draft's top candidate is always the target's argmax: every round accepts its full depth.
    rounds, accepted = full_acceptance(MAX_TOKENS, depth)
    s = engine.stats
    assert (s.num_rounds, s.num_accepted) == (rounds * len(PROMPTS), accepted * len(PROMPTS)), s.as_dict()


@pytest.mark.parametrize("shape", ["chain5", "tree222", "tree3111"])
def test_partially_agreeing_draft(family, shape: str) -> None:
    """Acceptance strictly between none and all: accepted paths of every length get committed."""
    models, expected = family
    k, branching = SHAPES[shape]
    got, engine = _generate(models.target, spec(models.perturbed, k, branching))
    assert got == expected
    depth = k or len(branching)
    mal = engine.stats.mean_acceptance_length
    assert 1 < mal < depth + 1, mal
    assert 0 < engine.stats.num_accepted < engine.stats.num_drafted
    if branching is not None:
        # Some accepted path went through a sibling other than the first: its KV had to move on commit.
        def later_sibling(parents: list[int], node: int) -> bool:
            return parents.index(parents[node]) != node

        assert any(later_sibling(parents, n) for parents, acc in engine.rounds_seen for n in acc)


def test_requests_arriving_while_others_run(llama, llama_expected) -> None:
    """Continuous batching: requests that join mid-flight get exactly what they get alone."""
    expected = llama_expected
    cfg = EngineConfig(target=llama.target, speculative=SpeculativeConfig.parse(spec(llama.perturbed, None, [2, 2, 1])),
                       scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64),
                       cache=CacheConfig(block_size=4))
    engine = LLMEngine(cfg)
    outs: dict = {}
    engine.add_request("0", PROMPTS[0], GREEDY)
    engine.add_request("1", PROMPTS[1], GREEDY)
    for _ in range(3):
        outs.update({o.request_id: o for o in engine.step_finished()})
    engine.add_request("2", PROMPTS[2], GREEDY)
    for _ in range(4):
        outs.update({o.request_id: o for o in engine.step_finished()})
    engine.add_request("3", PROMPTS[3], GREEDY)
    # A request with fewer tokens finishes first and leaves while the others continue.
    engine.add_request("short", PROMPTS[3], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))
    outs.update(run_to_completion(engine))
    assert not outs.keys() - {"0", "1", "2", "3", "short"}
    for i, exp in enumerate(expected):
        assert outs[str(i)].token_ids == exp, i
        assert outs[str(i)].finish_reason == "length"
    assert outs["short"].token_ids == expected[3][:5]
    assert engine.scheduler.target_blocks.num_free == engine.scheduler.target_blocks.num_blocks
    assert engine.scheduler.draft_blocks.num_free == engine.scheduler.draft_blocks.num_blocks


@pytest.mark.parametrize("speculative", [None, "chain", "tree"])
def test_chunked_prefill(llama, llama_expected, speculative) -> None:
    """A token budget far below the prompt lengths: prompts are prefilled over several steps, in pieces."""
    expected = llama_expected
    cfg = {None: None, "chain": spec(llama.perturbed, 3), "tree": spec(llama.perturbed, None, [2, 1])}[speculative]
    llm = LLM(llama.target, cfg, max_num_batched_tokens=7, block_size=4)
    chunks: list[tuple[int, int]] = []
    schedule = llm.engine.scheduler.schedule

    def recording_schedule():
        batch = schedule()
        chunks.extend((c.start, c.end) for c in batch.prefills)
        assert sum(c.end - c.start for c in batch.prefills) <= 7
        return batch

    llm.engine.scheduler.schedule = recording_schedule
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == expected
    assert any(start > 0 for start, _ in chunks)  # some prompt was continued from a partial prefill


@pytest.mark.parametrize("speculative", [None, "tree"])
def test_preemption_and_recompute(llama, llama_expected, speculative, monkeypatch: pytest.MonkeyPatch) -> None:
    """A KV pool that cannot hold every request at once: the newest are preempted and recomputed."""
    expected = llama_expected
    preempted: list[int] = []
    real = Scheduler._preempt

    def counting_preempt(self, req):
        preempted.append(req.seq_id)
        real(self, req)

    monkeypatch.setattr(Scheduler, "_preempt", counting_preempt)
    cfg = {None: None, "tree": spec(llama.perturbed, None, [2, 2, 1])}[speculative]
    llm = LLM(llama.target, cfg, block_size=4, num_kv_tokens=96)
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == expected
    assert len(preempted) >= 2
    s = llm.engine.scheduler
    assert s.target_blocks.num_free == s.target_blocks.num_blocks


@pytest.mark.parametrize("branching", [[1, 1, 1], [3, 2]])
def test_draft_with_a_smaller_vocabulary(small_vocab, branching: list[int]) -> None:
    """The draft knows 10 of the target's 12 ids: its candidates never include the other two, the output is
    still the target's greedy output."""
    target, draft = small_vocab
    prompts = [[1, 7, 4], [1] + [3, 9, 5, 11, 0] * 3]
    expected = hf_greedy(target, prompts, 24)
    assert any(t >= 10 for out in expected for t in out)  # the target does emit ids the draft lacks
    got, engine = _generate(target, spec(draft, None, branching), prompts=prompts,
                            params=SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
    assert got == expected
    assert engine.stats.num_rounds > 0


@pytest.mark.parametrize("pipeline", [False, True])
def test_no_drafting_past_the_drafts_context(llama, llama_expected, tmp_path, pipeline: bool) -> None:
    """A draft with a 20-token context (here the target itself, so every candidate is accepted) proposes only
    at positions < 20; past that the request decodes plainly, and the output is unchanged."""
    import json
    import shutil

    draft = tmp_path / "short_context_draft"
    shutil.copytree(llama.target, draft)
    cfg = json.loads((draft / "config.json").read_text())
    cfg["max_position_embeddings"] = 20
    (draft / "config.json").write_text(json.dumps(cfg))
    k = 3
    got, engine = _generate(llama.target, {**spec(str(draft), k), "pipeline": pipeline})
    assert got == llama_expected
    rounds = accepted = 0
    for prompt in PROMPTS:
        t = 1  # output tokens so far; the first comes from the prefill
        while t < MAX_TOKENS:
            depth = max(0, min(k, MAX_TOKENS - t - 1, 20 - (len(prompt) + t)))
            rounds += depth > 0
            accepted += depth
            t += depth + 1
    s = engine.stats
    assert (s.num_rounds, s.num_accepted) == (rounds, accepted), s.as_dict()
    assert s.num_plain_rounds > 0


def test_one_round_definition_for_request_and_aggregate_stats(llama) -> None:
    """Per-request and aggregate statistics count the same rounds (plain decode rounds apart), and split the
    last token of a round into bonus and recovered."""
    llm = LLM(llama.target, spec(llama.perturbed, None, [2, 1]))
    outs = llm.generate(PROMPTS, GREEDY)
    agg = llm.engine.stats.as_dict()
    for key in ("rounds", "plain_decode_rounds", "drafted_tokens", "accepted_tokens", "bonus_tokens",
                "recovered_tokens"):
        assert agg[key] == sum(o.metrics[key] for o in outs), key
    assert agg["rounds"] == agg["bonus_tokens"] + agg["recovered_tokens"]
    assert agg["bonus_tokens"] > 0 and agg["recovered_tokens"] > 0, agg
    assert agg["plain_decode_rounds"] > 0  # the last token of each request has nothing left to draft
    emitted = sum(o.metrics["mean_acceptance_length"] * o.metrics["rounds"] for o in outs)  # rounded per request
    assert agg["mean_acceptance_length"] == pytest.approx(emitted / agg["rounds"], abs=1e-3)
    assert agg["nodes_per_round"] <= 4 and agg["acceptance_rate"] == round(
        agg["accepted_tokens"] / agg["drafted_tokens"], 4)


@pytest.mark.parametrize("pipeline", marked_slow([False, True], {True}))
@pytest.mark.parametrize("shape", ["chain5", "tree221"])
def test_adaptive_depths_keep_greedy_output(family, shape: str, pipeline: bool,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Adaptive on (the measured policy), then random depths and shapes every step: the output is the
    target's greedy output either way."""
    models, expected = family
    k, branching = SHAPES[shape]
    cfg = {**spec(models.perturbed, k, branching, adaptive=True), "pipeline": pipeline}
    got, engine = _generate(models.target, cfg)
    assert got == expected
    assert sum(engine.stats.chosen_depths.values()) > 0
    random_plans(monkeypatch)
    got, engine = _generate(models.target, cfg)
    assert got == expected
    assert len(engine.stats.chosen_depths) >= 3, engine.stats.chosen_depths  # the depth really changed
