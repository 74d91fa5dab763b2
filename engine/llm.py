"""The Python API: ``LLM(target, speculative_config=...).generate(prompts, params)``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from engine.config import CacheConfig, EngineConfig, ParallelConfig, SpeculativeConfig, default_model_dirs
from engine.llm_engine import LLMEngine, RequestOutput
from scheduler.sampling_params import SamplingParams
from scheduler.scheduler import SchedulerConfig


class LLM:
    """Offline batched generation.

    ``LLM()`` with no model uses the built-in default pair (engine/default_models) with chain speculation.
    ``speculative_config``: a dict or JSON string, vLLM-style: ``{"method": "draft_model", "model": DIR,
    "num_speculative_tokens": K}`` plus ``tree_branching`` / ``tree_sampling`` / ``max_tree_nodes``; None
    means no speculation (unless the default models are used).
    """

    def __init__(self, target: str | None = None, speculative_config: str | dict | SpeculativeConfig | None = None,
                 *, tokenizer: str | None = None, dtype: str | None = None, device: str = "cpu",
                 max_model_len: int | None = None, max_num_seqs: int = 64, max_num_batched_tokens: int = 2048,
                 block_size: int = 16, num_kv_tokens: int | None = None, tensor_parallel_size: int = 1,
                 address: str | None = None, distributed_executor_backend: str | None = None,
                 transport: str = "zmq", placement_timeout_s: float = 60.0, max_worker_restarts: int = 3) -> None:
        if target is None:
            target, draft = default_model_dirs()
            if speculative_config is None:
                speculative_config = {"method": "draft_model", "model": draft}
        self.engine = LLMEngine(EngineConfig(
            target=target, speculative=SpeculativeConfig.parse(speculative_config), tokenizer=tokenizer,
            dtype=dtype, device=device, max_model_len=max_model_len,
            scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                      block_size=block_size),
            cache=CacheConfig(block_size=block_size, num_kv_tokens=num_kv_tokens),
            parallel=ParallelConfig(tensor_parallel_size=tensor_parallel_size, address=address,
                                    backend=distributed_executor_backend, transport=transport,
                                    placement_timeout_s=placement_timeout_s,
                                    max_worker_restarts=max_worker_restarts)))

    def shutdown(self) -> None:
        """Release the workers (Ray actors and placement groups, sockets)."""
        self.engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    def generate(self, prompts: str | list[int] | Sequence[str | list[int]],
                 params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """Outputs in the order of ``prompts``. A single string or a single list of ints is one prompt."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if params is None:
            params = SamplingParams()
        plist = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError(f"params: {len(plist)} SamplingParams for {len(prompts)} prompts")
        queued = []
        try:
            for i, (p, sp) in enumerate(zip(prompts, plist, strict=True)):
                queued.append(self.engine.add_request(str(i), p, sp))
        except Exception:
            # All or nothing: requests left queued would run with the next call and collide with its ids.
            for req in queued:
                self.engine.withdraw_queued(req)
            raise
        return self.run(len(prompts), use_tqdm)

    def run(self, total: int, use_tqdm: bool = False) -> list[RequestOutput]:
        """Step until every queued request finishes; outputs sorted by the order they were added."""
        outs: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm import tqdm
            bar = tqdm(total=total, desc="requests", unit="req")
        while self.engine.has_unfinished:
            for o in self.engine.step():
                outs[o.request_id] = o
                if bar is not None:
                    bar.update(1)
        if bar is not None:
            bar.close()
        return [outs[k] for k in sorted(outs, key=_id_key)]


def _id_key(k: str) -> tuple[int, str]:
    return (int(k), "") if k.isdigit() else (1 << 62, k)
