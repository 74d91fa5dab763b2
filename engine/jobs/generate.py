"""The JSONL batch job behind ``specserve generate``: stream lines in, write results in input order as they finish.

Durability: each result is written and flushed as soon as every line before it is written, so a job killed at
any moment (SIGKILL included) leaves a prefix of the full output, in order; ``--resume`` continues after it.
Memory is bounded: at most ``window`` lines are read ahead of the last one written, so neither the input nor
the results are ever held whole.

A bad line (not UTF-8, malformed or too deeply nested JSON, an unknown field, a value out of range, a prompt the
tokenizer refuses or too long) gets an error line of its own; every other request still completes. If the
engine itself fails mid-job, the requests that finished are still written and the unfinished ones get an error
line starting with ``not finished:`` (``--resume`` runs those again).
"""

from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import IO, Any

from engine.core.llm_engine import EngineDeadError, LLMEngine
from engine.core.outputs import Logprob, RequestOutput
from engine.jobs.jsonl import JsonlLine, loads
from scheduler.sampling_params import SamplingParams

REQUEST_FIELDS = ("id", "prompt", "prompt_token_ids")
SAMPLING_FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids",
                   "ignore_eos", "logprobs", "prompt_logprobs", "logprobs_mode", "structured_outputs")
NOT_FINISHED = "not finished:"


class OutputWriteError(OSError):
    """The output file could not be written (disk full, file system gone): lines written so far are intact."""


@dataclass
class ParsedLine:
    index: int  # 0-based position among the non-blank lines
    request_id: str
    prompt: str | list[int] | None = None
    params: SamplingParams | None = None
    error: str | None = None
    line: int = 0  # 1-based line number in the input file


def parse_line(index: int, line: str | JsonlLine, defaults: dict[str, Any]) -> ParsedLine:
    """One input line; a line without an id (or whose id cannot be read) is known by its 1-based line number,
    and every error names that line."""
    number = line.number if isinstance(line, JsonlLine) else index + 1
    fallback_id = str(number)

    def failed(rid: str, message: str) -> ParsedLine:
        return ParsedLine(index, rid, error=message if message.startswith(f"line {number}:")
                          else f"line {number}: {message}", line=number)

    if isinstance(line, JsonlLine):
        if line.text is None:
            return failed(fallback_id, line.error or "not valid UTF-8")
        line = line.text
    try:
        obj = loads(line)
    except ValueError as e:
        return failed(fallback_id, f"malformed JSON: {e}")
    if not isinstance(obj, dict):
        return failed(fallback_id, "expected a JSON object")
    rid = obj.get("id", fallback_id)
    if not isinstance(rid, (str, int)) or isinstance(rid, bool):
        return failed(fallback_id, "id must be a string or an integer")
    rid = str(rid)
    unknown = sorted(set(obj) - set(REQUEST_FIELDS) - set(SAMPLING_FIELDS))
    if unknown:
        return failed(rid, f"unknown field(s) {unknown}; allowed: {sorted(REQUEST_FIELDS + SAMPLING_FIELDS)}")
    has_text, has_ids = "prompt" in obj, "prompt_token_ids" in obj
    if has_text == has_ids:
        return failed(rid, "exactly one of 'prompt' or 'prompt_token_ids' is required")
    prompt = obj["prompt"] if has_text else obj["prompt_token_ids"]
    if has_text and not isinstance(prompt, str):
        return failed(rid, "prompt must be a string")
    if has_ids and not (isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool)
                                                         for t in prompt)):
        return failed(rid, "prompt_token_ids must be a list of integers")
    try:
        params = SamplingParams(**{**defaults, **{k: obj[k] for k in SAMPLING_FIELDS if k in obj}})
    except (TypeError, ValueError) as e:
        return failed(rid, str(e))
    return ParsedLine(index, rid, prompt, params, line=number)


def output_line(out: RequestOutput) -> dict[str, Any]:
    line: dict[str, Any] = {"id": out.request_id, "token_ids": out.token_ids}
    if out.text is not None:
        line["text"] = out.text
    line["finish_reason"] = out.finish_reason
    if out.logprobs is not None:  # asked for: one per token of token_ids
        line["logprobs"] = [_logprob(e) for e in out.logprobs]
    if out.prompt_logprobs is not None:  # one per prompt token, the first null
        line["prompt_logprobs"] = [None if e is None else _logprob(e) for e in out.prompt_logprobs]
    line["metrics"] = out.metrics
    return line


def _logprob(e: Logprob) -> dict[str, Any]:
    """JSON has no -inf: a token the processed law cuts is -9999.0 (OpenAI's and vLLM's spelling)."""
    def v(x: float) -> float:
        return x if math.isfinite(x) else -9999.0

    return {"token_id": e.token_id, "logprob": v(e.logprob), "top": [[i, v(x)] for i, x in e.top]}


def _nonblank(lines: Iterable[str | JsonlLine]) -> Iterator[str | JsonlLine]:
    for ln in lines:
        if not (ln.blank if isinstance(ln, JsonlLine) else not ln.strip()):
            yield ln


class _OrderedWriter:
    """Writes results in input order as soon as the next one is ready; each line is flushed at once."""

    def __init__(self, out: IO[str], first_index: int) -> None:
        self.out = out
        self.next = first_index
        self.pending: dict[int, dict[str, Any]] = {}
        self.written = self.errors = 0

    def put(self, index: int, line: dict[str, Any]) -> None:
        self.pending[index] = line
        while self.next in self.pending:
            row = self.pending.pop(self.next)
            try:
                self.out.write(json.dumps(row) + "\n")  # ASCII: a lone surrogate in an id cannot fail
                self.out.flush()
            except OSError as e:
                raise OutputWriteError(e.errno, f"writing the output failed after {self.written} lines "
                                                f"({e.strerror or e})") from e
            self.written += 1
            self.errors += "error" in row
            self.next += 1


def run_batch(engine: LLMEngine, lines: Iterable[str | JsonlLine], out: IO[str], defaults: dict[str, Any],
              progress: bool = True, *, skip: int = 0, total: int | None = None,
              window: int | None = None) -> dict[str, Any]:
    """Runs every non-blank line after the first ``skip``; returns a summary (counts, tokens/s, speculation).

    ``window``: how many lines may be read ahead of the last one written (default 4 x max_num_seqs).
    Raises OutputWriteError when the output cannot be written; everything written before stays valid.
    """
    window = window or 4 * engine.config.scheduler.max_num_seqs
    source: Iterator[ParsedLine] = (parse_line(i, ln, defaults) for i, ln in enumerate(_nonblank(lines)))
    for _ in range(skip):
        next(source, None)
    writer = _OrderedWriter(out, skip)
    user_id: dict[str, ParsedLine] = {}  # engine id (the line index) -> the line; in flight only
    bar = None
    if progress:
        from tqdm import tqdm
        bar = tqdm(total=None if total is None else max(total - skip, 0), desc="generate", unit="req",
                   file=sys.stderr)
    start = time.perf_counter()
    generated = read = 0
    failure: Exception | None = None
    exhausted = False
    try:
        while True:
            # Read ahead while the window allows: parse errors are written at once, the rest queued.
            while not exhausted and (skip + read) - writer.next < window:
                p = next(source, None)
                if p is None:
                    exhausted = True
                    break
                read += 1
                if p.error is None:
                    try:
                        # Engine ids are the line index, so duplicate user ids cannot collide.
                        engine.add_request(str(p.index), p.prompt, p.params)
                        user_id[str(p.index)] = p
                    except EngineDeadError:
                        raise
                    except Exception as e:  # noqa: BLE001 - refused for this line only (ValueError, tokenizer)
                        p.error = f"line {p.line}: {e}"
                if p.error is not None:
                    writer.put(p.index, {"id": p.request_id, "error": p.error})
                    if bar is not None:
                        bar.update(1)
            if not engine.has_unfinished:
                if exhausted:
                    break
                continue
            for o in engine.step_finished():
                p = user_id.pop(o.request_id)
                o.request_id = p.request_id
                generated += len(o.token_ids)
                writer.put(p.index, output_line(o))
                if bar is not None:
                    bar.update(1)
    except OutputWriteError:
        raise
    except Exception as e:
        # The engine is dead (EngineDeadError from now on), but the requests that finished are kept: they
        # are written with the others, and every line not finished gets an error line.
        failure = e
    elapsed = time.perf_counter() - start
    if failure is not None:
        reason = f"{NOT_FINISHED} the engine failed ({type(failure).__name__}: {failure})"
        for p in user_id.values():
            writer.put(p.index, {"id": p.request_id, "error": reason})
        for p in source:
            writer.put(p.index, {"id": p.request_id, "error": p.error or reason})
    if bar is not None:
        bar.close()
    return {
        "requests": writer.written,
        "errors": writer.errors,
        **({"skipped": skip} if skip else {}),
        **({"engine_error": f"{type(failure).__name__}: {failure}"} if failure is not None else {}),
        "generated_tokens": generated,
        "elapsed_s": round(elapsed, 3),
        "output_tokens_per_s": round(generated / elapsed, 2) if elapsed > 0 else None,
        "speculation": engine.stats.as_dict(),
        "time_breakdown": engine.times.as_dict(),
        **({"pipeline": engine.pipeline.stats.as_dict()} if engine.pipeline is not None else {}),
        **({"faults": engine.recovery.stats.as_dict()} if engine.recovery is not None else {}),
    }


@dataclass
class ResumePoint:
    lines: int  # leading output lines kept
    errors: int  # how many of them are error lines


def resume_point(path: str, lines: Iterable[str | JsonlLine]) -> ResumePoint:
    """How many leading lines of an earlier run's output to keep; truncates the file after them.

    Kept: complete lines (a SIGKILL can leave the last one half-written) up to the first ``not finished`` error
    (the engine failed there: those lines run again). Each kept line's id must be the id its input line gets,
    or the output belongs to another input and ValueError says where they part.
    """
    kept_bytes = kept = errors = 0
    ids = (parse_line(i, ln, {}).request_id for i, ln in enumerate(_nonblank(lines)))
    with open(path, "rb") as f:
        for raw in f:
            if not raw.endswith(b"\n"):
                break  # half-written by a killed run
            try:
                row = json.loads(raw)
            except ValueError:
                row = None
            if not isinstance(row, dict):
                raise ValueError(f"--resume: line {kept + 1} of {path} is not a result line")
            if isinstance(row.get("error"), str) and row["error"].startswith(NOT_FINISHED):
                break
            expected = next(ids, None)
            if row.get("id") != expected:
                raise ValueError(f"--resume: line {kept + 1} of {path} has id {row.get('id')!r} but input line "
                                 f"{kept + 1} has {expected!r}: the output is from another input")
            kept += 1
            errors += "error" in row
            kept_bytes += len(raw)
    with open(path, "r+b") as f:
        f.truncate(kept_bytes)
    return ResumePoint(kept, errors)
