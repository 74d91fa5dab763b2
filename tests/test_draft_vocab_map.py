"""A draft with a trimmed vocabulary (workers/vocab_map.py) keeps the target's output exact.

The drafts here are the target itself with its embedding and head cut down to a shuffled subset of the ids
(so they agree with the target wherever its choice is on the map, and must propose nothing else); prompts use
ids off the map, which the draft reads through its fallback row.

- greedy: speculation gives exactly the no-speculation tokens, with candidates accepted;
- sampling: the distribution harness of tests/test_engine_sampling.py (chi-square on the first four tokens
  against the target's exact law) passes with the trimmed draft;
- negative control: a draft whose reported q is mis-mapped (row r's probability reported at the id of row
  r + 1; the tokens are still drawn from the true q) is caught by the same harness. (Reading the rows as a
  vocabulary prefix instead is refused outright by the verifier: q(x) = 0 for a drawn x.)
"""

from __future__ import annotations

import json
import os
import random

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.llm import LLM
from scheduler.sampling_params import SamplingParams
from tests.conftest import SMALL_VOCAB, VOCAB, spec
from tests.helpers_models import make_tiny_checkpoint
from tests.test_engine_sampling import (  # noqa: F401  (target_logits is a fixture used by name)
    ALPHA,
    N,
    exact_joint,
    pair_pvalues,
    sample_engine,
    target_logits,
)
from workers.vocab_map import DraftVocabMap


def trimmed_copy(src: str, dst: str, ids: list[int], fallback_row: int) -> str:
    """``src``'s weights with embedding/head rows for ``ids`` only, plus the map; returns ``dst``."""
    os.makedirs(dst, exist_ok=True)
    sd = load_file(os.path.join(src, "model.safetensors"))
    idx = torch.tensor(ids)
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        sd[name] = sd[name][idx].contiguous()  # [Vd, hidden]
    save_file(sd, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(src, "config.json")) as f:
        cfg = json.load(f)
    full_vocab = cfg["vocab_size"]
    cfg["vocab_size"] = len(ids)
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(cfg, f)
    DraftVocabMap.build(ids, full_vocab, fallback_row).save(dst)
    return dst


@pytest.fixture(scope="module")
def greedy_pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    root = tmp_path_factory.mktemp("trimmed-greedy")
    target = make_tiny_checkpoint(root / "target", family="llama", vocab_size=VOCAB, seed=11)
    ids = random.Random(0).sample(range(VOCAB), 48)  # shuffled: row r is not id r
    return target, trimmed_copy(target, str(root / "draft"), ids, fallback_row=5)


@pytest.fixture(scope="module")
def small_trimmed(small_vocab) -> tuple[str, str]:
    """The 12-token target of the distribution harness and its trimmed copy over 8 ids (prompt ids 4, 7 off)."""
    target, _ = small_vocab
    ids = [9, 2, 5, 0, 11, 3, 1, 8]
    return target, trimmed_copy(target, os.path.join(os.path.dirname(target), "trimmed-draft"), ids, 0)


def test_map_validation(tmp_path) -> None:
    with pytest.raises(ValueError, match="duplicates"):
        DraftVocabMap.build([1, 1], 4)
    with pytest.raises(ValueError, match=r"\[0, 4\)"):
        DraftVocabMap.build([1, 4], 4)
    m = DraftVocabMap.build([3, 1], 4, fallback_row=1)
    assert m.to_local([0, 1, 2, 3, 9]) == [1, 1, 1, 0, 1]
    full = m.to_full(torch.tensor([[0.5, -1.0]]))  # [1, 4]
    assert full[0, 3] == 0.5 and full[0, 1] == -1.0 and torch.isinf(full[0, [0, 2]]).all()
    assert torch.softmax(full, dim=-1)[0, [0, 2]].eq(0).all()  # exact zeros off the map


def test_greedy_with_trimmed_draft_equals_no_speculation(greedy_pair) -> None:
    target, draft = greedy_pair
    rng = random.Random(1)
    prompts = [[1] + [rng.randrange(3, VOCAB) for _ in range(rng.randrange(3, 9))] for _ in range(6)]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    plain = [o.token_ids for o in LLM(target, None, max_model_len=64).generate(prompts, params)]
    llm = LLM(target, spec(draft, k=4), max_model_len=64)
    specd = [o.token_ids for o in llm.generate(prompts, params)]
    assert specd == plain
    stats = llm.engine.stats
    assert 0 < stats.num_accepted < stats.num_drafted, stats.as_dict()  # it really speculated, both ways


def test_trimmed_draft_keeps_the_target_law(small_trimmed, target_logits) -> None:  # noqa: F811
    target, draft = small_trimmed
    laws = [(1.0, -1, 1.0), (0.7, 5, 1.0)]
    samples, llm = sample_engine(target, spec(draft, None, [2, 2], "iid"), laws)
    stats = llm.engine.stats
    assert stats.num_rounds >= N * len(laws) and 0 < stats.num_accepted < stats.num_drafted, stats.as_dict()
    for tokens, law in zip(samples, laws, strict=True):
        pvalues = pair_pvalues(tokens, exact_joint(target_logits, *law))
        assert min(pvalues.values()) > ALPHA, (law, pvalues)


def test_a_mis_mapped_q_is_caught(small_trimmed, target_logits, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    import workers.draft_worker as draft_worker

    target, draft = small_trimmed
    ids = DraftVocabMap.load(draft).ids
    real = draft_worker.draw_children

    def off_by_one_q(q, k, mode, generator):
        tokens, laws = real(q, k, mode, generator)
        wrong = torch.zeros_like(laws)
        wrong[..., ids] = laws[..., ids.roll(1)]  # row r's probability reported at the id of row r + 1
        return tokens, wrong

    monkeypatch.setattr(draft_worker, "draw_children", off_by_one_q)
    (tokens,), _ = sample_engine(target, spec(draft, None, [2, 2], "iid"), [(1.0, -1, 1.0)])
    pvalues = pair_pvalues(tokens, exact_joint(target_logits, 1.0))
    assert min(pvalues.values()) < 1e-6, pvalues


def test_a_map_for_another_vocabulary_is_refused(greedy_pair, small_vocab, tmp_path) -> None:
    _, draft = greedy_pair
    small_target, _ = small_vocab
    with pytest.raises(ValueError, match="vocabulary map"):
        LLM(small_target, spec(draft, k=2))
    assert SMALL_VOCAB < VOCAB


def test_smollm2_short_name_takes_its_shipped_draft(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``--target smollm2`` speculates with engine/default_models/smollm2-draft when it is shipped; 'none' and an
    explicit model still win; with no shipped draft it runs without speculation, as before."""
    import engine.core.config as config
    from engine.core.args import EngineArgs
    from tests.helpers_gguf import smollm2_path

    gguf = smollm2_path()
    monkeypatch.setattr(config, "DEFAULT_MODELS_DIR", tmp_path)
    assert EngineArgs(target="smollm2").to_engine_config().speculative is None  # nothing shipped here
    (tmp_path / "smollm2-draft").mkdir()
    (tmp_path / "smollm2-draft" / "config.json").write_text("{}")
    cfg = EngineArgs(target="smollm2").to_engine_config()
    assert cfg.target == gguf and cfg.speculative.model == str(tmp_path / "smollm2-draft")
    assert EngineArgs(target="smollm2", speculative_config='{"num_speculative_tokens": 2}').to_engine_config(
    ).speculative.model == str(tmp_path / "smollm2-draft")
    assert EngineArgs(target="smollm2", speculative_config="none").to_engine_config().speculative is None
    assert EngineArgs(target="smollm2", speculative_config={"model": "smollm2"}).to_engine_config(
    ).speculative.model == gguf


def test_full_vocab_view_for_transformers_assisted_generation(greedy_pair) -> None:
    """``bench compare``'s transformers baselines take the trimmed draft through ``full_vocab_view``: full ids in,
    the draft's own logits at its mapped ids and -inf elsewhere out, so assisted generation proposes from the same
    law as the engine's draft worker (and its greedy output is the target's)."""
    from transformers import AutoModelForCausalLM

    from benchmarks.compare import full_vocab_view

    target_dir, draft_dir = greedy_pair
    vmap = DraftVocabMap.load(draft_dir)
    raw = AutoModelForCausalLM.from_pretrained(draft_dir).eval()
    view = full_vocab_view(AutoModelForCausalLM.from_pretrained(draft_dir).eval(), draft_dir)
    ids = torch.tensor([[3, int(vmap.ids[0]), 17, int(vmap.ids[5])]])  # [1, 4]: on and off the map
    with torch.no_grad():
        full = view(ids).logits  # [1, 4, VOCAB]
        own = raw(vmap.local[ids]).logits  # [1, 4, Vd]
    assert full.shape[-1] == VOCAB and torch.equal(full[..., vmap.ids], own)
    off = torch.ones(VOCAB, dtype=torch.bool)
    off[vmap.ids] = False
    assert torch.isneginf(full[..., off]).all()
    target = AutoModelForCausalLM.from_pretrained(target_dir).eval()
    prompt = torch.tensor([[1, 2, 3, 4, 5]])
    with torch.no_grad():
        plain = target.generate(prompt, max_new_tokens=8, do_sample=False, pad_token_id=0)
        assisted = target.generate(prompt, max_new_tokens=8, do_sample=False, pad_token_id=0, assistant_model=view)
    assert torch.equal(plain, assisted)
