"""DeepSeek-V4 with tensor parallelism over Gloo (2 ranks): query heads, output groups and experts split;
the K=V head, compressors and indexer replicated. Every rank's logits equal one rank's, through a chunked
prefill, a tree verified in one forward, the commit of a path, and a decode step."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.helpers_v4 import chain, feed, tiny_hf_model
from tests.test_tp_layers import free_port
from workers.compressed_state import SeqState, commit, make_plan
from workers.distributed import TPGroup
from workers.models.deepseek_v4 import DeepseekV4ForCausalLM, load_deepseek_v4

TREE = [-1, 0, 0, 1, 2, 3, 5, 6]  # depth 6 > window 3


def run_logits(model: DeepseekV4ForCausalLM) -> dict[str, torch.Tensor]:
    cfg = model.config
    state = SeqState.empty(cfg)
    out = {"prefill": feed(model, cfg, state, [(7 * i) % 120 + 3 for i in range(23)], 6)}
    plan = make_plan(cfg, state.position, TREE)
    out["tree"], scratch = model.run([(state, plan, [5, 9, 11, 40, 41, 77, 3, 8])])
    commit(state, plan, scratch[0], [0, 2, 4])
    plan = make_plan(cfg, state.position, chain(1))
    out["decode"], _ = model.run([(state, plan, [60])])
    return out


def _rank(rank: int, size: int, port: int, ckpt: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size)
    try:
        model = load_deepseek_v4(ckpt, tp=TPGroup.from_process_group())
        torch.save(run_logits(model), os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_tp2_logits_equal_single_rank(tmp_path) -> None:
    hf = tiny_hf_model(seed=2, vocab_size=128, n_routed_experts=6, num_attention_heads=4, o_groups=2)
    hf.save_pretrained(tmp_path / "ckpt")  # DeepSeek's names, one tensor per expert
    ckpt = str(tmp_path / "ckpt")
    expected = run_logits(load_deepseek_v4(ckpt))
    procs = mp.start_processes(_rank, args=(2, free_port(), ckpt, str(tmp_path)), nprocs=2, join=False,
                               start_method="fork")
    deadline = time.monotonic() + 120
    while not procs.join(timeout=1):
        if time.monotonic() > deadline:
            for p in procs.processes:
                p.kill()
            pytest.fail("tensor-parallel ranks did not finish within 120 s")
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        for key, ref in expected.items():
            torch.testing.assert_close(got[key], ref, atol=1e-5, rtol=0, msg=f"rank {rank}, {key}")


@pytest.mark.slow
def test_engine_tp2_over_ray_tree_speculation_equals_oracle(tmp_path) -> None:
    """The whole engine: V4 target on two Ray workers (TP over Gloo), the bigram Llama draft, a [2, 2, 1] tree."""
    import ray

    from engine.llm import LLM
    from scheduler.sampling_params import SamplingParams
    from tests.conftest import spec
    from tests.helpers_v4 import make_bigram_draft, mostly_bigram_v4, oracle_greedy

    hf = mostly_bigram_v4(seed=3, vocab_size=128)
    hf.save_pretrained(tmp_path / "target")
    draft = make_bigram_draft(str(tmp_path / "draft"), hf)
    prompts = [[1, 17, 44, 9, 83], [1] + list(range(20, 32))]
    expected = [oracle_greedy(hf, p, 16) for p in prompts]
    if ray.is_initialized():
        ray.shutdown()
    ray.init(address="local", num_cpus=16, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        llm = LLM(str(tmp_path / "target"), spec(draft, None, [2, 2, 1]), distributed_executor_backend="ray",
                  tensor_parallel_size=2)
        try:
            params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
            assert [o.token_ids for o in llm.generate(prompts, params)] == expected
            assert llm.engine.stats.mean_acceptance_length > 1.2
        finally:
            llm.shutdown()
    finally:
        ray.shutdown()
