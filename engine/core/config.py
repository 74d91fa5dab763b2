"""Engine configuration: dataclasses validated where they are built; each component gets its own part."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field, fields
from pathlib import Path

from engine.core.parallel_config import ParallelConfig
from engine.drafting.draftless_config import DRAFTLESS_METHODS, check_draftless, check_fallback
from engine.drafting.eagle_keys import check_eagle_keys
from engine.drafting.layer_skip_config import LAYER_SKIP, check_layer_skip
from scheduler.scheduler import SchedulerConfig
from scheduler.spec_policy import TreeShape
from workers.gguf_loader import is_gguf, resolve_model_path
from workers.loader import QUANTIZATION_CHOICES

DEFAULT_MODELS_DIR = Path(__file__).resolve().parents[1] / "default_models"
DEFAULT_NUM_SPECULATIVE_TOKENS = 4  # a fixed depth (adaptive: false) the user did not set
# ... and the adaptive policy's maximum: deep enough for a well-matched pair at batch 1 (the built-in pair's
# best fixed depth there is 6-8); the policy goes shallower where that pays.
DEFAULT_ADAPTIVE_MAX_TOKENS = 8
TREE_SAMPLING_MODES = ("iid", "without_replacement", "deterministic")
# "draft": an alias kept for older vLLM configs
SPEC_METHODS = ("draft_model", "draft", "eagle3", "eagle", *DRAFTLESS_METHODS, LAYER_SKIP)
EAGLE_METHODS = ("eagle3", "eagle")  # a head fed the target's hidden states (engine/drafting/eagle.py)


# Short names of other built-in targets (same tokenizer as the built-in draft, which is their default draft).
BUILTIN_TARGETS = {"v4": "v4-target"}  # a tiny trained DeepSeek-V4 (compressed state); see MODEL_CARD.md


def builtin_target_name(name: str | None) -> str | None:
    """``name`` when it is a built-in target's short name (and not an existing path), else None."""
    ok = isinstance(name, str) and name.lower() in BUILTIN_TARGETS and not os.path.exists(name)
    return name.lower() if ok else None  # type: ignore[union-attr]


# Drafts the project trained for targets that pip packages install (workers/gguf_loader.py short names): the
# default draft of ``--target NAME`` when shipped in engine/default_models (training/smollm2_draft.py).
PACKAGED_DEFAULT_DRAFTS = {"smollm2": "smollm2-draft"}


def packaged_default_draft(name: str | None) -> str | None:
    """The shipped draft directory for a packaged target's short name (not an existing path), else None."""
    if not isinstance(name, str) or name.lower() not in PACKAGED_DEFAULT_DRAFTS or os.path.exists(name):
        return None
    draft = DEFAULT_MODELS_DIR / PACKAGED_DEFAULT_DRAFTS[name.lower()]
    return str(draft) if (draft / "config.json").is_file() else None


def default_model_dirs(target_name: str | None = None) -> tuple[str, str]:
    """The built-in target (``target_name``: a short name of BUILTIN_TARGETS; default: the Llama target) and
    the built-in draft, shipped in engine/default_models; a clear error when one is missing."""
    target = DEFAULT_MODELS_DIR / (BUILTIN_TARGETS[target_name] if target_name else "target")
    draft = DEFAULT_MODELS_DIR / "draft"
    for d in (target, draft):
        if not (d / "config.json").is_file():
            raise FileNotFoundError(
                f"the built-in default models are not installed ({d} has no config.json); pass a model "
                "directory explicitly (--target DIR, --speculative-config '{\"model\": DIR, ...}')")
    return str(target), str(draft)


@dataclass
class SpeculativeConfig:
    """vLLM-compatible keys plus our tree keys.

    - ``method``: "draft_model" (alias "draft"), or the draftless "ngram" / "suffix" (no draft model: proposals
      from the request's tokens, engine/drafting/draftless_config.py; ``fallback``: a draft model's config
      drafting where they find no match);
    - ``model``: draft checkpoint directory;
    - ``num_speculative_tokens``: K, the depth of the candidate chain or tree (the adaptive policy's maximum);
      default: the tree's depth, else 8 with adaptive on and 4 with it off;
    - ``tree_branching``: children per node at each depth, e.g. [2, 2, 1, 1]; its length must equal K when both
      are given; default: a chain (all ones);
    - ``tree_sampling``: how siblings are drawn at temperature > 0: "iid" (with replacement, SpecInfer),
      "without_replacement" (recursive rejection sampling) or "deterministic" (the draft's top tokens; lossless,
      accepts less); greedy requests always take the draft's top tokens;
    - ``max_tree_nodes``: the verification budget per request per round; a larger tree is refused;
    - ``draft_tensor_parallel_size``: ranks for the draft worker, independent of the target's (default 1);
    - ``quantization``: a GGUF draft's weights: "gguf" (packed 4-bit) or "none"; "q8_0": a draft checkpoint's or
      EAGLE head's matrices as Q8_0 blocks on the native kernel (workers/q8_weights.py); default: by the file
      ("q8_0" for a packaged target's shipped draft or head on a CPU: engine/core/args.py);
    - ``pipeline``: draft round r+1 while the target verifies round r (engine/drafting/pipelined_drafter.py);
      ``pipeline_width``: how many predicted outcomes are pre-drafted per request per round (the likeliest
      ones by the measured acceptance rates; 0 pre-drafts nothing, so every round is re-drafted);
      ``pipeline_switch``: run each step pipelined or sequential, whichever is measured cheaper per emitted
      token for the step's regime (greedy or sampled, batch-size bucket), exploring the other now and then
      (engine/drafting/pipeline_switch.py; default true; false: every step pipelined);
      ``draft_process``: with tensor_parallel_size 1, run the draft in a local process of its own instead of a
      thread beside the target (engine/execution/draft_process.py); ``draft_cores`` / ``target_cores``: CPU cores each
      role is pinned to (one torch thread per core), e.g. [1] and [0], so the two do not compete;
    - ``adaptive``: choose each round's depth (0 .. num_speculative_tokens) and shape (chains, or the configured
      tree) per request from measured costs and acceptance (docs/adaptive.md); default true unless
      ``num_speculative_tokens_per_batch_size`` fixes the schedule (false for ngram / suffix, which accept true,
      with or without a fallback); false runs ``num_speculative_tokens`` (and
      the configured tree) every round. Seeded sampled requests always run the configured shape (their tokens
      depend on the depths; a seed must reproduce them);
    - ``adaptive_warmup_s``: seconds of dummy sequences at start-up over depths and batch sizes that seed the
      adaptive policy's cost curves (default 10; 0: learn from the first requests);
    - ``adaptive_cost_cache``: take those curves from the profile of the same setup on this machine when one
      was made in the last week, and keep this one's (``$SPECSERVE_CACHE_DIR``, else ``~/.cache/specserve``;
      default true);
    - ``num_speculative_tokens_per_batch_size``: vLLM's fixed schedule, ``{"1": 4, "16": 2, "64": 0}`` (or
      ``[[1, 4], [16, 2], [64, 0]]``): the depth for at least that many decoding requests; not with adaptive.
    - ``method`` "eagle3" / "eagle": ``model`` is an EAGLE head; its keys: engine/drafting/eagle_keys.py.
    """

    model: str | None = None  # None only for the draftless methods (ngram, suffix)
    num_speculative_tokens: int | None = None  # None: the tree's depth, else 8 adaptive / 4 fixed
    method: str = "draft_model"
    tree_branching: list[int] | None = None
    tree_sampling: str = "iid"
    max_tree_nodes: int = 64
    draft_tensor_parallel_size: int = 1  # independent of the target's
    pipeline: bool = False
    pipeline_width: int = 2
    pipeline_switch: bool = True
    draft_process: bool = False
    draft_cores: list[int] | None = None
    target_cores: list[int] | None = None
    quantization: str | None = None
    adaptive: bool | None = None  # None: on, unless a batch-size schedule fixes the depths
    num_speculative_tokens_per_batch_size: dict | list | None = None
    adaptive_warmup_s: float = 10.0  # start-up profiling of the adaptive policy's costs (core/policy_warmup.py)
    adaptive_cost_cache: bool = True  # reuse the profile of the same setup on this machine (core/policy_warmup.py)
    num_draft_tokens: int | None = None  # EAGLE-2 dynamic tree node budget (None: chains / tree_branching)
    eagle_topk: int = 4  # dynamic trees: children per expanded node and nodes expanded per depth
    # Draftless methods (engine/drafting/draftless_config.py): vLLM's ngram and suffix keys, ours after them.
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    suffix_decoding_max_tree_depth: int = 24
    suffix_decoding_max_cached_requests: int = 10_000
    suffix_decoding_max_spec_factor: float = 1.0
    suffix_decoding_min_token_prob: float = 0.1
    suffix_decoding_cross_request: bool = True  # false: no cache of other requests' outputs
    suffix_decoding_max_request_tokens: int = 1 << 13  # a request's own trie indexes its last this-many tokens
    fallback: dict | SpeculativeConfig | None = None  # a draft model's config, drafting where no match is found
    exit_layer: int | None = None  # method layer_skip: the target's layers 0..L-1 draft (engine/drafting/layer_skip.py)

    def __post_init__(self) -> None:
        if self.quantization not in (None, *QUANTIZATION_CHOICES):
            raise ValueError(f"speculative_config.quantization must be one of {list(QUANTIZATION_CHOICES)}, "
                             f"got {self.quantization!r}")
        if self.method not in SPEC_METHODS:
            raise ValueError(f"speculative_config.method must be one of {list(SPEC_METHODS)}, got {self.method!r}")
        if self.method == LAYER_SKIP:
            check_layer_skip(self)
        elif self.method in DRAFTLESS_METHODS:
            check_draftless(self)
        elif self.fallback is not None:
            raise ValueError("speculative_config.fallback is for methods 'ngram' and 'suffix'")
        elif not isinstance(self.model, str) or not self.model:
            raise ValueError("speculative_config.model must be a draft model directory")
        if self.num_speculative_tokens is None:
            if isinstance(self.tree_branching, (list, tuple)) and 1 <= len(self.tree_branching) <= 32:
                self.num_speculative_tokens = len(self.tree_branching)
            else:
                self.num_speculative_tokens = (DEFAULT_ADAPTIVE_MAX_TOKENS if self.is_adaptive
                                               else DEFAULT_NUM_SPECULATIVE_TOKENS)
        k = self.num_speculative_tokens
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= 32:
            raise ValueError(f"speculative_config.num_speculative_tokens must be an integer in [1, 32], got {k!r}")
        if self.tree_branching is not None:
            if not isinstance(self.tree_branching, (list, tuple)) or len(self.tree_branching) != k:
                raise ValueError(f"speculative_config.tree_branching must be a list of {k} integers (one per "
                                 f"depth, num_speculative_tokens={k}), got {self.tree_branching!r}")
        if self.tree_sampling not in TREE_SAMPLING_MODES:
            raise ValueError(f"speculative_config.tree_sampling must be one of {list(TREE_SAMPLING_MODES)}, "
                             f"got {self.tree_sampling!r}")
        w = self.pipeline_width
        if isinstance(w, bool) or not isinstance(w, int) or not 0 <= w <= 8:
            raise ValueError(f"speculative_config.pipeline_width must be an integer in [0, 8], got {w!r}")
        if not isinstance(self.pipeline, bool):
            raise ValueError(f"speculative_config.pipeline must be true or false, got {self.pipeline!r}")
        if not isinstance(self.pipeline_switch, bool):
            raise ValueError(f"speculative_config.pipeline_switch must be true or false, got {self.pipeline_switch!r}")
        if not isinstance(self.draft_process, bool):
            raise ValueError(f"speculative_config.draft_process must be true or false, got {self.draft_process!r}")
        for name in ("draft_cores", "target_cores"):
            cores = getattr(self, name)
            if cores is not None and (not isinstance(cores, (list, tuple)) or not cores or not all(
                    isinstance(c, int) and not isinstance(c, bool) and 0 <= c < 4096 for c in cores)):
                raise ValueError(f"speculative_config.{name} must be a non-empty list of CPU core numbers "
                                 f"(0 .. 4095), got {cores!r}")
        if (self.draft_cores is not None or self.target_cores is not None) and not self.draft_process:
            raise ValueError("speculative_config.draft_cores / target_cores pin the draft process and the target "
                             "apart: they need draft_process=true")
        if self.adaptive is not None and not isinstance(self.adaptive, bool):
            raise ValueError(f"speculative_config.adaptive must be true or false, got {self.adaptive!r}")
        t = self.adaptive_warmup_s
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 <= t <= 60:
            raise ValueError(f"speculative_config.adaptive_warmup_s must be a number of seconds in [0, 60], got {t!r}")
        if not isinstance(self.adaptive_cost_cache, bool):
            raise ValueError(f"speculative_config.adaptive_cost_cache must be true or false, "
                             f"got {self.adaptive_cost_cache!r}")
        if self.num_speculative_tokens_per_batch_size is not None:
            _ = self.batch_size_schedule  # validates the table
            if self.adaptive:
                raise ValueError("speculative_config.num_speculative_tokens_per_batch_size is a fixed schedule: "
                                 "it cannot be combined with adaptive=true")
        check_eagle_keys(self, EAGLE_METHODS)
        shape = self.tree_shape
        if shape.num_nodes > self.max_tree_nodes:
            raise ValueError(f"speculative_config.tree_branching {list(shape.branching)} makes {shape.num_nodes} "
                             f"nodes per round, above max_tree_nodes={self.max_tree_nodes}")
        check_fallback(self)

    @property
    def draft_spec(self) -> SpeculativeConfig | None:
        """The draft model's config (the worker to start): this one, the fallback's, or None (draftless)."""
        if self.method == LAYER_SKIP:
            return None  # the target drafts itself
        return self.fallback if self.method in DRAFTLESS_METHODS else self

    @property
    def is_eagle(self) -> bool:
        return self.method in EAGLE_METHODS

    @property
    def process_options(self) -> dict:
        """Where the draft runs (engine/execution/executor.py make_executor)."""
        return {"draft_process": self.draft_process, "draft_cores": self.draft_cores,
                "target_cores": self.target_cores}

    @property
    def is_adaptive(self) -> bool:
        # On by default: a fixed depth pays for speculation where the batch is compute-bound (chain K = 4 was
        # 0.64x no speculation at 64 requests, T = 0.8, on the built-in pair when this was written), the policy
        # falls back to plain decode there (benchmarks/results/adaptive-2026-12-02b/).
        if self.adaptive is None:
            return self.num_speculative_tokens_per_batch_size is None
        return self.adaptive

    @property
    def batch_size_schedule(self) -> tuple[tuple[int, int], ...] | None:
        """``num_speculative_tokens_per_batch_size`` as ascending (batch size, depth) pairs; None when unset."""
        table = self.num_speculative_tokens_per_batch_size
        if table is None:
            return None
        name, k = "speculative_config.num_speculative_tokens_per_batch_size", self.num_speculative_tokens
        if isinstance(table, dict):
            items = list(table.items())
        elif isinstance(table, (list, tuple)) and all(isinstance(e, (list, tuple)) and len(e) == 2 for e in table):
            items = [tuple(e) for e in table]
        else:
            raise ValueError(f"{name} must map batch sizes to depths, e.g. {{\"1\": {k}, \"32\": 0}}, got {table!r}")
        pairs = []
        for size, depth in items:
            ok = not isinstance(size, bool) and (isinstance(size, int) or (isinstance(size, str) and size.isdigit()))
            size = int(size) if ok else 0
            if size < 1:
                raise ValueError(f"{name}: batch sizes must be integers >= 1, got {table!r}")
            if isinstance(depth, bool) or not isinstance(depth, int) or not 0 <= depth <= k:
                raise ValueError(f"{name}: depths must be integers in [0, num_speculative_tokens={k}], "
                                 f"got {depth!r} for batch size {size}")
            pairs.append((size, depth))
        if not pairs or len({s for s, _ in pairs}) != len(pairs):
            raise ValueError(f"{name} must have at least one entry and no batch size twice, got {table!r}")
        return tuple(sorted(pairs))

    @property
    def draft_scratch_nodes(self) -> int:
        """Draft scratch slots one call may write past the committed tokens (predictions + their trees)."""
        shape = self.tree_shape
        if not self.pipeline:
            return shape.num_nodes
        anchors = self.pipeline_width
        # A miss is re-drafted like an ordinary round, so never less than the ordinary tree.
        return max(shape.num_nodes, shape.depth + anchors + anchors * shape.num_nodes)

    @property
    def tree_shape(self) -> TreeShape:
        if self.num_draft_tokens is not None:  # EAGLE: reserves depth K and num_draft_tokens nodes (eagle_keys.py)
            k = self.num_speculative_tokens
            return TreeShape((1,) * (k - 1) + (self.num_draft_tokens - k + 1,))
        if self.tree_branching is None:
            return TreeShape.chain(self.num_speculative_tokens)
        return TreeShape(tuple(self.tree_branching))

    @classmethod
    def parse(cls, value: str | dict | SpeculativeConfig | None) -> SpeculativeConfig | None:
        """From a JSON string (the CLI flag), a dict, or an instance; None means no speculation."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        value = cls.as_dict(value)
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"unknown speculative_config key(s) {unknown}; known: {sorted(known)}")
        if "model" not in value and value.get("method") not in (*DRAFTLESS_METHODS, LAYER_SKIP):
            raise ValueError("speculative_config.model is required (the draft model or EAGLE head directory)")
        return cls(**value)

    @staticmethod
    def as_dict(value: str | dict) -> dict:
        """The keys of a JSON string or dict, not yet validated."""
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config is not valid JSON: {e}") from e
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a JSON object, got {type(value).__name__}")
        return value


@dataclass
class CacheConfig:
    block_size: int = 16
    # KV pool size per model, in tokens; None sizes it for max_num_seqs full-length sequences, capped.
    num_kv_tokens: int | None = None
    # Automatic prefix caching (vLLM's default): full KV blocks of a shared prefix are computed once and kept,
    # reference-counted, until their room is needed; off trades prefill compute for nothing (a debugging switch).
    # DeepSeek-V4 models run without it (LLMEngine: their compressed state is not in the blocks).
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.num_kv_tokens is not None and self.num_kv_tokens < self.block_size:
            raise ValueError(f"num_kv_tokens must be >= block_size ({self.block_size}), got {self.num_kv_tokens}")


@dataclass
class EngineConfig:
    target: str
    speculative: SpeculativeConfig | None = None
    tokenizer: str | None = None  # default: the target directory
    dtype: str | None = None  # None: the checkpoint's own dtype
    # "gguf" / "none" (a GGUF target), "q8_0" (a checkpoint directory as 8-bit blocks); None: by the file
    quantization: str | None = None
    device: str = "cpu"
    max_model_len: int | None = None  # default: the target's max_position_embeddings
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    # who every request comes from, scoping what is cached across requests (the suffix cache): the server sets a
    # digest of its API key and served model name (engine/server/auth.py: tenant_of); None: one local user
    tenant: str | None = None

    def __post_init__(self) -> None:
        # Short names (``smollm2``) become the GGUF file a pip package installed; a missing package is an
        # error naming the install command.
        if builtin_target_name(self.target):
            self.target = default_model_dirs(builtin_target_name(self.target))[0]
        self.target = resolve_model_path(self.target)
        _check_model_path("target model", self.target)
        if self.speculative is not None and self.speculative.draft_spec is not None:
            draft = self.speculative.draft_spec
            draft.model = resolve_model_path(draft.model)
            _check_model_path("speculative_config.model", draft.model)
        if self.quantization not in (None, *QUANTIZATION_CHOICES):
            raise ValueError(f"quantization must be one of {list(QUANTIZATION_CHOICES)}, got {self.quantization!r}")
        if self.quantization == "gguf" and not is_gguf(self.target):
            raise ValueError(f"quantization 'gguf' needs a *.gguf target, got {self.target!r}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")


def _check_model_path(what: str, path: str) -> None:
    if is_gguf(path):
        return
    if os.path.isfile(path):
        raise ValueError(f"{what} {path!r} is a file; expected a model directory (config.json, weights and "
                         "tokenizer files side by side) or a *.gguf file")
    if not os.path.isdir(path):
        raise ValueError(f"{what} directory {path!r} does not exist")
