"""One source of engine arguments: the CLI flags, LLM(...)'s keyword arguments and the configs agree."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import pytest

from engine import LLM
from engine.cli import main
from engine.core.args import EngineArgs
from engine.core.config import CacheConfig, ParallelConfig, default_model_dirs
from scheduler.scheduler import SchedulerConfig

# Every flag the CLI had before EngineArgs, as README commands and scripts spell them.
OLD_FLAGS = ["--target", "T", "--speculative-config", '{"model": "D"}', "--tokenizer", "tok", "--dtype", "float16",
             "--device", "cuda", "--max-model-len", "100", "--max-num-seqs", "3", "--max-num-batched-tokens", "70",
             "--block-size", "8", "--num-kv-tokens", "640", "-tp", "2", "--address", "ray://h:1", "--transport",
             "ray", "--placement-timeout", "5.5", "--distributed-executor-backend", "ray"]


def _parser() -> argparse.ArgumentParser:
    return EngineArgs.add_cli_args(argparse.ArgumentParser())


def test_every_old_flag_parses_into_its_field() -> None:
    args = EngineArgs.from_cli_args(_parser().parse_args(OLD_FLAGS))
    assert args == EngineArgs(target="T", speculative_config='{"model": "D"}', tokenizer="tok", dtype="float16",
                              device="cuda", max_model_len=100, max_num_seqs=3, max_num_batched_tokens=70,
                              block_size=8, num_kv_tokens=640, tensor_parallel_size=2, address="ray://h:1",
                              transport="ray", placement_timeout_s=5.5, distributed_executor_backend="ray")
    assert _parser().parse_args(["--tensor-parallel-size", "4"]).tensor_parallel_size == 4
    with pytest.raises(SystemExit):
        _parser().parse_args(["--transport", "carrier-pigeon"])


def test_defaults_are_the_configs_own() -> None:
    assert EngineArgs.from_cli_args(_parser().parse_args([])) == EngineArgs()
    cfg = EngineArgs(speculative_config="none").to_engine_config()
    assert cfg.scheduler == SchedulerConfig() and cfg.parallel == ParallelConfig()
    assert cfg.cache == CacheConfig() and cfg.speculative is None
    assert "(default: 64)" in _parser().format_help()  # help shows the default where it comes from


def test_llm_takes_the_same_keywords() -> None:
    names = {f.name for f in dataclasses.fields(EngineArgs)}
    assert {"max_num_seqs", "block_size", "num_kv_tokens", "tensor_parallel_size", "transport",
            "placement_timeout_s", "distributed_executor_backend"} <= names
    with pytest.raises(TypeError, match="max_num_seq"):
        LLM(max_num_seq=4)
    llm = LLM(speculative_config='{"num_speculative_tokens": 6}', max_num_seqs=3, block_size=8)
    assert llm.engine.config.speculative.num_speculative_tokens == 6
    assert llm.engine.config.speculative.model == default_model_dirs()[1]
    assert llm.engine.config.scheduler.max_num_seqs == 3 and llm.engine.config.cache.block_size == 8


def test_step_timeout_and_threads_are_flags_and_reach_the_workers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPECSERVE_STEP_TIMEOUT_S", "45")  # the CLI's default from the environment
    cfg = EngineArgs.from_cli_args(_parser().parse_args(["--worker-threads", "2", "--speculative-config", "none"]))
    assert cfg.to_engine_config().parallel == ParallelConfig(step_timeout_s=45.0, worker_threads=2)
    assert _parser().parse_args(["--step-timeout", "9"]).step_timeout_s == 9.0
    for bad in ({"step_timeout_s": 0}, {"worker_threads": 0}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            ParallelConfig(**bad)
    monkeypatch.delenv("SPECSERVE_STEP_TIMEOUT_S")
    with LLM(speculative_config="none", step_timeout_s=7.0, worker_threads=2) as llm:
        target = llm.engine.executor.target
        assert target.law_store.timeout_s == 7.0 and target.config.num_threads == 2


def test_builtin_pair_with_a_config_that_only_sets_k(tmp_path: Path) -> None:
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text(json.dumps({"prompt": "def add(a, b):", "max_tokens": 8, "temperature": 0}) + "\n")
    assert main(["generate", "--input", str(src), "--output", str(dst), "--no-progress",
                 "--speculative-config", '{"num_speculative_tokens": 6}']) == 0
    out = json.loads(dst.read_text())
    assert len(out["token_ids"]) == 8 and out["metrics"]["drafted_tokens"] > 0
    cfg = EngineArgs(speculative_config={"num_speculative_tokens": 2, "tree_branching": [2, 1]}).to_engine_config()
    assert cfg.speculative.model == default_model_dirs()[1] and cfg.speculative.tree_shape.num_nodes == 4
    with pytest.raises(ValueError, match="speculative_config.model is required"):  # a target of one's own
        EngineArgs(target=default_model_dirs()[0], speculative_config={"num_speculative_tokens": 2}).to_engine_config()


def test_a_model_path_that_is_a_file_says_so(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    weights = Path(default_model_dirs()[0]) / "model.safetensors"
    with pytest.raises(ValueError, match=r"target model '.*model.safetensors' is a file; expected a model directory"):
        EngineArgs(target=str(weights)).to_engine_config()
    with pytest.raises(ValueError, match=r"speculative_config.model '.*' is a file"):
        EngineArgs(speculative_config={"model": str(weights)}).to_engine_config()
    src = tmp_path / "in.jsonl"
    src.write_text('{"prompt": "x"}\n')
    assert main(["generate", "--input", str(src), "--output", str(tmp_path / "o"), "--target", str(weights)]) == 2
    assert "is a file" in capsys.readouterr().err
