"""Shared fixtures: tiny random checkpoints built once per session, and small engine helpers.

Every engine test runs on CPU with one thread (the suite must stay fast on one core, and a second thread only
adds contention on a loaded machine).
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from collections.abc import Container, Iterable
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from tests.helpers_models import make_tiny_checkpoint

torch.set_num_threads(1)

# The adaptive policy's start-up profiles (engine/core/policy_warmup.py) go to a folder of this run's own, never the
# user's cache: engines of one setup (the built-in pair behind most servers the tests start, which inherit this
# environment) profile once per run instead of once per start.
_PROFILES = tempfile.mkdtemp(prefix="specserve-test-profiles-")
os.environ["SPECSERVE_CACHE_DIR"] = _PROFILES
atexit.register(shutil.rmtree, _PROFILES, ignore_errors=True)

VOCAB = 128
SMALL_VOCAB = 12


@dataclass(frozen=True)
class Models:
    """Checkpoint directories for one model family."""

    target: str  # 2 layers
    draft: str  # a different random model (1 layer): greedy acceptance is near zero
    perturbed: str  # the target with a little noise on its weights: acceptance is partial


def perturb_checkpoint(src: str, dst: str, scale: float, seed: int) -> str:
    """Copy checkpoint ``src`` to ``dst`` with Gaussian noise of relative size ``scale`` on every weight."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    path = os.path.join(dst, "model.safetensors")
    weights = load_file(path)
    gen = torch.Generator().manual_seed(seed)
    for name in sorted(weights):
        w = weights[name]
        weights[name] = w + scale * w.std() * torch.randn(w.shape, generator=gen, dtype=w.dtype)
    save_file(weights, path, metadata={"format": "pt"})
    return dst


def _family(tmp_path_factory: pytest.TempPathFactory, family: str) -> Models:
    root = tmp_path_factory.mktemp(f"{family}-models")
    target = make_tiny_checkpoint(root / "target", family=family, vocab_size=VOCAB, seed=0)
    draft = make_tiny_checkpoint(root / "draft", family=family, vocab_size=VOCAB, seed=1, num_hidden_layers=1)
    perturbed = perturb_checkpoint(target, str(root / "perturbed"), scale=0.1, seed=2)
    return Models(target, draft, perturbed)


@pytest.fixture(scope="session")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Models:
    return _family(tmp_path_factory, "llama")


@pytest.fixture(scope="session")
def qwen3(tmp_path_factory: pytest.TempPathFactory) -> Models:
    return _family(tmp_path_factory, "qwen3")


@pytest.fixture(scope="session")
def small_vocab(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    """A target with a 12-token vocabulary and a different draft over the first 10 of those ids."""
    root = tmp_path_factory.mktemp("small-vocab")
    target = make_tiny_checkpoint(root / "target", family="llama", vocab_size=SMALL_VOCAB, seed=3,
                                  num_hidden_layers=1)
    draft = make_tiny_checkpoint(root / "draft", family="qwen3", vocab_size=SMALL_VOCAB - 2, seed=4,
                                 num_hidden_layers=1)
    return target, draft


@pytest.fixture(scope="session")
def with_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A llama target with the character-level tokenizer (ids 3.. are printable ASCII)."""
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tok") / "target", family="llama", vocab_size=VOCAB,
                                seed=5, num_hidden_layers=1, with_tokenizer=True)


def marked_slow(cases: Iterable[Any], slow: Container[Any]) -> list[Any]:
    """``cases`` for ``parametrize``, those in ``slow`` marked slow: a long statistical run leaves the fast lane
    (``-m "not slow"``) while the quicker cases of the same test stay in it."""
    return [pytest.param(c, marks=pytest.mark.slow) if c in slow else c for c in cases]


def spec(draft: str, k: int | None = None, branching: list[int] | None = None, sampling: str = "iid",
         adaptive: bool = False) -> dict:
    """A speculative_config dict: a chain of ``k`` tokens, or a tree with ``branching`` (k = its depth). The
    depth is fixed (tests count rounds of that depth) unless ``adaptive``, where it is the policy's maximum."""
    cfg: dict = {"method": "draft_model", "model": draft, "tree_sampling": sampling, "adaptive": adaptive}
    if branching is not None:
        cfg["tree_branching"] = list(branching)
        cfg["num_speculative_tokens"] = len(branching)
    else:
        cfg["num_speculative_tokens"] = k
    return cfg


def workers(engine):
    """(target worker, draft worker or None) of an engine running its workers in this process."""
    ex = getattr(engine, "executor", None)
    if ex is not None:
        return ex.target, ex.draft
    return engine.target, engine.draft


def run_to_completion(engine, max_steps: int = 100_000) -> dict[str, object]:
    """Step until every request finished; outputs by request id."""
    outs: dict[str, object] = {}
    for _ in range(max_steps):
        if not engine.has_unfinished:
            return outs
        for o in engine.step_finished():
            outs[o.request_id] = o
    raise AssertionError(f"engine still has unfinished requests after {max_steps} steps")


# ------------------------------------------------------------------ Ray tests (test_ray_executor, test_ray_placement)

TP_PROMPTS = [[1, 17, 44, 9, 83], [1] + list(range(20, 32)), [1, 5]]
TP_MAX_TOKENS = 12


@dataclass(frozen=True)
class TPModels:
    """A pair that splits over 1, 2, 4 and 8 ranks, and the target's greedy continuations of TP_PROMPTS."""

    target: str  # 8 query heads over 4 kv heads (replicated at 8 ranks), intermediate 128
    draft: str  # the target with noise on its weights: acceptance is partial, so accept and reject both run
    expected: list[list[int]]  # transformers generate, greedy, TP_MAX_TOKENS tokens per prompt


def hf_greedy_continuations(path: str, prompts: list[list[int]], n: int) -> list[list[int]]:
    """transformers ``generate`` (greedy, EOS ignored): ``n`` new tokens per prompt."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    outs = []
    for p in prompts:
        with torch.no_grad():
            g = hf.generate(torch.tensor([p]), max_new_tokens=n, do_sample=False, pad_token_id=0)
        outs.append(g[0, len(p):].tolist())
    return outs


@pytest.fixture(scope="session")
def tp_models(tmp_path_factory: pytest.TempPathFactory) -> TPModels:
    root = tmp_path_factory.mktemp("tp-models")
    target = make_tiny_checkpoint(root / "target", family="llama", vocab_size=VOCAB, seed=6, head_dim=8,
                                  num_attention_heads=8, num_key_value_heads=4)
    draft = perturb_checkpoint(target, str(root / "draft"), scale=0.2, seed=7)
    return TPModels(target, draft, hf_greedy_continuations(target, TP_PROMPTS, TP_MAX_TOKENS))


def ray_leftovers(workers: list[dict] | None = None, timeout_s: float = 60.0, check_ray: bool = True) -> list[str]:
    """What a shut-down engine left behind in the connected Ray cluster: worker actors not dead, placement
    groups not removed, worker processes still running. ``workers``: the engine's ``describe()`` from before
    the shutdown (None: every worker actor and placement group in the cluster). ``check_ray=False``: only the
    processes (Ray itself is gone). Waits up to ``timeout_s`` for Ray to finish the kills."""
    import time

    import ray
    from ray._private import state  # the GCS tables; ray.util.state needs the dashboard, which tests leave off

    actor_ids = None if workers is None else {w["actor_id"] for w in workers}
    group_ids = None if workers is None else {w["placement_group_id"] for w in workers}
    pids = [] if workers is None else [w["pid"] for w in workers]
    deadline = time.monotonic() + timeout_s
    while True:
        left = [f"worker process {pid} is alive" for pid in pids if _process_alive(pid)]
        if check_ray:
            left += [f"actor {a['ActorID']} is {a['State']}" for a in state.actors().values()
                     if a.get("ActorClassName") == "WorkerProcess" and a.get("State") != "DEAD"
                     and (actor_ids is None or a["ActorID"] in actor_ids)]
            left += [f"placement group {g} is {info['state']}"
                     for g, info in ray.util.placement_group_table().items()
                     if info["state"] != "REMOVED" and (group_ids is None or g in group_ids)]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.5)


def _process_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has exited: only its entry remains
    except (FileNotFoundError, ProcessLookupError):
        return False


def random_plans(monkeypatch, seed: int = 0) -> None:
    """The adaptive policy's own plan, then overridden by random shapes from its menu (chains 0..cap, the
    configured tree): depths change per request and per step far more than any measured policy would."""
    import random

    from scheduler.adaptive import AdaptivePolicy

    rng = random.Random(seed)
    real = AdaptivePolicy.plan

    def plan(self, reqs, prefill=False):
        real(self, reqs, prefill)  # keeps its bookkeeping exercised
        tree = self.base.tree.branching
        out = []
        for r in reqs:
            cap = self.base.cap(r)
            menu = [(1,) * d for d in range(cap + 1)] + [tree[:cap]]
            out.append(rng.choice(menu))
        return out

    monkeypatch.setattr(AdaptivePolicy, "plan", plan)
