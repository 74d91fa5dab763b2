"""The draft proposes from its grammar-masked law (workers/grammar_draft.py): no node it drafts is one the grammar
refuses (the controller's count of refused nodes stays 0), greedy and sampled, chain and tree, for a draft model and
the built-in target's EAGLE-3 head, in process, with the draft in a process of its own and as a Ray actor (the
grammar crosses the msgpack codec), and greedy output is the grammar's alone. Its law (q recorded = the masked law
drawn from) is checked against a draft pushed far from the target (a two-sample chi-square, independent seeds)."""

from __future__ import annotations

import os

import pytest

from engine.core.config import DEFAULT_MODELS_DIR
from engine.llm import LLM
from scheduler.sampling_params import SamplingParams
from tests.test_structured import GRAMMARS, PROMPTS

pytestmark = pytest.mark.slow  # engines on the built-in pair (the tiny models' tokenizer is not llguidance's)

BASE = {"method": "draft_model", "model": str(DEFAULT_MODELS_DIR / "draft"), "num_speculative_tokens": 3,
        "adaptive": False}
SHAPES = {"chain": BASE, "tree": {**BASE, "tree_branching": [2, 2, 1]},
          "process": {**BASE, "draft_process": True}, "ray": BASE,
          "eagle": {"method": "eagle3", "num_speculative_tokens": 3, "adaptive": False}}  # its shipped head


@pytest.fixture
def ray_if(request):
    """A local Ray for the "ray" case (the draft worker an actor: the grammar crosses as a DraftGrammar)."""
    if request.node.callspec.params["shape"] != "ray":
        yield {}
        return
    import ray

    if ray.is_initialized():
        ray.shutdown()
    ray.init(address="local", num_cpus=16, include_dashboard=False, log_to_driver=False, configure_logging=False)
    yield {"distributed_executor_backend": "ray"}
    ray.shutdown()


def _run(llm: LLM, grammar: dict, temperature: float) -> tuple[list[list[int]], int, int]:
    masks = llm.engine.extras.grammar
    drafted, refused = masks.drafted, masks.refused
    params = [SamplingParams(max_tokens=32, temperature=temperature, seed=11 * i + 3, structured_outputs=grammar)
              for i in range(len(PROMPTS))]
    outs = llm.generate(PROMPTS, params)
    return [o.token_ids for o in outs], masks.drafted - drafted, masks.refused - refused


@pytest.mark.parametrize("shape", list(SHAPES))
def test_the_draft_proposes_no_token_the_grammar_refuses(shape, ray_if) -> None:
    with LLM(None, "none") as plain, LLM(None, SHAPES[shape], **ray_if) as spec:
        if shape == "process":
            assert spec.engine.executor._proc.pid != os.getpid()  # the draft worker runs in its own process
        for grammar in GRAMMARS:
            for temperature in (0.0, 1.0):
                alone, _, _ = _run(plain, grammar, temperature)
                ids, drafted, refused = _run(spec, grammar, temperature)
                assert drafted > 0, (shape, grammar)
                assert refused == 0, (shape, grammar, temperature, refused, drafted)
                if temperature == 0:
                    assert ids == alone, (shape, grammar)


@pytest.mark.parametrize("shape", ["chain", "tree"])
def test_a_draft_far_from_the_target_still_gives_the_target_law(shape) -> None:
    """The draft is pushed towards one allowed token (its logits + 4 there), so its masked law is far from the
    target's: the sampled answers' law with speculation must still be the target's masked law (two-sample
    chi-square against independent seeds without speculation). Recording the unmasked q while drawing from the
    masked law fails this (shown once: p = 7e-39)."""
    from collections import Counter

    import torch
    from scipy.stats import chi2_contingency

    grammar, n, favoured = {"regex": "[a-d]{2}"}, 400, 68  # 68: "d"
    counts = {}
    with LLM(None, "none") as plain, LLM(None, SHAPES[shape]) as spec:
        draft = spec.engine.executor.draft
        forward = draft._forward

        def biased(pieces):  # [rows, V]: a worse draft, verified as any draft is
            out = forward(pieces)
            return out + 4.0 * (torch.arange(out.shape[-1], device=out.device) == favoured)

        draft._forward = biased
        for k, llm in (("none", plain), ("spec", spec)):
            params = [SamplingParams(max_tokens=4, temperature=1.0, seed=7 + 1000 * i + (k == "spec"),
                                     structured_outputs=grammar) for i in range(n)]
            counts[k] = Counter(o.text for o in llm.generate([PROMPTS[0]] * n, params))
        assert spec.engine.stats.num_drafted > 0
    keys = sorted(set().union(*counts.values()))
    table = [[counts[k][t] + 0.5 for t in keys] for k in counts]
    assert chi2_contingency(table).pvalue > 1e-3, counts
