"""Self-speculation (method layer_skip): reuse of the early layers' KV is exact, greedy output is the target's,
and the keys that cannot run are refused with what to pass instead.

The reuse test is on the built-in target, whose every path is row-invariant (workers/loader.py): a verify that
starts the drafted rows at layer L gives the very bits of a verify from layer 0; a stale layer-0 entry in one
drafted row's slot (what a broken reuse would leave) makes it differ.
"""

from __future__ import annotations

import pytest
import torch

import workers.layer_skip.self_drafter as self_drafter
from engine.core.config import EngineConfig, SpeculativeConfig
from engine.core.draft_setup import draft_setup
from engine.llm import LLM
from scheduler.sampling_params import SamplingParams
from workers.input_batch import SeqForward
from workers.layer_skip.exit import ExitAdapter, ExitAdapterConfig
from workers.layer_skip.messages import SelfDraftSeq, SelfDraftStep
from workers.messages import PrefillSeq, SamplingSpec, TargetStep
from workers.model_config import ModelConfig
from workers.target_worker import TargetWorker
from workers.tree_topology import scratch_parents
from workers.worker_config import WorkerConfig

TARGET = "engine/default_models/target"
GREEDY = SamplingSpec(0.0, 0, 1.0, 0.0, None)
PROMPT = list(range(5, 40))
TABLE = list(range(1, 10))


def _verify_rows(first: int, drafted: list[int], parents: list[int] | None = None) -> SeqForward:
    """The verify pass's piece for one sequence: the in-flight token, then the drafted tree (all logits)."""
    n = 1 + len(drafted)
    scratch = scratch_parents(1, list(range(-1, n - 2)) if parents is None else parents)
    return SeqForward(TABLE, len(PROMPT), scratch, [first] + drafted, logit_nodes=list(range(n)))


def _prefilled(**kw) -> tuple[TargetWorker, int]:
    w = TargetWorker(WorkerConfig(TARGET, 64, 16, **kw))
    out = w.step(TargetStep(prefills=[PrefillSeq(0, TABLE, 0, PROMPT, GREEDY)]))
    return w, out.first_tokens[0]


@pytest.mark.parametrize("exit_layer", [1, 4, 7])
def test_verify_after_reuse_is_bit_identical_to_verify_from_scratch(exit_layer: int) -> None:
    mine, first = _prefilled(layer_skip_exit_layer=exit_layer)
    plain, _ = _prefilled()
    tree = mine.self_draft(SelfDraftStep([SelfDraftSeq(0, TABLE, len(PROMPT), [first], GREEDY, 4)])).trees[0]
    assert len(tree.tokens) == 4 and tree.parents == [-1, 0, 1, 2]
    rows = _verify_rows(first, tree.tokens)
    reused = mine.self_drafter.forward([rows], [0])  # [5, V]: layers < L from the draft passes
    assert torch.equal(reused, plain.runner.forward([rows]))
    # the committed prefix and the upper layers are the plain worker's too: the next forward agrees as well
    assert torch.equal(mine.runner.cache.kv, plain.runner.cache.kv)


@pytest.mark.parametrize("exit_layer", [2, 5])
def test_verify_of_a_tree_after_reuse_is_bit_identical_to_verify_from_scratch(exit_layer: int) -> None:
    """A tree (2 children at the first two depths, then chains): every branch's rows of layers < L come from the
    draft passes, written at the scratch slots the verify uses, each node attending to its own ancestors only."""
    mine, first = _prefilled(layer_skip_exit_layer=exit_layer)
    plain, _ = _prefilled()
    tree = mine.self_draft(SelfDraftStep([SelfDraftSeq(0, TABLE, len(PROMPT), [first], GREEDY, 3, [2, 2, 1])])
                           ).trees[0]
    assert tree.parents == [-1, -1, 0, 0, 1, 1, 2, 3, 4, 5]
    rows = _verify_rows(first, tree.tokens, tree.parents)
    reused = mine.self_drafter.forward([rows], [0])  # [11, V]
    assert torch.equal(reused, plain.runner.forward([rows]))
    assert torch.equal(mine.runner.cache.kv, plain.runner.cache.kv)


def stale_lower_layers(monkeypatch: pytest.MonkeyPatch) -> None:
    """Broken reuse: every draft pass's layer-0 KV is put back to what its slots held before the pass, so the
    later passes (and the verify's committed rows) read stale layer-0 entries. For negative controls."""
    real = self_drafter.run_layers

    def stale(model, ids, positions, ctx, start, stop, hidden=None):
        if start != 0:
            return real(model, ids, positions, ctx, start, stop, hidden)
        slots = ctx.meta.slot_mapping  # [T]
        k, v = ctx.cache.k[0][slots].clone(), ctx.cache.v[0][slots].clone()
        out = real(model, ids, positions, ctx, start, stop, hidden)
        ctx.cache.k[0][slots], ctx.cache.v[0][slots] = k, v
        return out

    monkeypatch.setattr(self_drafter, "run_layers", stale)


@pytest.mark.parametrize("branching", [[], [2, 2, 1]])
def test_a_stale_lower_layer_entry_is_caught(monkeypatch, branching: list[int]) -> None:
    """Negative control of the tests above: the drafted rows' layer-0 entries left stale change the logits."""
    stale_lower_layers(monkeypatch)
    mine, first = _prefilled(layer_skip_exit_layer=4)
    plain, _ = _prefilled()
    tree = mine.self_draft(SelfDraftStep([SelfDraftSeq(0, TABLE, len(PROMPT), [first], GREEDY,
                                                       len(branching) or 4, branching)])).trees[0]
    rows = _verify_rows(first, tree.tokens, tree.parents)
    assert not torch.equal(mine.self_drafter.forward([rows], [0]), plain.runner.forward([rows]))


def test_a_pad_that_does_not_match_is_verified_from_layer_zero() -> None:
    mine, first = _prefilled(layer_skip_exit_layer=4)
    plain, _ = _prefilled()
    tree = mine.self_draft(SelfDraftStep([SelfDraftSeq(0, TABLE, len(PROMPT), [first], GREEDY, 3)])).trees[0]
    other = [(t + 1) % 4096 for t in tree.tokens]  # not the drafted chain: its lower layers were never run
    rows = _verify_rows(first, other)
    assert torch.equal(mine.self_drafter.forward([rows], [0]), plain.runner.forward([rows]))


def _greedy(spec: dict | None, prompts: list[list[int]], n: int) -> tuple[list[list[int]], dict]:
    with LLM(TARGET, spec, max_num_seqs=4) as llm:
        outs = llm.generate(prompts, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
        return [o.token_ids for o in outs], llm.engine.stats.as_dict()


@pytest.mark.parametrize("exit_layer,k,branching", [(2, 3, None), (3, 4, [3, 2, 1, 1]),
                                                    pytest.param(6, 5, None, marks=pytest.mark.slow)])
def test_greedy_with_layer_skip_equals_no_speculation(exit_layer: int, k: int, branching: list[int] | None) -> None:
    prompts = [[1] + list(range(20, 32)), [1, 17, 44, 9, 83], [1]]
    expected, _ = _greedy(None, prompts, 24)
    spec = {"method": "layer_skip", "exit_layer": exit_layer, "num_speculative_tokens": k}
    got, stats = _greedy(spec | ({"tree_branching": branching} if branching else {}), prompts, 24)
    assert got == expected
    assert 0 < stats["accepted_tokens"] < stats["drafted_tokens"], stats  # accepted and rejected both ran


def test_exit_layer_outside_the_model_is_refused_with_the_valid_range() -> None:
    for bad in (8, 12):
        cfg = EngineConfig(target=TARGET, speculative=SpeculativeConfig.parse(
            {"method": "layer_skip", "exit_layer": bad, "num_speculative_tokens": 3}))
        with pytest.raises(ValueError, match=r"exit_layer must be in 1 \.\. 7 \(the target has 8 layers\)"):
            draft_setup(cfg, ModelConfig.from_pretrained(TARGET))
    with pytest.raises(ValueError, match="exit_layer must be an integer >= 1"):
        SpeculativeConfig.parse({"method": "layer_skip", "exit_layer": 0})
    with pytest.raises(ValueError, match="num_draft_tokens"):
        SpeculativeConfig.parse({"method": "layer_skip", "exit_layer": 2, "num_draft_tokens": 6})


def test_an_adapter_for_another_target_is_refused_naming_both(tmp_path) -> None:
    c = ExitAdapterConfig(exit_layer=3, target="smollm2", hidden_size=320, adapter_size=16, num_layers=8)
    ExitAdapter(c).save(str(tmp_path / "exit"))
    cfg = EngineConfig(target=TARGET, speculative=SpeculativeConfig.parse(
        {"method": "layer_skip", "model": str(tmp_path / "exit"), "num_speculative_tokens": 3}))
    with pytest.raises(ValueError, match="exit adapter for target 'smollm2'.*this target is 'target'"):
        draft_setup(cfg, ModelConfig.from_pretrained(TARGET))


@pytest.mark.slow  # builds a random pair and two engines: ~25 s on a loaded machine
def test_bench_compare_runs_specserve_layer_skip(tmp_path) -> None:
    import json

    from benchmarks.compare import main as compare_main

    out = tmp_path / "c.json"
    assert compare_main(["--random-shape", "64,3,128", "--random-dir", str(tmp_path / "pairs"), "--batches", "1",
                         "--temperatures", "0", "--max-tokens", "6", "--num-prompts", "1", "--repeats", "1",
                         "--skip-hf", "--skip-floor", "--modes", "specserve_nospec,specserve_layer_skip",
                         "--exit-layer", "1", "--json", str(out)]) == 0
    rows = {r["mode"]: r for r in json.loads(out.read_text())["results"]}
    assert set(rows) == {"specserve_nospec", "specserve_layer_skip"} and rows["specserve_layer_skip"]["tok_s"] > 0


def test_the_built_in_target_drafts_with_its_shipped_adapter() -> None:
    """``{"method": "layer_skip"}`` alone on the built-in target: its shipped exit adapter at the adapter's L."""
    from engine.core.config import DEFAULT_MODELS_DIR

    shipped = DEFAULT_MODELS_DIR / "target-exit"
    layer = ExitAdapterConfig.from_pretrained(str(shipped)).exit_layer
    cfg = EngineConfig(target=TARGET, speculative=SpeculativeConfig.parse({"method": "layer_skip"}))
    opts = draft_setup(cfg, ModelConfig.from_pretrained(TARGET)).target_options
    assert opts == {"layer_skip_exit_layer": layer, "layer_skip_adapter": str(shipped), "tree_sampling": "iid"}
    with pytest.raises(ValueError, match=f"trained on layer {layer}"):
        draft_setup(EngineConfig(target=TARGET, speculative=SpeculativeConfig.parse(
            {"method": "layer_skip", "model": str(shipped), "exit_layer": layer % 7 + 1})),
            ModelConfig.from_pretrained(TARGET))


def test_the_cli_config_for_the_built_in_target_adds_no_draft_model() -> None:
    """``--speculative-config '{"method": "layer_skip"}'`` on the built-in target: its shipped adapter, not the
    built-in draft (which a draft-model config without ``model`` gets)."""
    from engine.core.args import EngineArgs

    cfg = EngineArgs(speculative_config='{"method": "layer_skip"}').to_engine_config()
    assert cfg.speculative.model is None and cfg.speculative.draft_spec is None
    opts = draft_setup(cfg, ModelConfig.from_pretrained(cfg.target)).target_options
    assert opts["layer_skip_adapter"].endswith("target-exit")
