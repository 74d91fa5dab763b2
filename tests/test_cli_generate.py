"""`specserve generate` (the README's main job) on the built-in pair: input order, per-line errors, summary."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.cli import main
from engine.core.config import DEFAULT_MODELS_DIR


def test_generate_on_the_builtin_pair_with_bad_lines(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    shipped = [json.loads(line) for line in (DEFAULT_MODELS_DIR / "prompts.jsonl").read_text().splitlines()[:3]]
    lines = [
        json.dumps({**shipped[0], "max_tokens": 16, "ignore_eos": True}),
        "{not json",
        json.dumps({"id": "unknown", "prompt": "def f():", "temprature": 0.5}),
        json.dumps({**shipped[1], "max_tokens": 16, "temperature": 0.0, "ignore_eos": True}),
        json.dumps({"id": "top_p", "prompt": "def f():", "top_p": 0}),
        json.dumps({"id": "vocab", "prompt_token_ids": [1, 99999]}),
        "",
        json.dumps({"id": shipped[2]["id"], "prompt": shipped[2]["prompt"], "max_tokens": 16, "seed": 3,
                    "ignore_eos": True}),
    ]
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("\n".join(lines) + "\n")
    assert main(["generate", "--input", str(src), "--output", str(dst), "--no-progress"]) == 1  # error lines
    out = [json.loads(line) for line in dst.read_text().splitlines()]
    assert [o["id"] for o in out] == [shipped[0]["id"], "2", "unknown", shipped[1]["id"], "top_p", "vocab",
                                     shipped[2]["id"]]  # input order; the blank line is skipped
    assert "malformed JSON" in out[1]["error"]
    assert "temprature" in out[2]["error"]
    assert "top_p" in out[4]["error"]
    assert "prompt_token_ids" in out[5]["error"] and "4096" in out[5]["error"]
    for o in (out[0], out[3], out[6]):
        assert "error" not in o and len(o["token_ids"]) == 16 and o["finish_reason"] == "length"
        assert isinstance(o["text"], str) and o["text"]
        assert o["metrics"]["rounds"] > 0  # speculation is on by default
    summary = json.loads(capsys.readouterr().err.strip().splitlines()[-1])
    assert summary["requests"] == 7 and summary["errors"] == 4 and summary["generated_tokens"] == 48
    assert summary["speculation"]["mean_acceptance_length"] > 1.5  # a trained draft, not a random one


def test_generate_reports_a_missing_input_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", "--input", str(tmp_path / "nope.jsonl"), "--output", str(tmp_path / "o")]) == 2
    assert "nope.jsonl" in capsys.readouterr().err


def test_a_failing_worker_keeps_finished_results_and_stops_the_engine(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    import engine.core.llm_engine
    from engine import LLM, SamplingParams
    from engine.core.llm_engine import EngineDeadError
    from workers.target_worker import TargetWorker

    real_step, real_warm_up = TargetWorker.step, engine.core.llm_engine.warm_up_policy
    calls = {"n": 0, "warming": False}

    def failing_step(self, msg):  # the third target step of the user's requests fails, as a dying worker would
        if not calls["warming"]:  # (the adaptive policy's start-up profiling steps are not counted)
            calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("boom")
        return real_step(self, msg)

    def warm_up(*args, **kwargs):
        calls["warming"] = True
        try:
            return real_warm_up(*args, **kwargs)
        finally:
            calls["warming"] = False

    monkeypatch.setattr(TargetWorker, "step", failing_step)
    monkeypatch.setattr(engine.core.llm_engine, "warm_up_policy", warm_up)
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("\n".join([json.dumps({"id": "short", "prompt": "def f():", "max_tokens": 1}),
                              "{bad",
                              json.dumps({"id": "long", "prompt": "def g():", "max_tokens": 64})]) + "\n")
    assert main(["generate", "--input", str(src), "--output", str(dst), "--no-progress"]) == 1
    out = [json.loads(line) for line in dst.read_text().splitlines()]
    assert [o["id"] for o in out] == ["short", "2", "long"]
    assert len(out[0]["token_ids"]) == 1 and "error" not in out[0]  # finished before the failure: kept
    assert "malformed JSON" in out[1]["error"]
    assert "not finished" in out[2]["error"] and "boom" in out[2]["error"]
    err = capsys.readouterr().err
    assert '"engine_error": "RuntimeError: boom"' in err and "specserve: error" in err

    calls["n"] = 0
    with LLM() as llm:
        with pytest.raises(RuntimeError, match="boom"):
            llm.generate(["def h():"], SamplingParams(max_tokens=32))
        # Worker and controller state may now disagree: every later call says so instead of running on it.
        with pytest.raises(EngineDeadError, match="boom"):
            llm.generate(["def h():"], SamplingParams(max_tokens=4))
        with pytest.raises(EngineDeadError):
            llm.engine.step()
