"""quantization "q8_0": a float checkpoint's matrices held as Q8_0 blocks (workers/q8_weights.py), for drafts,
EAGLE heads and targets. The blocks are ggml's, the draft stays close to its float self, speculation with it
stays lossless (greedy equal, the sampled law the target's; a wrong recorded q is still caught), and what cannot
take it is refused naming the key."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.core.args import EngineArgs
from tests.helpers_gguf import hf_to_gguf, smollm2_path
from tests.helpers_law import record_flatter_q
from tests.helpers_models import make_tiny_checkpoint
from tests.test_engine_sampling import ALPHA, exact_joint, pair_pvalues, sample_engine, target_logits  # noqa: F401
from training.eagle_layout import random_head
from workers.kernels import gguf_blocks
from workers.layers import ColumnParallelLinear, RowParallelLinear
from workers.loader import load_model
from workers.model_config import ModelConfig
from workers.q8_weights import q8_0_blocks
from workers.quantized_head import BlockHead

pytestmark = pytest.mark.skipif(not gguf_blocks.available(),
                                reason="the native block kernel did not build here (the engine keeps float)")

Q8_0 = gguf_blocks.QTYPES["Q8_0"]
PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16, 17, 18], [20]]


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> tuple[str, str, str]:
    """A tiny target, a smaller draft, and an EAGLE head for the target."""
    root = tmp_path_factory.mktemp("q8")
    target = make_tiny_checkpoint(root / "target", vocab_size=128, seed=1)
    draft = make_tiny_checkpoint(root / "draft", vocab_size=128, seed=2, num_hidden_layers=1)
    head = random_head(root / "head", ModelConfig.from_pretrained(target), seed=5)
    return target, draft, head


def test_blocks_are_ggml_q8_0_within_half_a_step() -> None:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(40, 96, generator=g) * torch.logspace(-3, 1, 40).unsqueeze(1)  # [N, K], scales far apart
    w[3, 32:64] = 0  # an all-zero block: d = 0, no NaN
    blocks = q8_0_blocks(w)  # [N, K / 32 * 34]
    assert blocks.shape == (40, 3 * 34) and blocks.dtype == torch.uint8
    back = gguf_blocks.dequantize_reference(blocks, Q8_0)  # [N, K]
    d = blocks.reshape(40, 3, 34)[..., :2].contiguous().view(torch.float16).float()  # [N, G, 1]
    err = (back - w).abs().reshape(40, 3, 32)
    assert torch.all(err <= d * 0.5 + 1e-3 * w.abs().reshape(40, 3, 32).amax(-1, keepdim=True))
    assert torch.all(back[3, 32:64] == 0)
    exact = torch.randint(-127, 128, (8, 64), generator=g).float() * 2.0 ** -6
    exact[:, 0], exact[:, 32] = 127 * 2.0 ** -6, -127 * 2.0 ** -6  # each block's max |q| is 127: d = 2^-6
    assert torch.equal(gguf_blocks.dequantize_reference(q8_0_blocks(exact), Q8_0), exact)
    with pytest.raises(ValueError, match="32-weight blocks"):
        q8_0_blocks(torch.zeros(4, 40))


def test_a_loaded_model_holds_its_matrices_as_blocks(pair) -> None:
    target, _, _ = pair
    model = load_model(target, quantization="q8_0")
    linears = [m for m in model.modules() if isinstance(m, (ColumnParallelLinear, RowParallelLinear))]
    assert linears and all(m.weight is None and m.quant is not None for m in linears)
    assert isinstance(model.lm_head, BlockHead)
    assert model.model.glue is not None  # its layers run as the 4-bit target's do
    float_model = load_model(target)
    assert all(m.weight is not None for m in float_model.modules() if isinstance(m, ColumnParallelLinear))


def test_a_q8_copy_of_the_target_drafts_what_the_target_decodes(pair) -> None:
    """Its own weights at 8 bits as the draft: nearly every greedy proposal is accepted (a broken quantizer,
    e.g. scales off by a factor, would accept almost none)."""
    target, _, _ = pair
    llm = LLM(target, {"model": target, "num_speculative_tokens": 3, "adaptive": False, "quantization": "q8_0"})
    llm.generate(PROMPTS, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
    stats = llm.engine.stats
    assert stats.num_accepted >= 0.85 * stats.num_drafted, stats.as_dict()


SPECS = {
    "draft-chain": lambda d, h: {"model": d, "num_speculative_tokens": 3},
    "draft-tree": lambda d, h: {"model": d, "tree_branching": [2, 2, 1]},
    "eagle-chain": lambda d, h: {"method": "eagle3", "model": h, "num_speculative_tokens": 3},
    "eagle-dynamic-tree": lambda d, h: {"method": "eagle3", "model": h, "num_speculative_tokens": 3,
                                        "num_draft_tokens": 6},
}


@pytest.mark.parametrize("name", sorted(SPECS))
def test_greedy_with_a_q8_draft_equals_no_speculation(pair, name: str) -> None:
    target, draft, head = pair
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    plain = [o.token_ids for o in LLM(target, None).generate(PROMPTS, params)]
    spec = {**SPECS[name](draft, head), "adaptive": False, "quantization": "q8_0"}
    llm = LLM(target, spec, max_num_seqs=4)
    assert [o.token_ids for o in llm.generate(PROMPTS, params)] == plain
    assert llm.engine.stats.num_drafted > 0


def test_a_q8_target_speculates_its_own_output(pair) -> None:
    """A target held as Q8_0 is another model; with speculation it still gives that model's greedy output."""
    target, draft, _ = pair
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    plain = [o.token_ids for o in LLM(target, None, quantization="q8_0").generate(PROMPTS, params)]
    spec = {"model": draft, "num_speculative_tokens": 3, "adaptive": False}
    assert [o.token_ids for o in LLM(target, spec, quantization="q8_0").generate(PROMPTS, params)] == plain


@pytest.fixture(scope="module")
def small_head(small_vocab, tmp_path_factory) -> str:
    target, _ = small_vocab
    return random_head(tmp_path_factory.mktemp("q8-law") / "head", ModelConfig.from_pretrained(target), seed=11)


@pytest.mark.parametrize("kind", ["draft", "eagle"])
def test_a_q8_draft_keeps_the_target_law(small_vocab, target_logits, small_head, kind: str) -> None:  # noqa: F811
    target, draft = small_vocab
    model = {"model": draft} if kind == "draft" else {"method": "eagle3", "model": small_head}
    spec = {**model, "num_speculative_tokens": 2, "adaptive": False, "quantization": "q8_0"}
    (tokens,), llm = sample_engine(target, spec, [(1.0, -1, 1.0)])
    stats = llm.engine.stats
    assert 0 < stats.num_accepted < stats.num_drafted, stats.as_dict()
    assert min(pair_pvalues(tokens, exact_joint(target_logits, 1.0, -1, 1.0)).values()) > ALPHA


def test_a_wrong_q8_draft_law_is_caught(small_vocab, target_logits, monkeypatch) -> None:  # noqa: F811
    """The q8 draft's children drawn from q, q^(1/2) recorded: the harness sees it on this path too."""
    target, draft = small_vocab
    record_flatter_q(monkeypatch)
    spec = {"model": draft, "num_speculative_tokens": 2, "adaptive": False, "quantization": "q8_0"}
    (tokens,), _ = sample_engine(target, spec, [(1.0, -1, 1.0)])
    assert min(pair_pvalues(tokens, exact_joint(target_logits, 1.0)).values()) < 1e-6


def test_what_cannot_take_q8_0_is_refused_naming_the_key(pair, tmp_path) -> None:
    target, draft, head = pair
    gguf = hf_to_gguf(draft, tmp_path / "draft.gguf")
    with pytest.raises(ValueError, match="q8_0.*GGUF"):
        LLM(target, {"model": gguf, "num_speculative_tokens": 2, "quantization": "q8_0"})
    with pytest.raises(ValueError, match="quantization: an EAGLE head"):
        LLM(target, {"method": "eagle3", "model": head, "quantization": "gguf"})
    with pytest.raises(ValueError, match=r"quantization must be one of \['gguf', 'none', 'q8_0'\]"):
        LLM(target, {"model": draft, "quantization": "int3"})


def test_a_packaged_target_drafts_with_its_shipped_draft_at_8_bits_on_a_cpu(pair) -> None:
    smollm2_path()  # the short name resolves its file at configuration: skips without the package
    _, draft, _ = pair
    assert EngineArgs(target="smollm2").to_engine_config().speculative.quantization == "q8_0"
    eagle = EngineArgs(target="smollm2", speculative_config={"method": "eagle3"}).to_engine_config().speculative
    assert eagle.quantization == "q8_0"
    own = EngineArgs(target="smollm2", speculative_config={"model": draft}).to_engine_config().speculative
    assert own.quantization is None  # a user's draft stays as given
    assert EngineArgs(target="smollm2", device="cuda").to_engine_config().speculative.quantization is None
