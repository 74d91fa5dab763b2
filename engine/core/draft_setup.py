"""What the draft worker loads, from the speculative config: a draft model, an EAGLE head, or nothing.

Three shapes of ``speculative_config`` start a draft worker differently (docs/architecture.md):
- a draft model (``draft_model``): its own checkpoint, checked against the target's tokenizer and vocabulary;
- an EAGLE head (``eagle3`` / ``eagle``): the head directory plus the target it reads its embedding from;
- draftless (``ngram`` / ``suffix``): no worker, unless a ``fallback`` draft model drafts where they find no match;
- self-speculation (``layer_skip``): no worker; the target drafts itself (``target_options``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.core.compat import check_draft_compatible
from engine.core.config import EngineConfig, SpeculativeConfig
from engine.drafting.eagle import draft_model_config, eagle_worker_config, head_max_len
from engine.drafting.layer_skip import resolve_exit
from engine.drafting.layer_skip_config import LAYER_SKIP
from workers.model_config import ModelConfig
from workers.worker_config import WorkerConfig


@dataclass(frozen=True)
class DraftSetup:
    spec: SpeculativeConfig | None  # the config of what the draft worker runs (None: no draft worker)
    model_config: ModelConfig | None  # a draft model's (None for an EAGLE head or no worker)
    eagle: bool  # the worker runs an EAGLE head fed the target's hidden states
    # WorkerConfig fields of the target itself: method layer_skip's exit layer and adapter (the target drafts)
    target_options: dict = field(default_factory=dict)

    def worker_config(self, config: EngineConfig, target_config: ModelConfig, num_blocks: int) -> WorkerConfig | None:
        if self.eagle:
            return eagle_worker_config(config, target_config, num_blocks)
        if self.spec is None:
            return None
        d = self.spec
        return WorkerConfig(d.model, num_blocks, config.cache.block_size, config.dtype, config.device,
                            quantization=d.quantization, tree_sampling=d.tree_sampling,
                            target_vocab_size=target_config.vocab_size, model_config=self.model_config.to_dict(),
                            tokenizer=str(config.tokenizer or config.target))

    def max_len(self, max_model_len: int) -> int:
        """Where drafting stops for a sequence. Past its own context a draft still runs (RoPE is computed per
        position) but proposes poorly; like vLLM, stop drafting there instead of paying for rejected candidates.
        Draftless methods draft up to the target's context."""
        if self.model_config is not None:
            return self.model_config.max_model_len
        return head_max_len(self.spec) if self.eagle else max_model_len


def draft_setup(config: EngineConfig, target_config: ModelConfig) -> DraftSetup:
    """The draft side of ``config``, checked against the target before any worker starts."""
    spec = config.speculative
    if spec is None:
        return DraftSetup(None, None, False)
    if spec.method == LAYER_SKIP:  # no draft worker: the target drafts with its own early layers
        layer, adapter = resolve_exit(spec, config.target, target_config)
        return DraftSetup(None, None, False, {"layer_skip_exit_layer": layer, "layer_skip_adapter": adapter,
                                                   "tree_sampling": spec.tree_sampling})
    dspec = spec.draft_spec  # this config, a draftless method's fallback, or None
    if dspec is None:
        return DraftSetup(None, None, False)
    if dspec.is_eagle:
        draft_model_config(dspec, config.target, target_config)  # checks the head against the target
        return DraftSetup(dspec, None, True)
    dcfg = ModelConfig.from_pretrained(dspec.model)
    check_draft_compatible(config.target, dspec.model, target_config, dcfg)
    return DraftSetup(dspec, dcfg, False)
