"""Cost of compressed state under speculation (DeepSeek-V4): scratch memory and state time per round.

For one sequence with ``--context`` committed tokens and a candidate tree (``--branching``), it reports
- scratch bytes per round (the rows each tree node writes: ring row, accumulator rows, completed summaries)
  against copying the whole state once per branch (leaf), the naive way to give each branch its own state;
- the time of building the tree plan and of committing the accepted path, against the verify forward.
Then, with ``--engine``, output tokens/s of the engine with no speculation, a chain and a tree, at batch 1 and 8.

The model is a random V4 of the given size (transformers' ``DeepseekV4Config``) or ``--target`` (a checkpoint
directory, or ``v4``: the built-in trained V4). Engine numbers: with ``--target``, that target with ``--draft``
(default: the built-in draft) on the built-in held-out prompts; without, the tests' tiny V4 pair (a
mostly-bigram V4 and a bigram Llama draft).

    python -m benchmarks.v4_state --context 2048 --branching 2 2 1 --engine
    python -m benchmarks.v4_state --target v4 --context 256 480 --engine --max-tokens 64
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from typing import Any

import torch

from engine.core.config import DEFAULT_MODELS_DIR, builtin_target_name, default_model_dirs
from workers import compressed_state as cs
from workers.models.deepseek_v4 import DeepseekV4ForCausalLM, load_deepseek_v4
from workers.models.deepseek_v4_config import DeepseekV4ModelConfig


def random_v4(hidden: int, layers: int, window: int, hca: int, seed: int = 0) -> DeepseekV4ForCausalLM:
    from transformers import DeepseekV4Config
    from transformers import DeepseekV4ForCausalLM as HFModel

    kinds = ["compressed_sparse_attention", "heavily_compressed_attention", "sliding_attention"]
    hf_cfg = DeepseekV4Config(
        vocab_size=1024, hidden_size=hidden, moe_intermediate_size=hidden, num_hidden_layers=layers,
        num_attention_heads=8, head_dim=64, q_lora_rank=hidden // 2, partial_rotary_factor=0.25,
        num_experts_per_tok=2, n_routed_experts=8, sliding_window=window, o_groups=2, o_lora_rank=hidden // 4,
        index_n_heads=4, index_head_dim=32, index_topk=64, hc_mult=4,
        layer_types=[kinds[i % 3] for i in range(layers)],
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": hca})
    torch.manual_seed(seed)
    hf = HFModel(hf_cfg).eval()
    model = DeepseekV4ForCausalLM(DeepseekV4ModelConfig.from_hf(hf_cfg))
    model.load_weights(hf.state_dict().items())
    return model.eval()


def tree_parents(branching: list[int]) -> list[int]:
    """Root (the in-flight token) then a full tree with ``branching`` children per depth."""
    parents, level = [-1], [0]
    for b in branching:
        nxt = []
        for p in level:
            for _ in range(b):
                parents.append(p)
                nxt.append(len(parents) - 1)
        level = nxt
    return parents


def state_costs(model: DeepseekV4ForCausalLM, context: int, branching: list[int], repeats: int) -> dict[str, Any]:
    cfg = model.config
    gen = torch.Generator().manual_seed(0)
    state = cs.SeqState.empty(cfg)
    chunk = 256
    toks = torch.randint(2, cfg.vocab_size, (context,), generator=gen).tolist()
    for i in range(0, context, chunk):  # prefill in chunks
        piece = toks[i:i + chunk]
        plan = cs.make_plan(cfg, state.position, list(range(-1, len(piece) - 1)))
        _, scratch = model.run([(state, plan, piece)])
        cs.commit(state, plan, scratch[0], list(range(len(piece))))
    parents = tree_parents(branching)
    tokens = torch.randint(2, cfg.vocab_size, (len(parents),), generator=gen).tolist()
    leaves = [i for i in range(len(parents)) if i not in parents]
    path = [leaves[0]]
    while parents[path[0]] >= 0:
        path.insert(0, parents[path[0]])
    t_plan = t_fwd = t_commit = 0.0
    scratch_bytes = 0
    for _ in range(repeats):
        committed = state.clone()
        t0 = time.perf_counter()
        plan = cs.make_plan(cfg, committed.position, parents)
        t1 = time.perf_counter()
        _, scratch = model.run([(committed, plan, tokens)])
        t2 = time.perf_counter()
        cs.commit(committed, plan, scratch[0], path)
        t3 = time.perf_counter()
        t_plan, t_fwd, t_commit = t_plan + t1 - t0, t_fwd + t2 - t1, t_commit + t3 - t2
        scratch_bytes = cs.scratch_nbytes(scratch[0])
    whole = state.nbytes()
    return {
        "context": context, "tree_nodes": len(parents), "branches": len(leaves), "accepted_path": len(path),
        "scratch_bytes_per_round": scratch_bytes, "whole_state_bytes": whole,
        "copy_per_branch_bytes": whole * len(leaves),
        "scratch_vs_copy_per_branch": round(scratch_bytes / (whole * len(leaves)), 4),
        "plan_ms": round(1e3 * t_plan / repeats, 3), "verify_forward_ms": round(1e3 * t_fwd / repeats, 3),
        "commit_ms": round(1e3 * t_commit / repeats, 3),
        "state_time_vs_forward": round((t_plan + t_commit) / t_fwd, 4),
    }


def builtin_prompts(n: int) -> list[str]:
    """The first ``n`` built-in held-out prompts (cycled), cut to 300 characters to leave room in a 512 context."""
    with open(DEFAULT_MODELS_DIR / "prompts.jsonl", encoding="utf-8") as f:
        texts = [json.loads(line)["prompt"][:300] for line in f if line.strip()]
    return [texts[i % len(texts)] for i in range(n)]


def engine_throughput(max_tokens: int, target: str | None = None, draft: str | None = None,
                      temperature: float = 0.0) -> list[dict[str, Any]]:
    from engine.llm import LLM
    from scheduler.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=0, ignore_eos=True)
    if target is None:
        from tests.helpers_v4 import make_bigram_draft, mostly_bigram_v4

        root = tempfile.mkdtemp()
        hf = mostly_bigram_v4(seed=3, vocab_size=128)
        hf.save_pretrained(f"{root}/target")
        target, draft = f"{root}/target", make_bigram_draft(f"{root}/draft", hf)
        prompt_sets: dict[int, list[Any]] = {
            b: [[1] + [(7 * i + 3 * c) % 120 + 3 for i in range(20)] for c in range(b)] for b in (1, 8)}
    else:
        draft = draft or default_model_dirs()[1]
        prompt_sets = {b: builtin_prompts(b) for b in (1, 8)}
    modes = {"no_spec": None,
             "chain4": {"method": "draft_model", "model": draft, "num_speculative_tokens": 4, "adaptive": False},
             "tree221": {"method": "draft_model", "model": draft, "num_speculative_tokens": 3,
                         "tree_branching": [2, 2, 1], "adaptive": False}}
    out = []
    for batch, prompts in prompt_sets.items():
        for name, sp in modes.items():
            llm = LLM(target, sp)
            llm.generate(prompts[:1], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))  # warm up
            t = time.perf_counter()
            outs = llm.generate(prompts, params)
            dt = time.perf_counter() - t
            n = sum(len(o.token_ids) for o in outs)
            mal = llm.engine.stats.mean_acceptance_length if sp else 1.0
            out.append({"batch": batch, "temperature": temperature, "mode": name, "tokens_per_s": round(n / dt, 1),
                        "mean_acceptance_length": round(mal, 2)})
            print(json.dumps(out[-1]), flush=True)
            llm.shutdown()
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", help="a V4 checkpoint directory or 'v4' (the built-in one); default: a random V4 "
                                     "of --hidden/--layers")
    ap.add_argument("--draft", help="draft for --engine with --target (default: the built-in draft)")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--window", type=int, default=128)
    ap.add_argument("--hca", type=int, default=128)
    ap.add_argument("--context", type=int, nargs="+", default=[512, 2048])
    ap.add_argument("--branching", type=int, nargs="+", default=[2, 2, 1])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--engine", action="store_true", help="also measure engine tokens/s on the tiny V4 pair")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.0, help="engine runs: sampling temperature")
    ap.add_argument("--skip-state", action="store_true", help="only the engine runs")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    if args.target and builtin_target_name(args.target):
        args.target = default_model_dirs(builtin_target_name(args.target))[0]
    model = (load_deepseek_v4(args.target, dtype=torch.float32) if args.target else
             random_v4(args.hidden, args.layers, args.window, args.hca))
    results: dict[str, Any] = {} if args.skip_state else {
        "state": [state_costs(model, c, args.branching, args.repeats) for c in args.context]}
    if args.engine:
        results["engine"] = engine_throughput(args.max_tokens, args.target, args.draft, args.temperature)
    text = json.dumps(results, indent=1)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
