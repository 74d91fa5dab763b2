"""The maintained benchmark commands are reachable: ``specserve bench compare | serve | sweep | simulate`` through
the CLI's lazy dispatch, and ``python -m benchmarks.gguf_decode``; each answers ``--help`` with its own usage."""

from __future__ import annotations

import pytest

from engine.cli import main


@pytest.mark.parametrize("name", ["compare", "serve", "sweep", "simulate"])
def test_specserve_bench_dispatches_to_the_benchmark(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["bench", name, "--help"])
    assert exit_.value.code == 0
    assert f"usage: specserve bench {name}" in capsys.readouterr().out


def test_gguf_decode_usage(capsys: pytest.CaptureFixture[str]) -> None:
    from benchmarks.gguf_decode import main as gguf_main

    with pytest.raises(SystemExit) as exit_:
        gguf_main(["--help"])
    assert exit_.value.code == 0
    assert "usage: python -m benchmarks.gguf_decode" in capsys.readouterr().out
