"""The compressed state after speculative rounds equals serial decoding of the accepted tokens.

Every round, each request of a batch verifies a candidate tree in one forward (deeper than the sliding window,
siblings with distinct tokens) and accepts a random path -- every request a different number of tokens, paths
that cross summary-window boundaries. After every round, for every request:
- its committed state (every layer: ring, accumulators, summaries, indexer keys; position) equals the state
  of decoding the same accepted tokens one at a time, within 1e-6 (float64 models, so 1e-6 means "same");
- the logits of the last accepted node equal serial decoding's and the oracle's (transformers, uncached).

``test_state_check_catches_fault`` injects the three bugs the issue names and asserts the same check fails:
commit installs a sibling's rows, the ring slot is not advanced within a multi-token commit, a summary is
visible one token before its window is complete.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from tests.helpers_v4 import assert_states_close, feed, oracle_logits, ours_from_hf, path_to, tiny_hf_model
from workers import compressed_state as cs
from workers.compressed_state import SeqState

TOL = 1e-5  # logits vs the oracle (which keeps some parts in fp32); ours vs serial decoding: 1e-9
BATCH, DEPTH, ROUNDS = 4, 6, 5


@pytest.fixture(scope="module")
def pair():
    hf = tiny_hf_model(seed=0).double()
    ours, cfg = ours_from_hf(hf, torch.float64)
    return hf, ours, cfg


def _tree(gen: torch.Generator, depth: int, extra: int, vocab: int, root_token: int) -> tuple[list[int], list[int]]:
    """A spine of ``depth`` nodes plus ``extra`` branch nodes; siblings carry distinct tokens."""
    parents = [-1] + list(range(depth - 1))
    for _ in range(extra):
        parents.append(int(torch.randint(len(parents), (1,), generator=gen)))
    tokens = [root_token]
    for i in range(1, len(parents)):
        taken = {tokens[j] for j in range(1, i) if parents[j] == parents[i]}
        tok = int(torch.randint(2, vocab, (1,), generator=gen))
        while tok in taken:
            tok = int(torch.randint(2, vocab, (1,), generator=gen))
        tokens.append(tok)
    return parents, tokens


def run_rounds(hf, ours, cfg, seed: int, stats: dict[str, int] | None = None) -> None:
    gen = torch.Generator().manual_seed(seed)
    vocab = cfg.vocab_size
    prompts = [torch.randint(2, vocab, (n,), generator=gen).tolist() for n in (5, 11, 18, 26)[:BATCH]]
    states, refs = [], []
    for p in prompts:
        st, ref = SeqState.empty(cfg), SeqState.empty(cfg)
        feed(ours, cfg, st, p, 5)  # chunked prefill
        feed(ours, cfg, ref, p, 1)  # the reference decodes every token on its own
        states.append(st)
        refs.append(ref)
    committed = [list(p) for p in prompts]
    pending = [int(torch.randint(2, vocab, (1,), generator=gen)) for _ in prompts]
    for _ in range(ROUNDS):
        trees = [_tree(gen, DEPTH, 5, vocab, pending[i]) for i in range(len(prompts))]
        plans = [cs.make_plan(cfg, st.position, parents) for st, (parents, _) in zip(states, trees, strict=True)]
        logits, scratch = ours.run([(st, plan, toks) for st, plan, (_, toks) in zip(states, plans, trees, strict=True)])
        row = 0
        lengths = torch.randperm(DEPTH, generator=gen)[: len(prompts)] + 1  # distinct acceptance lengths
        for i, ((parents, toks), plan) in enumerate(zip(trees, plans, strict=True)):
            depth_of = [len(path_to(parents, j)) for j in range(len(parents))]
            at_length = [j for j in range(len(parents)) if depth_of[j] == int(lengths[i])]
            node = at_length[int(torch.randint(len(at_length), (1,), generator=gen))]
            path = path_to(parents, node)
            cs.commit(states[i], plan, scratch[i], path)
            accepted = [toks[j] for j in path]
            committed[i] += accepted
            ref_logits = feed(ours, cfg, refs[i], accepted, 1)
            assert_states_close(states[i], refs[i], atol=1e-6)
            mine = logits[row + path[-1]]
            assert (mine - ref_logits[-1]).abs().max() < 1e-9, "next-token logits differ from serial decoding"
            assert (mine - oracle_logits(hf, committed[i])[-1]).abs().max() < TOL, "logits differ from the oracle"
            if stats is not None:
                start = len(committed[i]) - len(accepted)
                crossed = any((start + k + 1) % m == 0 for k in range(1, len(path)) for m in (4, 8))
                stats["boundary_crossings"] += int(crossed)
                stats["longer_than_window"] += int(len(path) > cfg.sliding_window)
                stats["with_siblings"] += int(any(parents.count(p) > 1 for p in (parents[j] for j in path)))
            row += len(parents)
            pending[i] = int(torch.randint(2, vocab, (1,), generator=gen))


def test_committed_state_equals_serial_decoding_after_every_round(pair) -> None:
    stats = {"boundary_crossings": 0, "longer_than_window": 0, "with_siblings": 0}
    run_rounds(*pair, seed=1, stats=stats)
    assert all(v > 0 for v in stats.values()), stats  # the patterns the test is about did occur


def _commit_sibling(monkeypatch: pytest.MonkeyPatch) -> None:
    original = cs.commit

    def commit(state, plan, scratch, path):
        last = path[-1]
        siblings = [j for j, p in enumerate(plan.parents) if p == plan.parents[last] and j != last]
        original(state, plan, scratch, path[:-1] + siblings[:1] if siblings else path)

    monkeypatch.setattr(cs, "commit", commit)


def _ring_not_advanced(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cs, "ring_slots", lambda positions, window: (positions[:1] % window).expand_as(positions))


def _summary_early(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cs, "summaries_visible", lambda positions, ratio: (positions + 2) // ratio)


FAULTS: dict[str, Callable[[pytest.MonkeyPatch], None]] = {
    "commit_installs_sibling": _commit_sibling,
    "ring_slot_not_advanced": _ring_not_advanced,
    "summary_visible_one_token_early": _summary_early,
}


@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_state_check_catches_fault(pair, fault: str, monkeypatch: pytest.MonkeyPatch) -> None:
    FAULTS[fault](monkeypatch)
    with pytest.raises(AssertionError):
        run_rounds(*pair, seed=1)


def test_undo_of_a_commit_then_partial_recommit_equals_serial(pair) -> None:
    """What a pipelined draft needs: take back the tail of the last commit (ring rows overwritten, summaries
    appended, across a window boundary) and keep its head."""
    _, ours, cfg = pair
    gen = torch.Generator().manual_seed(9)
    base = SeqState.empty(cfg)
    feed(ours, cfg, base, torch.randint(2, cfg.vocab_size, (13,), generator=gen).tolist(), 4)
    parents = [-1, 0, 1, 2, 3, 4, 5, 2, 7]  # a spine of 7 (> window 3, crosses two CSA windows) and a branch
    tokens = torch.randint(2, cfg.vocab_size, (len(parents),), generator=gen).tolist()
    plan = cs.make_plan(cfg, base.position, parents)
    _, scratch = ours.run([(base, plan, tokens)])
    state = base.clone()
    path = [0, 1, 2, 3, 4, 5, 6]
    undo = cs.save_undo(state, plan, path)
    cs.commit(state, plan, scratch[0], path)
    cs.apply_undo(state, undo)
    assert_states_close(state, base, atol=0.0)
    cs.commit(state, plan, scratch[0], path[:4])
    serial = base.clone()
    feed(ours, cfg, serial, [tokens[j] for j in path[:4]], 1)
    assert_states_close(state, serial)
