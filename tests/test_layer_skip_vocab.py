"""An exit adapter with a draft vocabulary (``draft_vocab.json``): the exit projects onto those head rows only,
drafts only those ids, records a law that is zero elsewhere, and the output is still the target's: greedy equals
no speculation, and the sampled law passes the chi-square tests. Negative control: drafts drawn from the restricted
law while the unrestricted one is recorded fail them."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

import workers.layer_skip.self_drafter as self_drafter
from engine.core.config import DEFAULT_MODELS_DIR
from engine.llm import LLM
from scheduler.sampling_params import SamplingParams
from tests.conftest import SMALL_VOCAB
from tests.test_engine_sampling import ALPHA, exact_joint, pair_pvalues, sample_engine, target_logits  # noqa: F401
from tests.test_layer_skip import GREEDY, PROMPT, TABLE, TARGET, _prefilled
from tests.test_layer_skip_sampling import small_vocab  # noqa: F401
from workers.layer_skip.exit import VOCAB_FILE, ExitAdapter, ExitAdapterConfig, target_name
from workers.layer_skip.messages import SelfDraftSeq, SelfDraftStep

EVEN = list(range(0, SMALL_VOCAB, 2))  # the 12-token target's draft vocabulary in the law tests


def _with_vocab(adapter_dir: str, out: str, ids: list[int]) -> str:
    shutil.copytree(adapter_dir, out)
    with open(f"{out}/{VOCAB_FILE}", "w") as f:
        json.dump({"ids": ids}, f)
    return out


def test_drafts_stay_in_the_vocabulary_and_greedy_equals_no_speculation(tmp_path) -> None:
    ids = list(range(0, 4096, 3))
    exit_dir = _with_vocab(str(DEFAULT_MODELS_DIR / "target-exit"), str(tmp_path / "exit"), ids)
    layer = json.load(open(f"{exit_dir}/config.json"))["exit_layer"]
    mine, first = _prefilled(layer_skip_exit_layer=layer, layer_skip_adapter=exit_dir)
    tree = mine.self_draft(SelfDraftStep([SelfDraftSeq(0, TABLE, len(PROMPT), [first], GREEDY, 4)])).trees[0]
    assert len(tree.tokens) == 4 and set(tree.tokens) <= set(ids)
    prompts = [[1] + list(range(20, 32)), [1, 17, 44, 9, 83]]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    with LLM(TARGET, None, max_num_seqs=2) as llm:
        expected = [o.token_ids for o in llm.generate(prompts, params)]
    with LLM(TARGET, {"method": "layer_skip", "model": exit_dir, "num_speculative_tokens": 3}, max_num_seqs=2) as llm:
        assert [o.token_ids for o in llm.generate(prompts, params)] == expected
        stats = llm.engine.stats.as_dict()
    assert 0 < stats["accepted_tokens"] < stats["drafted_tokens"], stats


def test_a_bad_vocabulary_is_refused(tmp_path) -> None:
    exit_dir = _with_vocab(str(DEFAULT_MODELS_DIR / "target-exit"), str(tmp_path / "exit"), [5, 3])
    with pytest.raises(ValueError, match="distinct, sorted and in 0 .. 4095"):
        _prefilled(layer_skip_exit_layer=3, layer_skip_adapter=exit_dir)


@pytest.fixture(scope="module")
def vocab_exit(small_vocab, tmp_path_factory) -> str:  # noqa: F811
    """An exit adapter at L 1 for the 12-token target (zero down-projection: the target's own exit) drafting even
    ids only."""
    target = small_vocab[0]
    cfg = json.load(open(f"{target}/config.json"))
    c = ExitAdapterConfig(exit_layer=1, target=target_name(target), hidden_size=cfg["hidden_size"],
                          adapter_size=8, num_layers=cfg["num_hidden_layers"])
    adapter = ExitAdapter(c)
    torch.nn.init.zeros_(adapter.down.weight)
    root = tmp_path_factory.mktemp("vocab-exit")
    adapter.save(str(root / "plain"))
    return _with_vocab(str(root / "plain"), str(root / "even"), EVEN)


def _spec(exit_dir: str) -> dict:
    return {"method": "layer_skip", "model": exit_dir, "num_speculative_tokens": 2}


def test_the_output_law_is_the_targets(small_vocab, target_logits, vocab_exit) -> None:  # noqa: F811
    (tokens,), llm = sample_engine(small_vocab[0], _spec(vocab_exit), [(1.0, -1, 1.0)])
    stats = llm.engine.stats
    assert 0 < stats.num_accepted < stats.num_drafted, stats.as_dict()
    assert set(tokens.ravel().tolist()) - set(EVEN)  # the target's own tokens outside the draft vocabulary appear
    assert min(pair_pvalues(tokens, exact_joint(target_logits, 1.0)).values()) > ALPHA


def test_restricted_draws_with_an_unrestricted_law_recorded_are_caught(small_vocab, target_logits, vocab_exit,  # noqa: F811
                                                                       monkeypatch) -> None:
    """The adapter without its vocabulary file records the full softmax; the draws are made from it restricted to
    the even ids (what a restricted exit that forgot to restrict its recorded law would do)."""
    real = self_drafter.draw_children
    mask = torch.zeros(SMALL_VOCAB)
    mask[EVEN] = 1.0

    def restricted(q, k, mode, gen):
        p = q * mask  # [V]
        return real(p / p.sum(), k, mode, gen)  # the recorded law stays q (i.i.d. children record their parent's)

    monkeypatch.setattr(self_drafter, "draw_children", restricted)
    plain = vocab_exit.replace("/even", "/plain")
    (tokens,), _ = sample_engine(small_vocab[0], _spec(plain), [(1.0, -1, 1.0)])
    assert min(pair_pvalues(tokens, exact_joint(target_logits, 1.0)).values()) < 1e-6
