"""`specserve generate` survives being killed: results stream out in input order and --resume finishes the job.

Runs on the built-in pair with tiny max_tokens, so the whole file stays a few seconds of engine time.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from engine.cli import main
from engine.core.config import DEFAULT_MODELS_DIR

N_LINES = 24


def _job(tmp_path: Path) -> Path:
    shipped = [json.loads(ln) for ln in (DEFAULT_MODELS_DIR / "prompts.jsonl").read_text().splitlines()]
    # Short prompts (the shipped ones' first 40 characters): prefill is most of the CPU time.
    lines = [json.dumps({"id": f"r{i:02d}", "prompt": shipped[i % len(shipped)]["prompt"][:40], "temperature": 0,
                         "max_tokens": 8 + i % 5, "ignore_eos": True}) for i in range(N_LINES)]
    lines[5] = '{"id": "bad", "prompt": "x", "top_k": -2}'  # an error line is part of the output like any other
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join(lines) + "\n")
    return src


def _core(path: Path) -> list[dict]:
    """Output lines without timing metrics (greedy tokens and text must match exactly)."""
    rows = [json.loads(ln) for ln in path.read_text().splitlines()]
    return [{k: v for k, v in r.items() if k != "metrics"} for r in rows]


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_a_kill_keeps_a_prefix_in_order_and_resume_finishes_it(tmp_path: Path, sig: signal.Signals) -> None:
    src = _job(tmp_path)
    ref, out = tmp_path / "ref.jsonl", tmp_path / "out.jsonl"
    # max-num-seqs 2: results come out a few at a time, so the kill lands in the middle of the job.
    flags = ["--input", str(src), "--no-progress", "--max-num-seqs", "2"]
    assert main(["generate", *flags, "--output", str(ref)]) == 1  # the bad line makes the status 1
    expected = _core(ref)
    assert len(expected) == N_LINES and "top_k" in expected[5]["error"]

    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    proc = subprocess.Popen([sys.executable, "-m", "engine.cli", "generate", *flags, "--output", str(out)],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:
            if out.exists() and out.read_bytes().count(b"\n") >= 8:
                break
            time.sleep(0.02)
        assert proc.poll() is None, f"finished before the kill: {proc.stderr.read().decode()[-2000:]}"
        proc.send_signal(sig)
        if sig == signal.SIGTERM:  # handled: the workers shut down, the status says so
            assert proc.wait(timeout=60) == 143
    finally:
        proc.kill()
        proc.wait(timeout=30)
    partial = _core(out)
    assert 8 <= len(partial) < N_LINES
    assert partial == expected[:len(partial)]  # every line written survived, in input order
    with out.open("a") as f:
        f.write('{"id": "r2')  # as if the kill had landed mid-line: --resume drops the torn line

    assert main(["generate", *flags, "--output", str(out), "--resume"]) == 1
    assert _core(out) == expected  # == an uninterrupted run: nothing twice, nothing lost


def test_resume_refuses_an_output_of_another_input(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = _job(tmp_path)
    out = tmp_path / "out.jsonl"
    out.write_text(json.dumps({"id": "someone-else", "token_ids": [1]}) + "\n")
    assert main(["generate", "--input", str(src), "--output", str(out), "--resume", "--no-progress"]) == 2
    assert "has id 'someone-else' but input line 1 has 'r00'" in capsys.readouterr().err


def test_unwritable_output_fails_before_the_model_loads(tmp_path: Path, capsys, monkeypatch) -> None:
    import engine.cli as cli

    def no_load(*a, **k):
        raise AssertionError("the model was loaded before the output path was checked")

    monkeypatch.setattr(cli, "LLMEngine", no_load)
    src = _job(tmp_path)
    assert main(["generate", "--input", str(src), "--output", str(tmp_path / "no" / "such" / "dir.jsonl")]) == 2
    assert "dir.jsonl" in capsys.readouterr().err


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full to fill the disk")
def test_a_full_disk_is_exit_status_3(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"id": "a", "prompt": "def f():", "max_tokens": 2}) + "\n")
    assert main(["generate", "--input", str(src), "--output", "/dev/full", "--no-progress"]) == 3
    assert "rerun with --resume" in capsys.readouterr().err


def test_lines_are_split_on_newline_only_and_decoded_one_by_one(tmp_path: Path) -> None:
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    good = {"prompt": "def f():\u2028\u0085\r\x0c  return 1", "max_tokens": 2, "temperature": 0}
    src.write_bytes(b"\xef\xbb\xbf" + b"\n".join([
        json.dumps({"id": "sep", **good}, ensure_ascii=False).encode(),  # separators inside a JSON string
        b'{"id": "latin1", "prompt": "caf\xe9"}',  # not UTF-8
        b"[" * 100_000,  # nests too deep for the parser
        json.dumps({"id": "surrogate", "prompt": "a\ud800b"}).encode(),  # a lone surrogate, escaped
        json.dumps({"id": "ok", "prompt": "x = 1", "max_tokens": 1}).encode(),
    ]) + b"\r\n")
    assert main(["generate", "--input", str(src), "--output", str(out), "--no-progress"]) == 1
    rows = [json.loads(ln) for ln in out.read_text().splitlines()]
    assert [r["id"] for r in rows] == ["sep", "2", "3", "surrogate", "ok"]  # unreadable lines: their line number
    assert len(rows[0]["token_ids"]) == 2 and "error" not in rows[0]
    assert "line 2: not valid UTF-8" in rows[1]["error"]
    assert "nested too deeply" in rows[2]["error"]
    assert "not valid Unicode text" in rows[3]["error"]
    assert len(rows[4]["token_ids"]) == 1
