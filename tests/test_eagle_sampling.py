"""The output law with EAGLE drafting is the target's (tests/test_engine_sampling.py's harness and chi-square
tests): sampled chains record the head's softmax after the request's transforms, dynamic trees one-hot laws.
Negative controls: the same runs with the recorded q perturbed fail."""

from __future__ import annotations

import pytest
import torch

import workers.eagle.draft_worker as eagle_worker
from tests.conftest import random_plans
from tests.helpers_law import record_flatter_q
from tests.test_engine_sampling import ALPHA, exact_joint, pair_pvalues, sample_engine, target_logits  # noqa: F401
from training.eagle_layout import random_head
from workers.model_config import ModelConfig


@pytest.fixture(scope="module")
def head(small_vocab, tmp_path_factory) -> str:
    """A random head for the 12-token target: it agrees with the target now and then, as a law test needs."""
    target, _ = small_vocab
    return random_head(tmp_path_factory.mktemp("eagle-law") / "head", ModelConfig.from_pretrained(target), seed=11)


def eagle(head: str, k: int, **kw) -> dict:
    return {"method": "eagle3", "model": head, "num_speculative_tokens": k, "adaptive": False, **kw}


CASES = {  # name -> (speculative config keys, laws sampled side by side in one batch)
    "chain-T1": ({"k": 2}, [(1.0, -1, 1.0)]),
    "chain-T0.7-topk5-and-topp0.8": ({"k": 2}, [(0.7, 5, 1.0), (1.0, -1, 0.8)]),
    "dynamic-tree-T1": ({"k": 2, "num_draft_tokens": 4, "eagle_topk": 2}, [(1.0, -1, 1.0)]),
    "fixed-tree-iid-T0.8": ({"k": 2, "tree_branching": [2, 2]}, [(0.8, -1, 1.0)]),
    # random depths and node budgets per request per step (every plan the adaptive policy could make)
    "dynamic-tree-T1-random-budgets": ({"k": 2, "num_draft_tokens": 5, "eagle_topk": 2, "adaptive": True,
                                        "adaptive_warmup_s": 0}, [(1.0, -1, 1.0)]),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_eagle_output_follows_the_target_law(small_vocab, target_logits, head, case: str,  # noqa: F811
                                             monkeypatch) -> None:
    target, _ = small_vocab
    keys, laws = CASES[case]
    keys = dict(keys)
    if case.endswith("random-budgets"):
        random_plans(monkeypatch)
    samples, llm = sample_engine(target, eagle(head, keys.pop("k"), **keys), laws)
    stats = llm.engine.stats
    assert 0 < stats.num_accepted < stats.num_drafted, stats.as_dict()  # accepted and rejected both ran
    if case.endswith("random-budgets"):  # chains of 1 and 2, the tree (1 x 4): budgets 1, 2 and 5
        assert len([d for d in stats.chosen_depths if d != "0"]) >= 3, stats.chosen_depths
    for tokens, law in zip(samples, laws, strict=True):
        pvalues = pair_pvalues(tokens, exact_joint(target_logits, *law))
        assert min(pvalues.values()) > ALPHA, (law, pvalues)


def test_a_wrong_chain_q_is_caught(small_vocab, target_logits, head, monkeypatch) -> None:  # noqa: F811
    """The chain's children drawn from q but q^(1/2) recorded (the head's law at twice its temperature)."""
    target, _ = small_vocab
    record_flatter_q(monkeypatch)
    (tokens,), _ = sample_engine(target, eagle(head, 2), [(1.0, -1, 1.0)])
    assert min(pair_pvalues(tokens, exact_joint(target_logits, 1.0)).values()) < 1e-6


def test_a_dynamic_tree_recording_the_softmax_is_caught(small_vocab, target_logits, head, monkeypatch) -> None:  # noqa: F811
    """Nodes chosen by confidence but recorded with the head's softmax instead of one-hot: the bent law the
    issue warns about, caught."""
    target, _ = small_vocab
    real = eagle_worker._Dynamic.select

    def softmax_q(self, vocab, device):
        real(self, vocab, device)
        t = self.r.trees[0]
        if t.laws:
            probs = torch.softmax(self.root_logits.float(), dim=-1)  # [V]: the head's law at the anchor
            t.laws = [probs] * len(t.laws)

    monkeypatch.setattr(eagle_worker._Dynamic, "select", softmax_q)
    (tokens,), _ = sample_engine(target, eagle(head, 2, num_draft_tokens=4, eagle_topk=2), [(1.0, -1, 1.0)])
    assert min(pair_pvalues(tokens, exact_joint(target_logits, 1.0)).values()) < 1e-6
