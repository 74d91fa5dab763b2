"""The built-in trained DeepSeek-V4 target (engine/default_models/v4-target) and the stage that trains it.

- the shipped checkpoint: the engine's greedy output equals the oracle's (transformers' uncached forward, stable
  indexer top-k) on code prompts, and speculation with the built-in Llama draft (chain, tree) equals no
  speculation with real, partial acceptance;
- ``--target v4`` resolves to it, with the built-in draft as the default draft;
- ``python -m training.train_v4 --quick`` writes a checkpoint our loader reads and whose logits equal transformers'.
"""

from __future__ import annotations

import pytest
import torch

from engine.core.args import EngineArgs
from engine.core.config import DEFAULT_MODELS_DIR
from engine.llm import LLM
from scheduler.sampling_params import SamplingParams
from tests.conftest import spec
from tests.helpers_v4 import oracle_greedy, oracle_logits

V4_DIR = DEFAULT_MODELS_DIR / "v4-target"
DRAFT_DIR = DEFAULT_MODELS_DIR / "draft"
MAX_TOKENS = 24
PROMPTS = ["def parse_args(argv):\n    ", "import os\nimport sys\n\nclass Config:\n"]
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
shipped = pytest.mark.skipif(not (V4_DIR / "config.json").is_file(), reason="built-in V4 target not installed")


def _hf(path: str):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()  # fp16 weights, fp32 compute
    hf.set_experts_implementation("eager")
    return hf


@pytest.fixture(scope="module")
def v4_prompts():
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(V4_DIR))
    return [tok.encode(p) for p in PROMPTS]


@shipped
def test_shipped_v4_greedy_equals_oracle_and_speculation_equals_no_speculation(v4_prompts) -> None:
    hf = _hf(str(V4_DIR))
    expected = [oracle_greedy(hf, p, MAX_TOKENS) for p in v4_prompts]
    got = [o.token_ids for o in LLM(str(V4_DIR), None).generate(v4_prompts, GREEDY)]
    assert got == expected
    for k, branching in ((4, None), (None, [2, 2, 1])):
        llm = LLM(str(V4_DIR), spec(str(DRAFT_DIR), k, branching))
        assert [o.token_ids for o in llm.generate(v4_prompts, GREEDY)] == expected
        mal = llm.engine.stats.mean_acceptance_length
        assert 1.2 < mal < (k or len(branching)) + 1, mal  # real, partial acceptance on compressed state
        llm.shutdown()


@shipped
def test_shipped_v4_logits_equal_the_oracle_over_a_long_prompt() -> None:
    """Greedy output of an undertrained model can hide an error (it often repeats one token); the logits of a
    300-token code prompt, fed in uneven chunks (crossing every window kind many times), cannot."""
    from transformers import AutoTokenizer

    from tests.helpers_v4 import feed
    from workers.compressed_state import SeqState
    from workers.models.deepseek_v4 import load_deepseek_v4

    text = (DEFAULT_MODELS_DIR / "prompts.jsonl").read_text(encoding="utf-8")
    tokens = AutoTokenizer.from_pretrained(str(V4_DIR)).encode(text)[:300]
    ours = load_deepseek_v4(str(V4_DIR), dtype=torch.float32)
    got = feed(ours, ours.config, SeqState.empty(ours.config), tokens, chunk=7)  # [300, V]
    torch.testing.assert_close(got.float(), oracle_logits(_hf(str(V4_DIR)), tokens), atol=1e-3, rtol=1e-3)


@shipped
def test_shipped_v4_files() -> None:
    from safetensors import safe_open

    with safe_open(str(V4_DIR / "model.safetensors"), "pt") as f:
        params = sum(f.get_tensor(k).numel() for k in f.keys() if not k.endswith("tid2eid"))
    assert 2e6 <= params <= 5e6 and (V4_DIR / "model.safetensors").stat().st_size <= 10 * 2**20
    # The built-in draft's vocabulary, byte for byte: that is what lets it draft for this target.
    assert (V4_DIR / "tokenizer.json").read_bytes() == (DRAFT_DIR / "tokenizer.json").read_bytes()


@shipped
def test_v4_short_name_uses_the_built_in_draft() -> None:
    cfg = EngineArgs(target="v4").to_engine_config()
    assert cfg.target == str(V4_DIR) and cfg.speculative is not None
    assert cfg.speculative.model == str(DRAFT_DIR)
    assert EngineArgs(target="v4", speculative_config="none").to_engine_config().speculative is None


def test_quick_training_stage_writes_a_checkpoint_our_loader_reads(tmp_path) -> None:
    from training import train_v4
    from workers.models.deepseek_v4 import load_deepseek_v4

    out = tmp_path / "v4"
    log = train_v4.train(train_v4.parse_args(["--quick", "--out", str(out), "--work", str(tmp_path / "work")]))
    assert log["steps"] == 2 and (out / "tokenizer.json").is_file()
    hf = _hf(str(out))
    ours = load_deepseek_v4(str(out), dtype=torch.float32)
    assert ours.config.layer_kinds == ("sliding_attention", "compressed_sparse_attention",
                                       "heavily_compressed_attention", "compressed_sparse_attention")
    tokens = list(range(3, 40))  # crosses several sliding windows (8) and CSA / HCA windows (4 / 16)
    from tests.helpers_v4 import feed
    from workers.compressed_state import SeqState

    got = feed(ours, ours.config, SeqState.empty(ours.config), tokens, chunk=5)
    torch.testing.assert_close(got.float(), oracle_logits(hf, tokens), atol=2e-4, rtol=1e-4)
