"""EAGLE drafting as the engine sets it up: which head, where it runs, what the target must capture.

The head runs on the draft worker (workers/eagle/draft_worker.py), behind the same ``Drafter`` as a draft model
(engine/drafting/drafter.py): trees go to the target as ints, their laws over the law channel. What is new
crosses the other way: the verify pass hands the head the hidden states of the rows it committed
(workers/eagle/features.py), target rank 0 to the draft directly, never through the controller.

In-process the target puts them into the head's ``FeatureStore``; on Ray target rank 0 pushes them to draft rank
0 on a socket of their own (engine/execution/worker_actor.py ``connect_features`` / ``serve_features``).

``draft_model_config`` is where the engine tells the two drafts apart at start-up: a draft model's config is read
and checked against the target; an EAGLE head's setup is checked instead.
"""

from __future__ import annotations

import os

from engine.core.compat import check_draft_compatible
from engine.core.config import DEFAULT_MODELS_DIR, EngineConfig, SpeculativeConfig
from engine.drafting.eagle_keys import dynamic_topk
from workers.eagle.head_config import EagleHeadConfig
from workers.model_config import ModelConfig
from workers.worker_config import WorkerConfig

# The head shipped for a packaged target (engine/default_models/<dir>, training/eagle.py built it): what
# ``"method": "eagle3"`` without ``model`` uses there. Keyed by the target's short name ("builtin": the default).
SHIPPED_HEADS = {"builtin": "target-eagle3", "smollm2": "smollm2-eagle3"}


def shipped_head(target_name: str) -> str:
    """The shipped head directory of a packaged target; ValueError naming what to pass when there is none."""
    sub = SHIPPED_HEADS.get(target_name)
    path = DEFAULT_MODELS_DIR / sub if sub else None
    if path is None or not (path / "config.json").is_file():
        raise ValueError(f"no EAGLE head is shipped for target {target_name!r}: pass one with "
                         "speculative_config.model (a head directory in vLLM's EAGLE-3 layout), or train one with "
                         "python -m training.eagle")
    return str(path)


def check_eagle_setup(spec: SpeculativeConfig | None, target_config: ModelConfig) -> bool:
    """Whether ``spec`` drafts with an EAGLE head; refuses what this version cannot run, before any worker is built."""
    if spec is None or not spec.is_eagle:
        return False
    if target_config.architecture not in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM",
                                          "Qwen3ForCausalLM"):
        raise ValueError(f"EAGLE heads need a Llama-style target, got {target_config.architecture}")
    head = EagleHeadConfig.from_pretrained(spec.model)
    if head.vocab_size != target_config.vocab_size or head.target_hidden_size != target_config.hidden_size:
        raise ValueError(f"speculative_config.model {spec.model!r}: a head for a target of vocab {head.vocab_size} "
                         f"and hidden size {head.target_hidden_size}; this target has {target_config.vocab_size} "
                         f"and {target_config.hidden_size}")
    return True


def draft_model_config(spec: SpeculativeConfig | None, target: str, target_config: ModelConfig
                       ) -> ModelConfig | None:
    """A draft model's config, checked against the target; None without speculation or for an EAGLE head (whose
    setup is checked here instead)."""
    if spec is None or check_eagle_setup(spec, target_config):
        return None
    dcfg = ModelConfig.from_pretrained(spec.model)
    check_draft_compatible(target, spec.model, target_config, dcfg)
    return dcfg


def eagle_worker_config(config: EngineConfig, target_config: ModelConfig, num_blocks: int) -> WorkerConfig:
    """The draft worker's config for a head: the head directory, plus the target it reads its embedding from."""
    spec = config.speculative
    return WorkerConfig(os.fspath(spec.model), num_blocks, config.cache.block_size, config.dtype, config.device,
                        quantization=spec.quantization, tree_sampling=spec.tree_sampling,
                        target_vocab_size=target_config.vocab_size,
                        eagle_target=config.target, eagle_target_config=target_config.to_dict(),
                        eagle_topk=dynamic_topk(spec))


def aux_layers_of(config: WorkerConfig) -> tuple[int, ...]:
    """The target layers an EAGLE draft worker's head reads (what target rank 0 must capture)."""
    head = EagleHeadConfig.from_pretrained(config.model)
    return head.aux_layers(ModelConfig.from_dict(config.eagle_target_config).num_layers)


def head_max_len(spec: SpeculativeConfig) -> int:
    """Where the head stops drafting for a sequence (its trained context, like a draft model's)."""
    return EagleHeadConfig.from_pretrained(spec.model).max_model_len
