"""Workers in Ray actors, tensor-parallel ranks over Gloo on CPU: the output is the in-process engine's.

Every engine here answers the same mixed batch (each prompt greedy, and again sampled with a fixed seed):
greedy tokens must equal transformers ``generate`` and the in-process engine's; seeded sampled tokens must
equal the in-process engine's (every rank draws from the same per-request stream, and q crosses the wire bit
for bit). Then: both transports give identical outputs, shutdown leaves nothing behind, and a worker's error
reaches the caller with its traceback.

Starting a worker costs seconds (a process importing torch and transformers), so the module shares one Ray
cluster (after the first test, which checks that an engine starts and stops a Ray of its own) and starts each
engine configuration once. TP=8 on CPU runs in test_ray_placement.py, on a cluster that declares 9 GPUs (the
workers fall back to the CPU there too).
"""

from __future__ import annotations

import pytest

from engine.llm import LLM
from scheduler.sampling_params import SamplingParams
from tests.conftest import TP_MAX_TOKENS, TP_PROMPTS, TPModels, random_plans, ray_leftovers
from workers.messages import SamplingSpec, TargetStep, VerifySeq

pytestmark = pytest.mark.slow  # a Ray cluster

SPECS = {  # name -> speculative settings (None: no speculation)
    "off": None,
    "chain": {"num_speculative_tokens": 3},
    "tree": {"num_speculative_tokens": 3, "tree_branching": [2, 1, 1]},
}
GREEDY = SamplingParams(max_tokens=TP_MAX_TOKENS, temperature=0.0, ignore_eos=True)
PARAMS = [GREEDY] * len(TP_PROMPTS) + [
    SamplingParams(max_tokens=TP_MAX_TOKENS, temperature=0.9, top_p=0.95, seed=1000 + i, ignore_eos=True)
    for i in range(len(TP_PROMPTS))]


def speculative(models: TPModels, name: str, **extra) -> dict | None:
    """Fixed depth unless ``extra`` says adaptive: seeded sampled outputs are compared across executors, and
    adaptive depths follow measured times."""
    s = SPECS[name]
    return None if s is None else {"method": "draft_model", "model": models.draft, **s, "adaptive": False, **extra}


def run(llm: LLM) -> tuple[list[list[int]], list[list[int]]]:
    """(greedy outputs, seeded sampled outputs) for TP_PROMPTS, one batch."""
    outs = [o.token_ids for o in llm.generate(TP_PROMPTS + TP_PROMPTS, PARAMS)]
    return outs[: len(TP_PROMPTS)], outs[len(TP_PROMPTS):]


@pytest.fixture(scope="module")
def ray_cluster():
    """One local Ray for the module; engines reuse it (and leave it running when they shut down)."""
    import ray

    if ray.is_initialized():
        ray.shutdown()
    ray.init(address="local", num_cpus=16, include_dashboard=False, log_to_driver=False, configure_logging=False)
    yield
    ray.shutdown()


class Engines:
    """Ray engines started once per module and configuration; a test may take one and shut it down."""

    def __init__(self, models: TPModels) -> None:
        self.models = models
        self.llms: dict[str, LLM] = {}
        self.outputs: dict[str, tuple[list[list[int]], list[list[int]]]] = {}

    def get(self, key: str, spec: str, **kwargs) -> LLM:
        if key not in self.llms:
            extra = kwargs.pop("spec_extra", {})
            self.llms[key] = LLM(self.models.target, speculative(self.models, spec, **extra),
                                 distributed_executor_backend="ray", **kwargs)
        return self.llms[key]

    def output(self, key: str, spec: str, **kwargs) -> tuple[list[list[int]], list[list[int]]]:
        if key not in self.outputs:
            self.outputs[key] = run(self.get(key, spec, **kwargs))
        return self.outputs[key]

    def take(self, key: str, spec: str, **kwargs) -> LLM:
        """The engine, no longer shared: the caller shuts it down."""
        llm = self.get(key, spec, **kwargs)
        del self.llms[key]
        return llm

    def close(self) -> None:
        for llm in self.llms.values():
            llm.shutdown()
        self.llms.clear()


@pytest.fixture(scope="module")
def engines(ray_cluster, tp_models: TPModels):
    e = Engines(tp_models)
    yield e
    e.close()


@pytest.fixture(scope="module")
def in_process(tp_models: TPModels):
    """Outputs of the in-process engine (tensor_parallel_size 1, no Ray), by speculation setting."""
    cache: dict[str, tuple[list[list[int]], list[list[int]]]] = {}

    def get(name: str):
        if name not in cache:
            llm = LLM(tp_models.target, speculative(tp_models, name), distributed_executor_backend="uni")
            cache[name] = run(llm)
            llm.shutdown()
        return cache[name]

    return get


@pytest.mark.parametrize("name", sorted(SPECS))
def test_in_process_equals_transformers(tp_models: TPModels, in_process, name: str) -> None:
    greedy, sampled = in_process(name)
    assert greedy == tp_models.expected
    assert all(len(s) == TP_MAX_TOKENS for s in sampled)


def test_engine_starts_and_stops_its_own_ray(tp_models: TPModels, in_process) -> None:
    # No Ray running: the executor starts a local one and takes it down with the workers (the CLI's path).
    import ray

    if ray.is_initialized():
        ray.shutdown()
    llm = LLM(tp_models.target, None, tensor_parallel_size=2)
    try:
        assert ray.is_initialized()
        workers = llm.engine.executor.describe()
        greedy, sampled = run(llm)
    finally:
        llm.shutdown()
    assert not ray.is_initialized()
    assert ray_leftovers(workers, check_ray=False) == []
    assert greedy == tp_models.expected
    assert (greedy, sampled) == in_process("off")


@pytest.mark.parametrize("name,transport", [("chain", "ray"), ("tree", "zmq")])
def test_tp2_equals_in_process_and_transformers(tp_models: TPModels, engines: Engines, in_process, name: str,
                                                transport: str) -> None:
    # One transport each (per-round messages as Ray calls, or msgpack over zmq): both equal the in-process
    # engine, greedy and seeded, so the transports give identical outputs.
    greedy, sampled = engines.output(f"tp2-{name}", name, tensor_parallel_size=2, transport=transport)
    llm = engines.get(f"tp2-{name}", name)
    assert llm.engine.executor.parallel.transport == transport
    stats = llm.engine.stats
    assert greedy == tp_models.expected
    assert (greedy, sampled) == in_process(name)
    # Speculation really ran, and some candidates were accepted (commits of accepted paths on both ranks).
    assert stats.num_rounds > 0 and 0 < stats.num_accepted < stats.num_drafted


def test_tp2_adaptive_keeps_greedy_output(tp_models: TPModels, engines: Engines,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Adaptive speculation over Ray (the policy runs in the driver's scheduler), with random depths and shapes
    per request per step: the greedy output is the target's."""
    random_plans(monkeypatch)
    llm = engines.take("tp2-adaptive", "tree", tensor_parallel_size=2, spec_extra={"adaptive": True})
    try:
        greedy, _ = run(llm)
        assert greedy == tp_models.expected
        assert len(llm.engine.stats.chosen_depths) >= 3, llm.engine.stats.chosen_depths
    finally:
        llm.shutdown()


def test_tp2_workers_are_where_the_plan_says(engines: Engines) -> None:
    workers = engines.get("tp2-tree", "tree", tensor_parallel_size=2).engine.executor.describe()
    target = sorted((w for w in workers if w["role"] == "target"), key=lambda w: w["rank"])
    draft = [w for w in workers if w["role"] == "draft"]
    assert [(w["rank"], w["world_size"], w["bundle_index"]) for w in target] == [(0, 2, 0), (1, 2, 1)]
    assert [(w["rank"], w["world_size"]) for w in draft] == [(0, 1)]
    assert {w["device"] for w in workers} == {"cpu"}
    assert len({w["pid"] for w in workers}) == 3
    assert target[0]["node_id"] == target[1]["node_id"]


@pytest.mark.slow
def test_tp4_pipelined_tree_with_a_tp2_draft(tp_models: TPModels, engines: Engines, in_process) -> None:
    # The draft (its own 2 ranks) works on round r+1 while the target's 4 ranks verify round r: replies of both
    # roles interleave. The thread count reaches every worker with its config.
    llm = engines.take("tp4-pipe-draft2", "tree", tensor_parallel_size=4, worker_threads=2,
                       spec_extra={"pipeline": True, "pipeline_switch": False, "draft_tensor_parallel_size": 2})
    try:
        workers = llm.engine.executor.describe()
        assert sorted((w["role"], w["rank"], w["world_size"], w["bundle_index"]) for w in workers) == [
            ("draft", 0, 2, 0), ("draft", 1, 2, 1), *[("target", r, 4, r) for r in range(4)]]
        assert {w["threads"] for w in workers} == {2}
        greedy, sampled = run(llm)
        assert greedy == tp_models.expected
        assert (greedy, sampled) == in_process("tree")
    finally:
        llm.shutdown()


def test_shutdown_leaves_no_actors_groups_or_processes(engines: Engines) -> None:
    engines.output("tp2-chain", "chain", tensor_parallel_size=2)  # used, not just started
    llm = engines.take("tp2-chain", "chain", tensor_parallel_size=2)
    workers = llm.engine.executor.describe()
    assert len(workers) == 3
    llm.shutdown()
    assert ray_leftovers(workers) == []
    llm.shutdown()  # twice is harmless


def test_worker_error_reaches_the_caller_and_shutdown_is_clean(engines: Engines) -> None:
    llm = engines.take("tp2-tree", "tree", tensor_parallel_size=2)
    executor = llm.engine.executor
    workers = executor.describe()
    greedy = SamplingSpec(temperature=0.0, top_k=-1, top_p=1.0, min_p=0.0, seed=1)
    bad = TargetStep(seqs=[VerifySeq(seq_id=999, block_table=[10**6], base_len=0, token_ids=[1], tree_tokens=[],
                                     tree_parents=[], sampling=greedy)])  # a block far outside the KV pool
    try:
        executor.submit_target(bad)
        with pytest.raises(RuntimeError, match="worker failed") as err:
            executor.wait_target()
        assert "target rank" in str(err.value) and "Traceback" in str(err.value)
    finally:
        llm.shutdown()
    assert ray_leftovers(workers) == []
