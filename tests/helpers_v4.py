"""Tiny random DeepSeek-V4 checkpoints and the oracle the V4 tests compare against.

Oracle: transformers' own ``DeepseekV4ForCausalLM``, uncached (the whole sequence in one forward, every
compressed entry recomputed from scratch), with its indexer's top-k replaced by a stable sort (equal scores:
lower index first) -- the tie rule our engine uses on every path.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from training.stable_topk import stable_indexer_topk
from workers.compressed_state import SeqState, commit, make_plan
from workers.models.deepseek_v4 import DeepseekV4ForCausalLM
from workers.models.deepseek_v4_config import DeepseekV4ModelConfig

TINY = dict(vocab_size=48, hidden_size=32, moe_intermediate_size=16, num_hidden_layers=4, num_attention_heads=4,
            head_dim=16, q_lora_rank=24, partial_rotary_factor=0.5, num_experts_per_tok=2, n_routed_experts=6,
            n_shared_experts=1, sliding_window=3, o_groups=2, o_lora_rank=8, index_n_heads=2, index_head_dim=8,
            index_topk=2, hc_mult=2, hc_sinkhorn_iters=5, max_position_embeddings=4096,
            layer_types=["compressed_sparse_attention", "heavily_compressed_attention", "sliding_attention",
                         "compressed_sparse_attention"],
            compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
            mlp_layer_types=["hash_moe", "hash_moe", "moe", "moe"], bos_token_id=0, eos_token_id=1)


def tiny_hf_model(seed: int = 0, **overrides: Any) -> Any:
    """A random transformers V4 model whose every parameter is non-trivial (sinks, biases, gates too) and
    whose hash-routing tables give each token distinct experts, as real checkpoints do."""
    from transformers import DeepseekV4Config
    from transformers import DeepseekV4ForCausalLM as HFModel

    cfg = DeepseekV4Config(**{**TINY, **overrides})
    cfg.architectures = ["DeepseekV4ForCausalLM"]
    torch.manual_seed(seed)
    model = HFModel(cfg).eval()
    model.set_experts_implementation("eager")  # the reference loop (grouped_mm has no float64)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=gen))
            elif name.endswith(("position_bias", "sinks", "base", "hc_base")):
                p.copy_(0.7 * torch.randn(p.shape, generator=gen))
            elif name.endswith(("scale", "hc_scale")):
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=gen))
            elif name.endswith("embed_tokens.weight"):
                p.copy_(torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
        for name, b in model.named_buffers():
            if name.endswith("tid2eid"):
                e = cfg.n_routed_experts
                b.copy_(torch.stack([torch.randperm(e, generator=gen)[: b.shape[1]] for _ in range(b.shape[0])]))
            elif name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn(b.shape, generator=gen))
    return model


def ours_from_hf(hf_model: Any, dtype: torch.dtype | None = None) -> tuple[DeepseekV4ForCausalLM,
                                                                          DeepseekV4ModelConfig]:
    """Our model with the same weights (``dtype``: default the checkpoint's)."""
    cfg = DeepseekV4ModelConfig.from_hf(hf_model.config)
    if dtype is not None:
        cfg = replace(cfg, dtype=dtype)
    model = DeepseekV4ForCausalLM(cfg)
    sd = hf_model.state_dict()
    model.load_weights((k, v) for k, v in sd.items())
    return model.eval(), cfg


@torch.inference_mode()
def oracle_logits(hf_model: Any, tokens: list[int]) -> torch.Tensor:
    """[len(tokens), V]: transformers' uncached forward with the stable indexer top-k."""
    with stable_indexer_topk():
        out = hf_model(torch.tensor([tokens]), use_cache=False)
    return out.logits[0].float()


def chain(n: int) -> list[int]:
    return [-1] + list(range(n - 1))


def feed(model: DeepseekV4ForCausalLM, cfg: DeepseekV4ModelConfig, state: SeqState, tokens: list[int],
         chunk: int) -> torch.Tensor:
    """Feed tokens as chains of ``chunk`` (1: serial decode), committing each; logits of every token [n, V]."""
    out = []
    for i in range(0, len(tokens), chunk):
        piece = tokens[i:i + chunk]
        plan = make_plan(cfg, state.position, chain(len(piece)))
        logits, scratch = model.run([(state, plan, piece)])
        commit(state, plan, scratch[0], list(range(len(piece))))
        out.append(logits)
    return torch.cat(out)


def random_tree(gen: torch.Generator, num_nodes: int, max_children: int = 3) -> list[int]:
    """Parents of a random tree rooted at node 0 (parent -1); each node has at most ``max_children``."""
    parents, children = [-1], [0]
    for i in range(1, num_nodes):
        open_nodes = [j for j in range(i) if children[j] < max_children]
        p = open_nodes[int(torch.randint(len(open_nodes), (1,), generator=gen))]
        parents.append(p)
        children[p] += 1
        children.append(0)
    return parents


def path_to(parents: list[int], node: int) -> list[int]:
    path = []
    while node >= 0:
        path.append(node)
        node = parents[node]
    return path[::-1]


def state_diffs(a: SeqState, b: SeqState) -> dict[str, float]:
    """Largest absolute difference per named state tensor (inf where shapes or counts differ)."""
    out: dict[str, float] = {"position": 0.0 if a.position == b.position else float("inf")}

    def diff(name: str, x: torch.Tensor, y: torch.Tensor) -> None:
        out[name] = float((x.float() - y.float()).abs().max()) if x.shape == y.shape and x.numel() else \
            (0.0 if x.shape == y.shape else float("inf"))

    for i, (la, lb) in enumerate(zip(a.layers, b.layers, strict=True)):
        diff(f"layer{i}.ring", la.ring, lb.ring)
        for part in ("comp", "index"):
            ca, cb = getattr(la, part), getattr(lb, part)
            if ca is None:
                continue
            diff(f"layer{i}.{part}.acc_kv", ca.acc_kv, cb.acc_kv)
            diff(f"layer{i}.{part}.acc_gate", ca.acc_gate, cb.acc_gate)
            diff(f"layer{i}.{part}.summaries", ca.summaries.rows(), cb.summaries.rows())
    return out


def assert_states_close(a: SeqState, b: SeqState, atol: float = 1e-6) -> None:
    bad = {k: v for k, v in state_diffs(a, b).items() if not v <= atol}
    assert not bad, f"committed state differs from serial decoding: {bad}"


def mostly_bigram_v4(seed: int, scale: float = 0.3, **overrides: Any) -> Any:
    """A tiny V4 whose attention and MLP outputs are scaled down by ``scale``: its next token follows the last
    token about half the time, so a bigram draft gets partial acceptance (paths of every length)."""
    hf = tiny_hf_model(seed, **overrides)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith(("o_b_proj.weight", "experts.down_proj", "shared_experts.down_proj.weight")):
                p.mul_(scale)
    return hf


@torch.inference_mode()
def make_bigram_draft(path: str, hf_target: Any, seed: int = 0) -> str:
    """A 1-layer Llama draft (same vocabulary) that proposes b(x) after token x, where b(x) is the target's
    argmax after the one-token context [x]: attention and MLP outputs are zero, and the head maps each token's
    (random, nearly orthogonal) embedding to its b(x)."""
    from safetensors.torch import load_file, save_file

    from tests.helpers_models import make_tiny_checkpoint

    vocab = hf_target.config.vocab_size
    make_tiny_checkpoint(path, family="llama", vocab_size=vocab, num_hidden_layers=1, seed=seed, hidden_size=128,
                         intermediate_size=64)
    file = f"{path}/model.safetensors"
    w = load_file(file)
    with stable_indexer_topk():  # every one-token context at once: [vocab, 1]
        b = hf_target(torch.arange(vocab).unsqueeze(1), use_cache=False).logits[:, -1].argmax(-1).tolist()
    gen = torch.Generator().manual_seed(seed)
    emb = torch.randn(vocab, 128, generator=gen)
    head = torch.zeros(vocab, 128)
    for x, y in enumerate(b):
        head[y] += emb[x] / emb[x].norm()
    w["model.embed_tokens.weight"] = emb
    w["lm_head.weight"] = 4 * head
    for k in w:
        if k.endswith(("o_proj.weight", "down_proj.weight")):
            w[k] = torch.zeros_like(w[k])
        elif "norm" in k:
            w[k] = torch.ones_like(w[k])
    save_file(w, file, metadata={"format": "pt"})
    return path


def oracle_greedy(hf_model: Any, prompt: list[int], n: int) -> list[int]:
    """n greedy tokens, each from a fresh uncached oracle forward over the whole sequence."""
    seq = list(prompt)
    for _ in range(n):
        seq.append(int(oracle_logits(hf_model, seq)[-1].argmax()))
    return seq[len(prompt):]
