"""The ``Drafter`` of self-speculation (method ``layer_skip``): the target's worker drafts each round's tree.

Also the choice of exit for a target (``resolve_exit``: the keys' L and adapter, or a packaged target's shipped
adapter). One self-draft call before each verify call (an ordinary target call, to every rank), ints both ways;
the laws stay in the target's own law store and the early layers' KV and hidden states in its cache and pad (the
design note: workers/layer_skip/__init__.py). The keys' checks: engine/drafting/layer_skip_config.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from engine.core.config import DEFAULT_MODELS_DIR
from engine.core.metrics import StepTimes
from engine.drafting.drafter import NO_TREE, sampling_spec
from scheduler.scheduler import ScheduledBatch
from workers.layer_skip.exit import ExitAdapterConfig, check_adapter, target_name
from workers.layer_skip.messages import SelfDraftSeq, SelfDraftStep
from workers.messages import DraftTree, TargetStepOutput
from workers.model_config import ModelConfig

# The exit adapter shipped for a packaged target (engine/default_models/<dir>), keyed by target_name(): what
# ``{"method": "layer_skip"}`` without ``exit_layer`` or ``model`` uses, at the adapter's own L.
SHIPPED_EXITS = {"target": "target-exit", "SmolLM2-135M-Instruct.Q4_1.gguf": "smollm2-exit"}


def shipped_exit(target: str) -> str | None:
    sub = SHIPPED_EXITS.get(target_name(target))
    path = DEFAULT_MODELS_DIR / sub if sub else None
    return str(path) if path is not None and (path / "config.json").is_file() else None


def resolve_exit(spec: Any, target: str, tcfg: ModelConfig) -> tuple[int, str | None]:
    """(L, the exit adapter's directory or None for the target's own norm and head), checked against the target."""
    adapter = spec.model
    if adapter is None and spec.exit_layer is None:
        adapter = shipped_exit(target)
        if adapter is None:
            raise ValueError(f"method 'layer_skip': no exit adapter is shipped for target {target_name(target)!r}: "
                             "pass exit_layer (the target's own norm and head exit there) or model (an exit adapter "
                             "directory, python -m training.exit_adapter)")
    L = spec.exit_layer
    if adapter is not None:
        c = ExitAdapterConfig.from_pretrained(adapter)
        check_adapter(c, adapter, target, tcfg.hidden_size, tcfg.num_layers)
        if L is not None and L != c.exit_layer:
            raise ValueError(f"speculative_config.exit_layer {L}: the exit adapter {adapter!r} was trained on "
                             f"layer {c.exit_layer}")
        L = c.exit_layer
    if not 1 <= L <= tcfg.num_layers - 1:
        raise ValueError(f"speculative_config.exit_layer must be in 1 .. {tcfg.num_layers - 1} (the target has "
                         f"{tcfg.num_layers} layers), got {L}")
    return L, adapter


@dataclass
class LayerSkipDrafter:
    """The ``Drafter`` of method layer_skip: the target's worker drafts each scheduled round's tree (the policy's
    shape: a chain, or ``tree_branching``)."""

    executor: Any  # engine.execution.executor.Executor: its target calls carry the self-draft call too
    times: StepTimes
    tables: Any  # the target's block tables (the scheduler's; read only): drafting writes their scratch slots
    calls: Any = None  # engine.drafting.drafter.DraftCalls: its ``forward_s`` feeds the adaptive policy's costs
    _out: list[DraftTree] = field(default_factory=list)

    def propose(self, batch: ScheduledBatch, gone: list[int]) -> list[DraftTree]:
        msg = SelfDraftStep([SelfDraftSeq(r.seq_id, self.tables[r.seq_id], r.num_cached_target,
                                          r.all_token_ids[r.num_cached_target:], sampling_spec(r), len(shape),
                                          list(shape))
                             for r, shape in zip(batch.rounds, batch.shapes, strict=True) if shape])
        if not msg.seqs:
            return [NO_TREE] * len(batch.rounds)
        self.executor.submit_target(msg)  # to every target rank, like a verify call
        out = self.executor.wait_target()
        self.times.draft_s += out.elapsed_s
        if self.calls is not None:
            self.calls.forward_s = list(out.forward_s)
        trees = {s.seq_id: t for s, t in zip(msg.seqs, out.trees, strict=True)}
        return [trees.get(r.seq_id, NO_TREE) for r in batch.rounds]

    def overlap(self, batch: ScheduledBatch, trees: list[DraftTree]) -> None:
        pass

    def commit(self, batch: ScheduledBatch, trees: list[DraftTree], out: TargetStepOutput) -> dict[int, int]:
        """No draft KV of its own: the accepted rows' KV is the target's, committed by the verify. The draft's
        committed length is therefore the target's (what the adaptive policy reads as the tokens the next round's
        first pass carries: the in-flight ones)."""
        return {r.seq_id: r.num_tokens + len(res.accepted_nodes)
                for r, res in zip(batch.rounds, out.results, strict=True)}
