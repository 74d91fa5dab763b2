"""Per-request sampling settings, validated where they enter (stdlib only).

Every bound is checked in ``validate()``, which runs at construction and again when the engine accepts the
request (``LLMEngine.add_request``), so a field changed after construction cannot reach the workers: a value
the workers cannot represent (a top_k past int64, a seed past 64 bits on the msgpack wire) would otherwise
fail a whole step, and with it every request in flight.

Ranges:
- max_tokens: integer, 1 <= max_tokens <= MAX_TOKENS_LIMIT (the KV pool bounds it further at admission)
- temperature: finite, 0 <= T <= MAX_TEMPERATURE; 0 (and anything below 1e-5) is greedy
- top_p in (0, 1]; min_p in [0, 1]; top_k = -1 or 0 (off; 0 is read as -1, as in Hugging Face generation
  configs and vLLM) or 1 <= top_k <= the model's vocabulary (checked with ``validate(vocab_size)`` by the engine
  and the server, which know the vocabulary; without it only <= TOP_K_LIMIT)
- seed: None or a 64-bit integer: -2**63 <= seed <= 2**63 - 1 (an int64 on every path, msgpack included)
- stop_token_ids: integers in [0, 2**63)
- logprobs / prompt_logprobs: None (off) or 0 <= k <= MAX_LOGPROBS (each token's own value and k alternatives);
  logprobs_mode one of LOGPROBS_MODES (vLLM's names; workers/logprobs.py says what each means)
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

# Below this temperature a request is greedy, everywhere (engine, draft and target workers; vLLM uses the same
# epsilon): dividing logits by a tiny T only makes a one-hot with rounding noise, so we take the argmax instead.
GREEDY_TEMPERATURE = 1e-5


def is_greedy(temperature: float) -> bool:
    return temperature < GREEDY_TEMPERATURE


INT64_MAX = 2**63 - 1

MAX_TEMPERATURE = 100.0
MAX_TOKENS_LIMIT = 1 << 31
TOP_K_LIMIT = (1 << 31) - 1
SEED_MIN, SEED_MAX = -INT64_MAX - 1, INT64_MAX
# Top alternatives per token: OpenAI's and vLLM's default cap. Each costs a topk column and ~12 bytes per token
# on the wire from the target; more would make logprobs requests pay for every token in transfer and JSON.
MAX_LOGPROBS = 20
LOGPROBS_MODES = ("raw_logprobs", "raw_logits", "processed_logprobs")


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0 (below GREEDY_TEMPERATURE) means greedy
    top_p: float = 1.0  # (0, 1]; 1 = off
    top_k: int = -1  # -1 (or 0, stored as -1) = off, else >= 1
    min_p: float = 0.0  # [0, 1]; 0 = off
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # k: each emitted token's logprob and its k most likely alternatives
    prompt_logprobs: int | None = None  # k: the same for the prompt's tokens (echo); bypasses the prefix cache
    logprobs_mode: str = "raw_logprobs"
    # A copy of a prompt queued just before it (n > 1): admitted once that prompt's prefill is committed, so it
    # starts on the cached blocks (scheduler ``_twin_prefilling``) instead of computing the same prefix again.
    after_twin: bool = False
    # vLLM's structured_outputs: exactly one of json (a schema), json_object, regex, choice, grammar (Lark); the
    # output is masked to the grammar at every verified node (engine/structured/); compiled when queued.
    structured_outputs: dict | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.top_k == 0 and not isinstance(self.top_k, bool):
            self.top_k = -1  # one spelling of "off" past this point
        self.validate()

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise ValueError naming the field and its range; ``vocab_size`` also bounds top_k."""
        _check_int("max_tokens", self.max_tokens)
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {_short(self.max_tokens)}")
        if self.max_tokens > MAX_TOKENS_LIMIT:
            raise ValueError(f"max_tokens must be <= {MAX_TOKENS_LIMIT}, got {_short(self.max_tokens)}")
        _check_float("temperature", self.temperature)
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.temperature > MAX_TEMPERATURE:
            raise ValueError(f"temperature must be <= {MAX_TEMPERATURE:g}, got {self.temperature}")
        _check_float("top_p", self.top_p)
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        _check_int("top_k", self.top_k)
        # top_k and seed reach int64 tensors and msgpack frames: a larger int would fail a whole step.
        top_k_max = TOP_K_LIMIT if vocab_size is None else vocab_size
        if self.top_k < -1 or self.top_k > top_k_max:
            upper = f"the vocabulary size, {vocab_size}" if vocab_size is not None else top_k_max
            raise ValueError(f"top_k must be -1 or 0 (off) or between 1 and {upper}, got {_short(self.top_k)}")
        _check_float("min_p", self.min_p)
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.seed is not None:
            _check_int("seed", self.seed)
            if not SEED_MIN <= self.seed <= SEED_MAX:
                raise ValueError(f"seed must be a 64-bit integer in [-2**63, 2**63 - 1], got {_short(self.seed)}")
        if not isinstance(self.stop, list) or not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError("stop must be a string or a list of non-empty strings")
        if not isinstance(self.stop_token_ids, list):
            raise ValueError("stop_token_ids must be a list of token ids")
        for t in self.stop_token_ids:
            _check_int("stop_token_ids", t)
            if not 0 <= t < 1 << 63:
                raise ValueError(f"stop_token_ids must be token ids >= 0, got {_short(t)}")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be true or false, got {self.ignore_eos!r}")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None:
                _check_int(name, k)
                if not 0 <= k <= MAX_LOGPROBS:
                    raise ValueError(f"{name} must be between 0 and {MAX_LOGPROBS}, got {_short(k)}")
        if self.structured_outputs is not None:
            if not isinstance(self.structured_outputs, dict):
                raise ValueError("structured_outputs must be an object such as {\"json\": SCHEMA} or {\"regex\": R}")
            if self.ignore_eos:  # a finished grammar allows only EOS: ignoring it would run past the grammar
                raise ValueError("structured_outputs cannot be combined with ignore_eos")
        if not isinstance(self.after_twin, bool):
            raise ValueError(f"after_twin must be true or false, got {self.after_twin!r}")
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode must be one of {', '.join(LOGPROBS_MODES)}, got {self.logprobs_mode!r}")

    @property
    def greedy(self) -> bool:
        return is_greedy(self.temperature)


def sample_copies(params: SamplingParams, n: int) -> list[SamplingParams]:
    """n independent samples of one prompt: copy j draws from its own stream, seed + j when seeded (vLLM's rule,
    wrapped into 64 bits), a private random seed each when not; copies 1.. wait for copy 0's cached prefix."""
    out = []
    for j in range(n):
        seed = None if params.seed is None else (params.seed + j - SEED_MIN) % (1 << 64) + SEED_MIN
        out.append(dataclasses.replace(params, seed=seed, after_twin=j > 0))
    return out


def _check_int(name: str, v: object) -> None:
    if isinstance(v, bool) or not isinstance(v, int):
        raise ValueError(f"{name} must be an integer, got {v!r}")


def _check_float(name: str, v: object) -> None:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ValueError(f"{name} must be a finite number, got {v!r}")
    try:
        finite = math.isfinite(v)
    except OverflowError:  # an int too large for a float (JSON allows 1e400 as an integer literal)
        finite = False
    if not finite:
        raise ValueError(f"{name} must be a finite number, got {_short(v)}")


def _short(v: object) -> str:
    """repr, shortened: a 5000-digit integer should not fill the error message (or exceed the int->str limit)."""
    if isinstance(v, int) and v.bit_length() > 128:
        return f"an integer of {v.bit_length()} bits"
    s = repr(v)
    return s if len(s) <= 40 else s[:20] + "..." + f" ({len(s)} digits)"
