"""Self-speculation on the real SmolLM2-135M-Instruct Q4_1 GGUF (row-invariant 4-bit path): a verify after reuse
is bit-identical to a verify from scratch, and greedy output equals no speculation (adapter-free exit: SmolLM2
was not trained for early exit, so it accepts little; what is accepted is the target's)."""

from __future__ import annotations

import pytest
import torch

from engine.llm import LLM
from scheduler.sampling_params import SamplingParams
from tests.helpers_gguf import smollm2_path
from workers.input_batch import SeqForward
from workers.layer_skip.messages import SelfDraftSeq, SelfDraftStep
from workers.messages import PrefillSeq, SamplingSpec, TargetStep
from workers.target_worker import TargetWorker
from workers.worker_config import WorkerConfig

pytestmark = pytest.mark.slow  # the real SmolLM2 model

GREEDY = SamplingSpec(0.0, 0, 1.0, 0.0, None)
T08 = SamplingSpec(0.8, 0, 1.0, 0.0, 7)


def test_smollm2_verify_after_reuse_is_bit_identical() -> None:
    smol = smollm2_path()
    prompt, table = list(range(100, 130)), list(range(1, 5))
    workers = []
    for kw in ({"layer_skip_exit_layer": 12}, {}):
        w = TargetWorker(WorkerConfig(smol, 8, 16, **kw))
        first = w.step(TargetStep(prefills=[PrefillSeq(0, table, 0, prompt, GREEDY)])).first_tokens[0]
        workers.append(w)
    mine, plain = workers
    assert mine.model.row_invariant
    tree = mine.self_draft(SelfDraftStep([SelfDraftSeq(0, table, len(prompt), [first], T08, 4)])).trees[0]
    rows = SeqForward(table, len(prompt), list(range(-1, 4)), [first] + tree.tokens, logit_nodes=list(range(5)))
    assert torch.equal(mine.self_drafter.forward([rows], [0]), plain.runner.forward([rows]))


def test_smollm2_greedy_with_layer_skip_equals_no_speculation() -> None:
    smol = smollm2_path()
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    prompts = ["The capital of France is", "def fibonacci(n):"]
    with LLM(smol, "none", max_num_seqs=2) as llm:
        expected = [o.token_ids for o in llm.generate(prompts, params)]
    with LLM(smol, {"method": "layer_skip", "exit_layer": 20, "num_speculative_tokens": 3}, max_num_seqs=2) as llm:
        assert [o.token_ids for o in llm.generate(prompts, params)] == expected
        assert llm.engine.stats.num_accepted > 0


@pytest.mark.parametrize("branching", [None, [2, 2, 1, 1]])
def test_smollm2_drafts_with_its_shipped_exit_and_greedy_equals_no_speculation(branching: list[int] | None) -> None:
    """``{"method": "layer_skip"}`` alone on SmolLM2: its shipped exit adapter (L 10, a 5,000-id draft vocabulary),
    drafting chains and trees."""
    from engine.core.args import EngineArgs
    from engine.core.draft_setup import draft_setup
    from workers.model_config import ModelConfig

    smol = smollm2_path()  # skips when the package is absent, before "smollm2" is resolved below
    cfg = EngineArgs(target="smollm2", speculative_config='{"method": "layer_skip"}').to_engine_config()
    opts = draft_setup(cfg, ModelConfig.from_pretrained(cfg.target)).target_options
    assert opts["layer_skip_exit_layer"] == 10 and opts["layer_skip_adapter"].endswith("smollm2-exit")
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    prompts = ["The capital of France is", "def fibonacci(n):"]
    with LLM(smol, "none", max_num_seqs=2) as llm:
        expected = [o.token_ids for o in llm.generate(prompts, params)]
    spec = {"method": "layer_skip", "num_speculative_tokens": 4} | ({"tree_branching": branching} if branching else {})
    with LLM(smol, spec, max_num_seqs=2) as llm:
        assert [o.token_ids for o in llm.generate(prompts, params)] == expected
        assert llm.engine.stats.num_accepted > 0
