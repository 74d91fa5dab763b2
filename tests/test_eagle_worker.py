"""The EAGLE draft worker drafts exactly what the head computes densely over the whole sequence: the target's
feature of position j - 1 beside token j, the head's own output beside each drafted token, across rounds that
commit the in-flight tokens and feed the accepted ones again (workers/eagle/draft_worker.py)."""

from __future__ import annotations

import pytest
import torch

from training.eagle import target_pass
from training.eagle_layout import random_head
from workers.attention import DenseCausalContext
from workers.eagle.draft_worker import EagleDraftWorker
from workers.eagle.features import FeatureStore, SeqFeatures
from workers.loader import load_model
from workers.messages import DraftCommit, DraftSeq, DraftStep, PrefillSeq, SamplingSpec
from workers.model_config import ModelConfig
from workers.worker_config import WorkerConfig

GREEDY = SamplingSpec(0.0, -1, 1.0, 0.0, 0)


def dense_chain(head, tokens: list[int], aux: torch.Tensor, k: int) -> list[int]:
    """K greedy tokens drafted by running the head densely over everything, re-run per depth (the reference)."""
    feats = head.fuse(torch.cat([aux.new_zeros(1, aux.shape[1]), aux[: len(tokens) - 1]]))  # [n, H]
    toks, out = list(tokens), []
    for _ in range(k):
        head.features = feats
        hidden = head(torch.tensor(toks), torch.arange(len(toks)), DenseCausalContext())
        nxt = int(head.compute_logits(hidden[-1:]).argmax())
        out.append(nxt)
        feats = torch.cat([feats, head.prenorm[-1:]])  # the drafted token reads the head's own output
        toks.append(nxt)
    return out


@torch.inference_mode()
def test_drafts_match_the_dense_head_across_rounds(llama, tmp_path) -> None:
    tcfg = ModelConfig.from_pretrained(llama.target)
    path = random_head(tmp_path / "head", tcfg, seed=7)
    worker = EagleDraftWorker(WorkerConfig(path, 32, 4, eagle_target=llama.target,
                                           eagle_target_config=tcfg.to_dict()))
    target = load_model(llama.target)
    target.model.aux_layers = worker.aux_layers
    seq = [1, 17, 44, 9, 83, 5, 60, 61, 2, 33, 90, 7]
    aux = target_pass(target, torch.tensor([seq]))[0][0]  # [n, F]: the target's features of every position
    table = list(range(16))

    # Round 1: the prompt (7 tokens) and the first sampled token; the target has verified the prompt rows.
    worker.features.put([SeqFeatures(0, 0, aux[:7])])
    out = worker.step(DraftStep(seqs=[DraftSeq(0, table, 0, seq[:8], GREEDY, [1, 1, 1])]))
    assert out.results[0].trees[0].tokens == dense_chain(worker.head, seq[:8], aux, 3)
    assert out.results[0].trees[0].kv_depth == 0  # drafted KV is never kept

    # Round 2: two candidates were accepted and a bonus came (seq[8:11]); the target sends rows 7..9.
    worker.features.put([SeqFeatures(0, 7, aux[7:10])])
    out = worker.step(DraftStep(commits=[DraftCommit(0, 8)],
                                seqs=[DraftSeq(0, table, 8, seq[8:11], GREEDY, [1, 1])]))
    assert out.results[0].trees[0].tokens == dense_chain(worker.head, seq[:11], aux, 2)

    # A replaced draft is sent a sequence's prefix (its features died with the old draft): zeros stand in, and it
    # drafts again from the next round on.
    other = list(range(16, 32))
    worker.step(DraftStep(prefills=[PrefillSeq(1, other, 0, seq[:8])]))
    out = worker.step(DraftStep(seqs=[DraftSeq(1, other, 8, seq[8:9], GREEDY, [1, 1])]))
    assert len(out.results[0].trees[0].tokens) == 2

    # A dynamic tree below the same prefix: the budget's most probable nodes, the greedy token first.
    worker.config = WorkerConfig(path, 32, 4, eagle_target=llama.target, eagle_target_config=tcfg.to_dict(),
                                 eagle_topk=2)
    worker.features.put([SeqFeatures(0, 10, aux[10:11])])
    out = worker.step(DraftStep(commits=[DraftCommit(0, 3)],
                                seqs=[DraftSeq(0, table, 11, seq[11:12], GREEDY, [1, 1, 3])]))
    tree = out.results[0].trees[0]
    assert len(tree.tokens) == 5  # the budget: branching (1, 1, 3) reserves 5 nodes
    assert tree.tokens[0] == dense_chain(worker.head, seq, aux, 1)[0] and tree.parents[0] == -1
    depths = [0] * 5
    for i, p in enumerate(tree.parents):
        assert p < i  # depth order: a parent before its children
        depths[i] = 0 if p < 0 else depths[p] + 1
    assert depths == sorted(depths) and max(depths) <= 2


def test_feature_store_follows_the_target() -> None:
    """Rows arrive in position order; a re-prefill (a preempted sequence recomputed) starts over; only the target's
    finished ids forget a sequence: a preempted one comes back under its id, maybe before the draft hears of it."""
    store = FeatureStore()
    rows = torch.arange(24.0).view(12, 2)  # [positions, F]
    store.put([SeqFeatures(5, 0, rows[:4])])
    store.put([SeqFeatures(5, 4, rows[4:7])])
    assert torch.equal(store.take(5, -1, 6, 2, torch.device("cpu")), torch.cat([torch.zeros(1, 2), rows[:6]]))
    store.put([SeqFeatures(5, 0, rows[:9] + 100)])  # recomputed from position 0
    assert torch.equal(store.take(5, 7, 9, 2, torch.device("cpu")), rows[7:9] + 100)
    with pytest.raises(RuntimeError, match="not here"):
        store.take(5, 3, 5, 2, torch.device("cpu"))  # drafting never goes back past what it took
    store.put([], finished=[5])
    assert len(store) == 0
