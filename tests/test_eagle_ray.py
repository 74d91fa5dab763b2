"""EAGLE on Ray with a tensor-parallel target: target rank 0 pushes the committed rows' hidden states to the head
on the draft actor (engine/execution/worker_actor.py). Greedy output is transformers', and the head drafts exactly
what it drafts in-process (the same acceptance counts, the same seeded samples): the features arrive intact."""

from __future__ import annotations

import pytest

from engine.llm import LLM
from scheduler.sampling_params import SamplingParams
from tests.conftest import TP_MAX_TOKENS, TP_PROMPTS, TPModels, ray_leftovers
from training.eagle import EagleTrainConfig, train_head

pytestmark = pytest.mark.slow  # starts Ray and three worker processes

PARAMS = [SamplingParams(max_tokens=TP_MAX_TOKENS, temperature=0.0, ignore_eos=True)] * len(TP_PROMPTS) + [
    SamplingParams(max_tokens=TP_MAX_TOKENS, temperature=0.9, seed=50 + i, ignore_eos=True)
    for i in range(len(TP_PROMPTS))]


def uni_and_tp2(target: str, spec: dict) -> tuple[dict, list[dict]]:
    """The same greedy + seeded requests in-process and on a TP 2 target: per run (outputs, accepted, rounds), and
    the TP 2 run's workers (for the leftover check)."""
    runs, workers = {}, []
    for name, kw in (("uni", {"distributed_executor_backend": "uni"}), ("tp2", {"tensor_parallel_size": 2})):
        llm = LLM(target, spec, **kw)
        outs = [o.token_ids for o in llm.generate(TP_PROMPTS + TP_PROMPTS, PARAMS)]
        runs[name] = (outs, llm.engine.stats.num_accepted, llm.engine.stats.num_rounds)
        workers = llm.engine.executor.describe() if name == "tp2" else workers
        llm.shutdown()
    return runs, workers


@pytest.fixture(scope="module")
def ray_cluster():
    import ray

    if ray.is_initialized():
        ray.shutdown()
    ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False, configure_logging=False)
    yield
    ray.shutdown()


@pytest.mark.parametrize("keys", [{}, {"num_draft_tokens": 6, "eagle_topk": 2}], ids=["chain", "dynamic-tree"])
def test_tp2_eagle_equals_in_process(ray_cluster, tp_models: TPModels, tmp_path, keys: dict) -> None:
    seqs = [p + e for p, e in zip(TP_PROMPTS, tp_models.expected, strict=True)] * 4
    head = str(tmp_path / "head")
    train_head(tp_models.target, seqs, head, EagleTrainConfig(minutes=0.5, steps=80, batch=4, seq_len=12, lr=5e-3),
               log=lambda *_: None)
    spec = {"method": "eagle3", "model": head, "num_speculative_tokens": 3, "adaptive": False, **keys}
    runs, workers = uni_and_tp2(tp_models.target, spec)
    assert runs["tp2"][0][: len(TP_PROMPTS)] == tp_models.expected
    assert runs["tp2"] == runs["uni"] and runs["uni"][1] > 0  # same drafts: the features crossed intact
    assert not ray_leftovers(workers, check_ray=False)


def test_target_rank1_dies_eagle_output_is_unchanged(ray_cluster, tp_models: TPModels, tmp_path) -> None:
    """Worker recovery: target rank 1 killed mid-job; the target is rebuilt, every request recomputed, and the
    head gets the recomputed prefixes' features again: greedy and seeded outputs are those without the fault."""
    from tests.test_worker_faults import PARAMS as FAULT_PARAMS
    from tests.test_worker_faults import STEP_TIMEOUT_S, run_with_kills

    head = str(tmp_path / "head")
    seqs = [p + e for p, e in zip(TP_PROMPTS, tp_models.expected, strict=True)] * 4
    train_head(tp_models.target, seqs, head, EagleTrainConfig(minutes=0.5, steps=80, batch=4, seq_len=12, lr=5e-3),
               log=lambda *_: None)
    spec = {"method": "eagle3", "model": head, "num_speculative_tokens": 3, "adaptive": False}
    with LLM(tp_models.target, spec, distributed_executor_backend="uni") as llm:
        outs = [o.token_ids for o in llm.generate(TP_PROMPTS + TP_PROMPTS, FAULT_PARAMS)]
    reference = (outs[: len(TP_PROMPTS)], outs[len(TP_PROMPTS):])
    with LLM(tp_models.target, spec, tensor_parallel_size=2, step_timeout_s=STEP_TIMEOUT_S) as llm:
        outputs, _ = run_with_kills(llm, [(3, "target", 1)])
        assert llm.engine.recovery.stats.restarts == {"target": 1}
    assert outputs == reference


def test_draft_dies_eagle_output_is_unchanged(ray_cluster, tp_models: TPModels, tmp_path) -> None:
    """Worker recovery: the head's draft actor killed mid-job is replaced; its features died with it, so the
    target recomputes the running requests and resends them: greedy and seeded outputs are those without the
    fault (a draft model's guarantee, kept)."""
    from tests.test_worker_faults import PARAMS as FAULT_PARAMS
    from tests.test_worker_faults import STEP_TIMEOUT_S, run_with_kills

    head = str(tmp_path / "head")
    seqs = [p + e for p, e in zip(TP_PROMPTS, tp_models.expected, strict=True)] * 4
    train_head(tp_models.target, seqs, head, EagleTrainConfig(minutes=0.5, steps=80, batch=4, seq_len=12, lr=5e-3),
               log=lambda *_: None)
    spec = {"method": "eagle3", "model": head, "num_speculative_tokens": 3, "adaptive": False}
    with LLM(tp_models.target, spec, distributed_executor_backend="uni") as llm:
        outs = [o.token_ids for o in llm.generate(TP_PROMPTS + TP_PROMPTS, FAULT_PARAMS)]
    with LLM(tp_models.target, spec, tensor_parallel_size=2, step_timeout_s=STEP_TIMEOUT_S) as llm:
        outputs, _ = run_with_kills(llm, [(3, "draft", 0)])
        assert llm.engine.recovery.stats.restarts == {"draft": 1}
    assert outputs == (outs[: len(TP_PROMPTS)], outs[len(TP_PROMPTS):])
