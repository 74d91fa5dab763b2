"""The JSONL batch job behind ``specserve generate``: parse lines, run them all, write results in input order.

A bad line (malformed JSON, an unknown field, a value out of range, a prompt too long) gets an error line of
its own; every other request still completes. If the engine itself fails mid-job, the requests that finished
are still written and the unfinished ones get an error line.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass
from typing import IO, Any

from engine.llm_engine import LLMEngine
from engine.outputs import RequestOutput
from scheduler.sampling_params import SamplingParams

REQUEST_FIELDS = ("id", "prompt", "prompt_token_ids")
SAMPLING_FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids",
                   "ignore_eos")


@dataclass
class ParsedLine:
    index: int  # 0-based position among the non-blank lines
    request_id: str
    prompt: str | list[int] | None = None
    params: SamplingParams | None = None
    error: str | None = None


def parse_line(index: int, line: str, defaults: dict[str, Any]) -> ParsedLine:
    fallback_id = str(index)
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        return ParsedLine(index, fallback_id, error=f"line {index + 1}: malformed JSON: {e}")
    if not isinstance(obj, dict):
        return ParsedLine(index, fallback_id, error=f"line {index + 1}: expected a JSON object")
    rid = str(obj.get("id", fallback_id))
    unknown = sorted(set(obj) - set(REQUEST_FIELDS) - set(SAMPLING_FIELDS))
    if unknown:
        return ParsedLine(index, rid, error=f"unknown field(s) {unknown}; allowed: "
                                            f"{sorted(REQUEST_FIELDS + SAMPLING_FIELDS)}")
    has_text, has_ids = "prompt" in obj, "prompt_token_ids" in obj
    if has_text == has_ids:
        return ParsedLine(index, rid, error="exactly one of 'prompt' or 'prompt_token_ids' is required")
    prompt = obj["prompt"] if has_text else obj["prompt_token_ids"]
    if has_text and not isinstance(prompt, str):
        return ParsedLine(index, rid, error="prompt must be a string")
    if has_ids and not (isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool)
                                                         for t in prompt)):
        return ParsedLine(index, rid, error="prompt_token_ids must be a list of integers")
    try:
        params = SamplingParams(**{**defaults, **{k: obj[k] for k in SAMPLING_FIELDS if k in obj}})
    except (TypeError, ValueError) as e:
        return ParsedLine(index, rid, error=str(e))
    return ParsedLine(index, rid, prompt, params)


def output_line(out: RequestOutput) -> dict[str, Any]:
    line: dict[str, Any] = {"id": out.request_id, "token_ids": out.token_ids}
    if out.text is not None:
        line["text"] = out.text
    line["finish_reason"] = out.finish_reason
    line["metrics"] = out.metrics
    return line


def run_batch(engine: LLMEngine, lines: list[str], out: IO[str], defaults: dict[str, Any],
              progress: bool = True) -> dict[str, Any]:
    """Runs every request; returns a summary (counts, tokens/s, speculation statistics)."""
    parsed = [parse_line(i, ln, defaults) for i, ln in enumerate(ln for ln in lines if ln.strip())]
    results: dict[int, dict[str, Any]] = {}
    key_of: dict[str, int] = {}
    for p in parsed:
        if p.error is None:
            try:
                # Engine-internal ids are the line index, so duplicate user ids cannot collide.
                engine.add_request(str(p.index), p.prompt, p.params)
                key_of[str(p.index)] = p.index
            except ValueError as e:
                p.error = str(e)
        if p.error is not None:
            results[p.index] = {"id": p.request_id, "error": p.error}
    bar = None
    if progress:
        from tqdm import tqdm
        bar = tqdm(total=len(key_of), desc="generate", unit="req", file=sys.stderr)
    start = time.perf_counter()
    generated = 0
    failure: Exception | None = None
    try:
        while engine.has_unfinished:
            for o in engine.step_finished():
                idx = key_of[o.request_id]
                o.request_id = parsed[idx].request_id
                results[idx] = output_line(o)
                generated += len(o.token_ids)
                if bar is not None:
                    bar.update(1)
    except Exception as e:
        # The engine is dead (EngineDeadError from now on), but the requests that finished are kept: they
        # are written with the others, and only the unfinished ones get an error line.
        failure = e
    elapsed = time.perf_counter() - start
    if bar is not None:
        bar.close()
    for i, p in enumerate(parsed):
        if i not in results:
            results[i] = {"id": p.request_id, "error": f"not finished: the engine failed ({type(failure).__name__}: "
                                                      f"{failure})"}
        out.write(json.dumps(results[i]) + "\n")
    return {
        "requests": len(parsed),
        "errors": sum(1 for r in results.values() if "error" in r),
        **({"engine_error": f"{type(failure).__name__}: {failure}"} if failure is not None else {}),
        "generated_tokens": generated,
        "elapsed_s": round(elapsed, 3),
        "output_tokens_per_s": round(generated / elapsed, 2) if elapsed > 0 else None,
        "speculation": engine.stats.as_dict(),
        "time_breakdown": engine.times.as_dict(),
        **({"pipeline": engine.pipeline.stats.as_dict()} if engine.pipeline is not None else {}),
        **({"faults": engine.recovery.stats.as_dict()} if engine.recovery is not None else {}),
    }
