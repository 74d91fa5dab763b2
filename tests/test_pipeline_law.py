"""The law of tokens verified against pre-drafted trees only (pipelining's hit path), by a conditional PIT test.

test_pipeline.py's chi-square samples a fixed pair of positions after one prompt: there only ~4 % of the samples
come through a pre-drafted tree, so a wrong law on those trees alone goes unseen (p = 0.97 in issue 18). Here
every token a hit round emits is tested against the target's own law given its exact prefix: for a token t
drawn from p(. | prefix), the randomized probability integral transform u = F(t-) + V * p(t) (F(t-): p's mass on
the tokens ranked before t by decreasing p, V ~ U(0, 1) independent) is U(0, 1), and the u of successive tokens
are independent (the Rosenblatt transform). Selecting the tokens of hit rounds keeps that: whether a round hits is
fixed before the target draws its tokens. A chi-square of the u over equal bins then tests the hit path's law alone.

The draft is the target itself, so most rounds are fully accepted and their bonus token is among the pre-drafted
outcomes often: most rounds after the first are hits.
"""

from __future__ import annotations

import random

import torch
from scipy.stats import chisquare

from engine import LLM, SamplingParams
from tests.conftest import spec

BINS = 10


def _hit_round_pit(target: str, n: int) -> tuple[float, int, int]:
    """(p-value of the u of every token emitted by a hit round, how many such tokens, hit rounds)."""
    from transformers import AutoModelForCausalLM

    cfg = {**spec(target, k=2), "pipeline": True, "pipeline_switch": False, "pipeline_width": 4}
    llm = LLM(target, speculative_config=cfg, max_num_seqs=256)
    pipe = llm.engine.pipeline
    hits: dict[int, bool] = {}
    drawn: list[tuple[list[int], list[int]]] = []  # (prefix, tokens the hit round emitted)
    propose, commit = pipe.propose, pipe.commit

    def spy_propose(batch, gone):  # whether each round is served by a pre-drafted tree, before it is taken
        hits.clear()
        hits.update({r.seq_id: pipe.has_tree(r.seq_id) for r in batch.rounds})
        return propose(batch, gone)

    def spy_commit(batch, trees, out):  # the round's tokens are not appended yet: all_token_ids is the prefix
        for r, tree, res in zip(batch.rounds, trees, out.results, strict=True):
            if hits.get(r.seq_id) and tree.num_nodes:
                drawn.append((list(r.all_token_ids), list(res.tokens)))
        return commit(batch, trees, out)

    pipe.propose, pipe.commit = spy_propose, spy_commit
    rng = random.Random(0)
    prompts = [[rng.randrange(1, 12) for _ in range(3)] for _ in range(n)]
    params = [SamplingParams(max_tokens=14, temperature=1.0, seed=500 + i, ignore_eos=True) for i in range(n)]
    llm.generate(prompts, params)
    llm.shutdown()

    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    seqs = [prefix + toks[:j] for prefix, toks in drawn for j in range(len(toks))]
    tokens = [t for _, toks in drawn for t in toks]
    by_len: dict[int, list[int]] = {}
    for i, s in enumerate(seqs):
        by_len.setdefault(len(s), []).append(i)
    probs = torch.empty(len(seqs), model.config.vocab_size)  # [N, V] p(. | prefix) at T = 1
    with torch.no_grad():
        for idx in by_len.values():
            logits = model(torch.tensor([seqs[i] for i in idx])).logits[:, -1].float()  # [n, V]
            probs[idx] = torch.softmax(logits, dim=-1)
    # The CDF runs over tokens by decreasing p (a function of the prefix, so u stays uniform): a law that moves
    # mass between likely and unlikely tokens then moves u the same way for every prefix.
    sorted_p, order = torch.sort(probs, dim=-1, descending=True, stable=True)  # [N, V]
    rank = torch.argsort(order, dim=-1).gather(1, torch.tensor(tokens)[:, None])  # [N, 1] t's place in order
    p_t = sorted_p.gather(1, rank)[:, 0]  # [N]
    cdf_below = torch.cumsum(sorted_p, dim=-1).gather(1, rank)[:, 0] - p_t  # [N]
    gen = torch.Generator().manual_seed(1)
    u = cdf_below + torch.rand(len(tokens), generator=gen) * p_t  # [N]
    counts = torch.histc(u.clamp(0, 1 - 1e-9), bins=BINS, min=0.0, max=1.0)
    return chisquare(counts.numpy()).pvalue, len(tokens), len(drawn)


def test_hit_rounds_follow_the_target_law(small_vocab):
    target, _ = small_vocab
    p_value, n_tokens, n_hits = _hit_round_pit(target, 500)
    assert n_hits > 800 and n_tokens > 2500  # the hit path is what is sampled
    assert p_value > 1e-3, f"tokens of hit rounds do not follow the target's law (p = {p_value:.2e})"


def test_a_wrong_law_on_pre_drafted_trees_only_is_caught(small_vocab, monkeypatch):
    """Pre-drafted trees (draft calls carrying guesses) verified against q^(1/2) instead of the q their
    candidates were drawn from; trees drafted for the current round keep the right law."""
    import workers.draft_worker as draft_worker

    target, _ = small_vocab
    real_draw, real_step = draft_worker.draw_children, draft_worker.DraftWorker.step
    predraft = [False]

    def step(self, msg):
        predraft[0] = any(s.guesses for s in msg.seqs)
        return real_step(self, msg)

    def flatter_on_predrafts(q, k, mode, generator):
        tokens, laws = real_draw(q, k, mode, generator)
        if not predraft[0]:
            return tokens, laws
        wrong = laws.sqrt()  # the draws still come from q
        return tokens, wrong / wrong.sum(dim=-1, keepdim=True)

    monkeypatch.setattr(draft_worker, "draw_children", flatter_on_predrafts)
    monkeypatch.setattr(draft_worker.DraftWorker, "step", step)
    p_value, _, n_hits = _hit_round_pit(target, 500)
    assert n_hits > 800
    assert p_value < 1e-6, f"a wrong law on pre-drafted trees went unnoticed (p = {p_value:.2e})"
