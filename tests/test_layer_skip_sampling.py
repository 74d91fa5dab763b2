"""The output law with self-speculation (method layer_skip) is the target's (tests/test_engine_sampling.py's
harness and chi-square tests): sampled chains record the exit's softmax after the request's transforms; trees
record each child's law as drawn (i.i.d.: that softmax; without replacement: it with the earlier siblings removed;
deterministic: one-hot). Negative controls: the same runs with the recorded q flattened fail, and so do ones whose
draft passes leave stale layer-0 entries in the reused rows (tests/test_layer_skip.py ``stale_lower_layers``)."""

from __future__ import annotations

import pytest

import workers.layer_skip.self_drafter as self_drafter
from tests.conftest import SMALL_VOCAB, marked_slow
from tests.helpers_models import make_tiny_checkpoint
from tests.test_engine_sampling import ALPHA, exact_joint, pair_pvalues, sample_engine, target_logits  # noqa: F401
from tests.test_layer_skip import stale_lower_layers
from workers.law_channel import DraftLaws


@pytest.fixture(scope="module")
def small_vocab(tmp_path_factory) -> tuple[str, None]:
    """The 12-token target of the law tests with 3 layers, so that layers 0..L-1 can exit early (overrides the
    conftest fixture that ``target_logits`` reads)."""
    root = tmp_path_factory.mktemp("layer-skip-law")
    return make_tiny_checkpoint(root / "target", family="llama", vocab_size=SMALL_VOCAB, seed=3,
                                num_hidden_layers=3), None


def layer_skip(k: int, exit_layer: int = 1, branching: list[int] | None = None, mode: str = "iid") -> dict:
    spec = {"method": "layer_skip", "exit_layer": exit_layer, "num_speculative_tokens": k, "tree_sampling": mode}
    return spec | ({"tree_branching": branching} if branching else {})


CASES = {  # name -> (K, exit layer, tree branching, tree_sampling, laws sampled side by side in one batch)
    "chain-T1": (2, 1, None, "iid", [(1.0, -1, 1.0)]),
    "chain-T0.7-topk5-and-topp0.8-L2": (2, 2, None, "iid", [(0.7, 5, 1.0), (1.0, -1, 0.8)]),
    "tree-iid-T1": (2, 1, [2, 2], "iid", [(1.0, -1, 1.0)]),
    "tree-wor-T0.7-L2": (2, 2, [3, 1], "without_replacement", [(0.7, -1, 1.0)]),
    "tree-deterministic-T1-topk5": (2, 1, [2, 1], "deterministic", [(1.0, 5, 1.0)]),
}
TREE = CASES["tree-iid-T1"]


@pytest.mark.parametrize("case", marked_slow(sorted(CASES), slow={"chain-T0.7-topk5-and-topp0.8-L2",
                                                                   "tree-deterministic-T1-topk5"}))
def test_layer_skip_output_follows_the_target_law(small_vocab, target_logits, case: str) -> None:  # noqa: F811
    k, exit_layer, branching, mode, laws = CASES[case]
    samples, llm = sample_engine(small_vocab[0], layer_skip(k, exit_layer, branching, mode), laws)
    stats = llm.engine.stats
    assert 0 < stats.num_accepted < stats.num_drafted, stats.as_dict()  # accepted and rejected both ran
    if branching:  # trees were drafted: more nodes than the depth per round
        assert stats.num_drafted > k * stats.num_rounds, stats.as_dict()
    for tokens, law in zip(samples, laws, strict=True):
        pvalues = pair_pvalues(tokens, exact_joint(target_logits, *law))
        assert min(pvalues.values()) > ALPHA, (law, pvalues)


@pytest.mark.parametrize("tree", [False, True])
def test_a_wrong_q_is_caught(small_vocab, target_logits, monkeypatch, tree: bool) -> None:  # noqa: F811
    """Tokens drawn from the exit's q but q^(1/2) recorded (its law at twice the temperature)."""

    class Flatter(DraftLaws):
        @classmethod
        def of(cls, seq_id, tree_id, laws):
            wrong = [q.sqrt() / q.sqrt().sum() for q in laws]
            return DraftLaws.of(seq_id, tree_id, wrong)

    monkeypatch.setattr(self_drafter, "DraftLaws", Flatter)
    spec = layer_skip(TREE[0], TREE[1], TREE[2]) if tree else layer_skip(2)
    (tokens,), _ = sample_engine(small_vocab[0], spec, [(1.0, -1, 1.0)])
    assert min(pair_pvalues(tokens, exact_joint(target_logits, 1.0)).values()) < 1e-6


@pytest.mark.slow
@pytest.mark.parametrize("tree", [False, True])
def test_stale_lower_layer_entries_are_caught(small_vocab, target_logits, monkeypatch, tree: bool) -> None:  # noqa: F811
    stale_lower_layers(monkeypatch)
    spec = layer_skip(TREE[0], TREE[1], TREE[2]) if tree else layer_skip(2)
    (tokens,), _ = sample_engine(small_vocab[0], spec, [(1.0, -1, 1.0)])
    assert min(pair_pvalues(tokens, exact_joint(target_logits, 1.0)).values()) < 1e-6
