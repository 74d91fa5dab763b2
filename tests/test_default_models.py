"""The built-in default pair (engine/default_models): what ships, and what only trained weights can show.

Random tiny models agree with each other almost never, so the other tests cannot see a draft path that
proposes the wrong tokens (greedy output stays exact, only speed is lost). On the trained pair the draft's
greedy proposals are deterministic, so the engine's acceptance counts must equal, round for round, an exact
replay of greedy chain speculation done with transformers.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from engine.core.config import DEFAULT_MODELS_DIR, DEFAULT_NUM_SPECULATIVE_TOKENS
from engine.llm import LLM
from scheduler.sampling_params import SamplingParams

TARGET = DEFAULT_MODELS_DIR / "target"
DRAFT = DEFAULT_MODELS_DIR / "draft"
PROMPTS_FILE = DEFAULT_MODELS_DIR / "prompts.jsonl"
MAX_TOKENS = 24


def _params(model_dir: Path) -> int:
    from safetensors import safe_open

    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        return sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())


def _dtypes(model_dir: Path) -> set[torch.dtype]:
    from safetensors import safe_open

    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        return {f.get_tensor(k).dtype for k in f.keys()}


def test_shipped_files_sizes_and_formats() -> None:
    assert 10e6 <= _params(TARGET) <= 30e6
    assert 1e6 <= _params(DRAFT) <= 3e6
    assert _dtypes(TARGET) == {torch.float16} and _dtypes(DRAFT) == {torch.float16}
    # The built-in pair and V4; the SmolLM2 draft (a draft for a pip-installed target) has its own budget.
    smol = DEFAULT_MODELS_DIR / "smollm2-draft"
    heads = list(DEFAULT_MODELS_DIR.glob("*-eagle3"))  # EAGLE heads (training/eagle.py): <= 20 MB each
    shipped = sum(p.stat().st_size for p in DEFAULT_MODELS_DIR.rglob("*.safetensors")
                  if smol not in p.parents and p.parent not in heads)
    assert shipped <= 40 * 2**20
    assert all((h / "model.safetensors").stat().st_size <= 20 * 2**20 for h in heads)
    if (smol / "model.safetensors").is_file():
        assert (smol / "model.safetensors").stat().st_size <= 20 * 2**20 and _dtypes(smol) == {torch.float16}
    # Same tokenizer, byte for byte, in both self-contained dirs.
    assert (TARGET / "tokenizer.json").read_bytes() == (DRAFT / "tokenizer.json").read_bytes()
    records = [json.loads(line) for line in PROMPTS_FILE.read_text(encoding="utf-8").splitlines() if line.strip()]
    assert len(records) >= 32
    assert all(set(r) >= {"id", "prompt", "max_tokens"} and r["prompt"].lstrip().startswith("def ")
               for r in records)
    assert len({r["id"] for r in records}) == len(records)


def test_transformers_loads_the_pair_offline() -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(TARGET))
    code = "def f(x):\n\treturn x  # tabs and  spaces\n"
    assert tok.decode(tok(code)["input_ids"]) == code  # byte-level BPE round-trips source exactly
    for d in (TARGET, DRAFT):
        model = AutoModelForCausalLM.from_pretrained(str(d))
        assert model.config.vocab_size == len(tok)


def _replay_greedy_chain(prompt: list[int], output: list[int], k: int) -> list[int]:
    """Accepted length of every round the engine runs, replayed with transformers' draft.

    The first output token comes from prefill; each later round drafts min(K, tokens left - 1) greedy tokens
    from the committed context and accepts their longest prefix that equals the target's greedy output.
    """
    from transformers import AutoModelForCausalLM

    draft = AutoModelForCausalLM.from_pretrained(str(DRAFT), dtype=torch.float32).eval()
    accepted: list[int] = []
    t = 1
    while t < len(output):
        depth = min(k, len(output) - t - 1)
        if depth == 0:  # a plain decode round: nothing left to draft
            t += 1
            continue
        ctx = torch.tensor([prompt + output[:t]])  # [1, n]
        with torch.no_grad():
            proposal = draft.generate(ctx, max_new_tokens=depth, min_new_tokens=depth, do_sample=False,
                                      eos_token_id=None, pad_token_id=0)[0, ctx.size(1):].tolist()
        n = 0
        while n < depth and proposal[n] == output[t + n]:
            n += 1
        accepted.append(n)
        t += n + 1
    return accepted


@pytest.mark.parametrize("k", [DEFAULT_NUM_SPECULATIVE_TOKENS])
def test_engine_acceptance_equals_exact_replay_on_trained_pair(k: int) -> None:
    from transformers import AutoModelForCausalLM

    records = [json.loads(line) for line in PROMPTS_FILE.read_text(encoding="utf-8").splitlines()[:3]]
    # No model arguments: the built-in pair with speculation on, at the fixed depth the replay below assumes.
    with LLM(speculative_config={"adaptive": False}) as llm:
        assert llm.engine.config.speculative is not None
        assert llm.engine.config.speculative.num_speculative_tokens == k
        outs = llm.generate([r["prompt"] for r in records],
                            SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))
        stats = llm.engine.stats
        target = AutoModelForCausalLM.from_pretrained(str(TARGET), dtype=torch.float32).eval()
        expected: list[int] = []
        for out in outs:
            ids = torch.tensor([out.prompt_token_ids])  # [1, n]
            with torch.no_grad():
                ref = target.generate(ids, max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS, do_sample=False,
                                      eos_token_id=None, pad_token_id=0)[0, ids.size(1):].tolist()
            assert out.token_ids == ref  # the invariant, on trained weights
            expected += _replay_greedy_chain(out.prompt_token_ids, out.token_ids, k)
    assert stats.num_rounds == len(expected)
    assert stats.num_accepted == sum(expected)
    per_position = [sum(n > j for n in expected) for j in range(k)]
    assert stats.accepted_per_position == per_position[: len(stats.accepted_per_position)]
    # A trained pair: clearly better than a draft that never agrees (mean acceptance length 1).
    assert stats.mean_acceptance_length > 1.5


def test_distill_batches_mark_the_target_written_positions() -> None:
    """Position t predicts token t+1: the first target-written token is predicted at prompt_len - 1."""
    import numpy as np

    from training.distill import pad_batch

    seqs = [np.array([5, 6, 7, 8, 9]), np.array([1, 2, 3])]  # prompts [5, 6, 7] and [1]
    inputs, valid, is_new = pad_batch(seqs, [3, 1])
    assert inputs.tolist() == [[5, 6, 7, 8], [1, 2, 0, 0]]
    assert valid.tolist() == [[True] * 4, [True, True, False, False]]
    assert is_new.tolist() == [[False, False, True, True], [True, True, False, False]]
