"""What the engine needs to know about a checkpoint, read once from its ``config.json``.

``ModelConfig.from_pretrained(dir)`` goes through ``transformers.AutoConfig`` (local files only) and flattens
the family-specific spellings into one frozen dataclass, so model code reads ``config.qk_norm`` instead of
comparing model types. All per-family decisions live in ``_family_flags`` below.

Context-length policy (``max_model_len``): the longest sequence (prompt + generated + scratch tree) for which
our full-causal attention is exactly the checkpoint's attention.
- sliding window (Mistral v0.1, Qwen2 with ``use_sliding_window``): attention restricted to the last W keys is
  the same as full causal attention while a sequence has at most W tokens, so ``max_model_len`` is capped at W
  instead of implementing the window. The runner must not let a sequence grow past ``max_model_len``.
- ``rope_type: "dynamic"``: identical to plain RoPE up to ``max_position_embeddings`` and history-dependent
  beyond it, so the context is capped there.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from typing import Any

import torch

SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3")

_DTYPES = {
    "float32": torch.float32, "float": torch.float32, "fp32": torch.float32,
    "float16": torch.float16, "half": torch.float16, "fp16": torch.float16,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
}


def parse_dtype(value: Any, default: torch.dtype = torch.float32) -> torch.dtype:
    """A torch dtype from a config value ("bfloat16", "torch.float16", torch.bfloat16, None -> default)."""
    if value is None:
        return default
    if isinstance(value, torch.dtype):
        return value
    name = str(value).removeprefix("torch.")
    if name not in _DTYPES:
        raise ValueError(f"unsupported dtype {value!r}; expected one of {sorted(set(_DTYPES))}")
    return _DTYPES[name]


@dataclass(frozen=True)
class ModelConfig:
    architecture: str  # e.g. "LlamaForCausalLM": selects the implementation (see models/registry.py)
    model_type: str  # "llama", "mistral", "qwen2", "qwen3"
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None  # None for plain RoPE; else has "rope_type" in SUPPORTED_ROPE_TYPES
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False  # bias on q/k/v projections (Qwen2 always; Llama/Qwen3 when attention_bias)
    o_proj_bias: bool = False  # bias on o_proj (Llama/Qwen3 attention_bias; never Qwen2)
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on every q and k head, before RoPE
    sliding_window: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    pad_token_id: int | None = None
    dtype: torch.dtype = torch.float32  # the weights' dtype (checkpoint's unless overridden)
    hidden_act: str = "silu"

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads != 0:
            raise ValueError(f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")
        if self.hidden_act != "silu":
            raise ValueError(f"hidden_act={self.hidden_act!r} is not supported (only SwiGLU with 'silu')")
        rope_type = (self.rope_scaling or {}).get("rope_type", "default")
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(f"rope_type {rope_type!r} is not supported; supported: {SUPPORTED_ROPE_TYPES}")

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe fields (the dtype by name): the controller reads a checkpoint's config once and hands it to
        its workers, which then never import transformers (~3 s of CPU per worker process)."""
        d = dataclasses.asdict(self)
        d["dtype"] = str(self.dtype).removeprefix("torch.")
        d["eos_token_ids"] = list(self.eos_token_ids)
        return d

    @staticmethod
    def from_dict(d: dict[str, Any]) -> ModelConfig:
        return ModelConfig(**{**d, "dtype": parse_dtype(d["dtype"]), "eos_token_ids": tuple(d["eos_token_ids"])})

    @property
    def max_model_len(self) -> int:
        """Longest sequence served exactly (see the module docstring)."""
        n = self.max_position_embeddings
        if self.sliding_window is not None:
            n = min(n, self.sliding_window)
        return n

    def tp_problem(self, tp_size: int) -> str | None:
        """Why the model cannot be split over ``tp_size`` ranks, or None when it can.

        KV heads: a size dividing num_kv_heads gives each rank its own; a multiple of num_kv_heads replicates
        each KV head on tp_size / num_kv_heads ranks (exactly those holding the query heads of its group).
        """
        if tp_size < 1:
            return f"tensor-parallel size must be >= 1, got {tp_size}"
        if self.num_heads % tp_size != 0:
            return f"tensor-parallel size {tp_size} must divide num_heads={self.num_heads}"
        if self.num_kv_heads % tp_size != 0 and tp_size % self.num_kv_heads != 0:
            return (f"tensor-parallel size {tp_size} must divide num_kv_heads={self.num_kv_heads} or be a "
                    "multiple of it (kv heads are then replicated)")
        if self.intermediate_size % tp_size != 0:
            return f"tensor-parallel size {tp_size} must divide intermediate_size={self.intermediate_size}"
        return None

    def valid_tp_sizes(self, up_to: int = 8) -> list[int]:
        return [n for n in range(1, up_to + 1) if self.tp_problem(n) is None]

    def check_tp(self, tp_size: int) -> None:
        """Raise a ValueError saying what to change when the model cannot be split over ``tp_size`` ranks."""
        problem = self.tp_problem(tp_size)
        if problem is not None:
            sizes = ", ".join(map(str, self.valid_tp_sizes(max(8, tp_size))))
            raise ValueError(f"{problem}; this model splits over {sizes} ranks")

    def num_kv_heads_per_rank(self, tp_size: int) -> int:
        """KV heads each rank stores in its cache (kv heads are replicated when tp_size > num_kv_heads)."""
        self.check_tp(tp_size)
        return max(1, self.num_kv_heads // tp_size)

    @staticmethod
    def from_pretrained(path: str | os.PathLike[str]) -> ModelConfig:
        path = os.fspath(path)
        if path.endswith(".gguf") and os.path.isfile(path):
            from workers.gguf_metadata import gguf_model_fields  # the gguf package: only when needed

            return ModelConfig(**gguf_model_fields(path))
        if not os.path.isdir(path):
            raise FileNotFoundError(f"model directory {path!r} does not exist (only local directories and "
                                    "*.gguf files are supported; download the checkpoint first)")
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise FileNotFoundError(f"{path!r} has no config.json; is it a Hugging Face checkpoint directory?")
        from transformers import AutoConfig  # heavy import, only when a checkpoint is actually read

        hf = AutoConfig.from_pretrained(path, local_files_only=True)
        return ModelConfig.from_hf(hf, generation_config_path=os.path.join(path, "generation_config.json"))

    @staticmethod
    def from_hf(hf: Any, generation_config_path: str | None = None) -> ModelConfig:
        """Flatten a transformers config object (v4 or v5 spellings)."""
        archs = getattr(hf, "architectures", None) or [_architecture_of(hf.model_type)]
        num_heads = hf.num_attention_heads
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // num_heads
        rope_theta, rope_scaling = _rope_params(hf)
        flags = _family_flags(hf)
        dtype = parse_dtype(getattr(hf, "dtype", None) or getattr(hf, "torch_dtype", None))
        return ModelConfig(
            architecture=archs[0],
            model_type=hf.model_type,
            vocab_size=hf.vocab_size,
            hidden_size=hf.hidden_size,
            num_layers=hf.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(hf, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim,
            intermediate_size=hf.intermediate_size,
            rms_norm_eps=hf.rms_norm_eps,
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=hf.max_position_embeddings,
            tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
            eos_token_ids=_eos_ids(hf, generation_config_path),
            bos_token_id=getattr(hf, "bos_token_id", None),
            pad_token_id=getattr(hf, "pad_token_id", None),
            dtype=dtype,
            hidden_act=getattr(hf, "hidden_act", "silu"),
            **flags,
        )


def _architecture_of(model_type: str) -> str:
    """The causal-LM class transformers builds for a config without ``architectures`` (it goes by model_type)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    arch = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type)
    if arch is None:
        raise ValueError(f"config.json has no 'architectures' entry and model_type {model_type!r} has no causal-LM "
                         "class in transformers; add \"architectures\": [\"...ForCausalLM\"]")
    return arch


def _family_flags(hf: Any) -> dict[str, Any]:
    """The per-family differences, in one place."""
    model_type = hf.model_type
    attention_bias = bool(getattr(hf, "attention_bias", False))
    flags: dict[str, Any] = {
        "attention_bias": attention_bias,
        "o_proj_bias": attention_bias,
        "mlp_bias": bool(getattr(hf, "mlp_bias", False)),
        "qk_norm": False,
        "sliding_window": None,
    }
    if model_type == "qwen2":
        flags.update(attention_bias=True, o_proj_bias=False)  # Qwen2 hard-codes q/k/v bias, no o bias
    if model_type == "qwen3":
        flags["qk_norm"] = True
    if model_type == "deepseek_v4":
        return flags  # its sliding window is implemented exactly (workers/models/deepseek_v4*), no context cap
    if model_type in ("qwen2", "qwen3"):
        # transformers already drops sliding_window unless use_sliding_window; it applies to some layers only,
        # but capping the context at the window makes every layer exact.
        if getattr(hf, "use_sliding_window", False):
            flags["sliding_window"] = getattr(hf, "sliding_window", None)
    else:
        flags["sliding_window"] = getattr(hf, "sliding_window", None)
    return flags


def _rope_params(hf: Any) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, scaling dict or None). transformers v5 keeps both in ``rope_parameters``; v4 splits them
    into ``rope_theta`` and ``rope_scaling`` (whose type key was once called "type")."""
    params = dict(getattr(hf, "rope_parameters", None) or getattr(hf, "rope_scaling", None) or {})
    theta = params.pop("rope_theta", None) or getattr(hf, "rope_theta", None) or 10000.0
    rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params.pop("type", None)
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError("partial rotary embeddings are not supported")
    params.pop("partial_rotary_factor", None)
    if rope_type == "default":
        return float(theta), None
    if rope_type == "llama3":
        params.setdefault("original_max_position_embeddings", hf.max_position_embeddings)
    return float(theta), {"rope_type": rope_type, **params}


def _eos_ids(hf: Any, generation_config_path: str | None) -> tuple[int, ...]:
    """config.json's eos ids plus generation_config.json's (chat models often list extra stop ids there)."""
    ids: list[int] = []

    def add(value: Any) -> None:
        for v in value if isinstance(value, (list, tuple)) else [value]:
            if v is not None and int(v) not in ids:
                ids.append(int(v))

    add(getattr(hf, "eos_token_id", None))
    if generation_config_path and os.path.isfile(generation_config_path):
        with open(generation_config_path) as f:
            add(json.load(f).get("eos_token_id"))
    return tuple(ids)
