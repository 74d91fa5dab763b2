"""Batch 1 on the built-in pair, a fresh engine (diagnostic): per request in turn, tokens per CPU-second, the depths
the policy chose, the regime's engine-wide rates and the request prior weight.

Environment: T (0.8), PASSES (2), K ("ad": adaptive with K_max 8; or a fixed depth), PRICES (1: the
policy's predicted tokens, seconds and rate of each uniform depth from the engine-wide rates, per request).
Usage (repository root):
    SPECSERVE_CACHE_DIR=$(mktemp -d) python engine/benchmarks/results/adaptive-2026-12-02g/b1diag.py
"""

import os
import time

import torch

from engine.benchmarks.compare import load_prompts
from engine.llm import LLM
from scheduler.sampling_params import SamplingParams
from workers.loader import load_tokenizer
from workers.model_config import ModelConfig

torch.set_num_threads(1)
T = float(os.environ.get("T", "0.8"))
PASSES = int(os.environ.get("PASSES", "2"))
K = os.environ.get("K", "ad")
TARGET, DRAFT = "engine/default_models/target", "engine/default_models/draft"
spec = {"method": "draft_model", "model": DRAFT, "num_speculative_tokens": 8 if K == "ad" else int(K),
        "adaptive": K == "ad"}
llm = LLM(TARGET, spec, max_num_seqs=1, num_kv_tokens=2048)
cfg = ModelConfig.from_pretrained(TARGET)
prompts = load_prompts(None, load_tokenizer(TARGET), cfg.vocab_size, 8, cfg.max_model_len - 140)
eng = llm.engine
pol = eng.scheduler.policy
for p in range(PASSES):
    total_s = total_n = 0.0
    for i, prompt in enumerate(prompts):
        eng.stats.__init__()
        t0 = time.process_time()
        out = llm.generate([prompt], [SamplingParams(max_tokens=128, temperature=T, ignore_eos=True)])[0]
        dt = time.process_time() - t0
        total_s += dt
        total_n += len(out.token_ids)
        s = eng.stats.as_dict()
        extra = ""
        if hasattr(pol, "acceptance"):
            rates = [round(x, 2) for x in pol.acceptance.engine_rates(T == 0, 8)]
            extra = f" engine rates {rates} prior weight {pol.acceptance.request_weight(T == 0):.1f}"
            if os.environ.get("PRICES"):  # what the policy predicts for each uniform depth from these rates
                from scheduler.adaptive import _Req

                pol._cost = None
                pol._pinned = []
                view = _Req(0, T == 0, 8, 1, 1.0, pol.acceptance.engine_rates(T == 0, 8))
                plans = [pol.price([view], [(1,) * d]) for d in range(9)]
                extra += " predicted " + " ".join(f"{d}:{pl.tokens:.2f}/{1000 * pl.seconds:.1f}ms={pl.rate:.0f}"
                                                  for d, pl in enumerate(plans))
        print(f"pass {p} req {i}: {len(out.token_ids) / dt:6.1f} tok/cpu-s acc.len {s['mean_acceptance_length']:.2f}"
              f" depths {s['chosen_depths']}{extra}", flush=True)
    print(f"pass {p}: {total_n / total_s:.1f} tok/cpu-s", flush=True)
llm.shutdown()
