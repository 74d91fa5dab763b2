"""What one line of a batch input file may be, and the rows of the output and error files (OpenAI's format).

Output rows: ``{"id": "batch_req_...", "custom_id", "response": {"status_code", "request_id", "body"}, "error"}``;
``response`` is null and ``error`` is ``{"code", "message"}`` for a request that never got an HTTP answer (an
unreadable line, an expired job, a server error).
"""

from __future__ import annotations

import json
import secrets
from typing import Any

from engine.jobs.jsonl import JsonlLine, loads


def new_id(prefix: str) -> str:
    return f"{prefix}{secrets.token_hex(12)}"


MISSING = object()  # a line with no usable custom_id


def validation_error(code: str, message: str, param: str | None = None,
                     line: int | None = None) -> dict[str, Any]:
    """One entry of a failed batch's ``errors.data`` (OpenAI's shape)."""
    return {"code": code, "message": message, "param": param, "line": line}


def error_row(custom_id: str | None, code: str, message: str) -> dict[str, Any]:
    """An output row for a request that never got an HTTP response (OpenAI's ``error`` field)."""
    return {"id": new_id("batch_req_"), "custom_id": custom_id, "response": None,
            "error": {"code": code, "message": message}}


def response_row(custom_id: str, status_code: int, body: dict[str, Any]) -> dict[str, Any]:
    """An output row for a request that got an HTTP response (a 200 in the output file, others in errors)."""
    return {"id": new_id("batch_req_"), "custom_id": custom_id,
            "response": {"status_code": status_code, "request_id": new_id("req_"), "body": body}, "error": None}


def at_line(body: dict[str, Any], line: int) -> dict[str, Any]:
    """An error response body whose message starts with the input line it came from (``line 12: ...``)."""
    err = body.get("error")
    if not line or not isinstance(err, dict) or not isinstance(err.get("message"), str):
        return body
    return {**body, "error": {**err, "message": f"line {line}: {err['message']}"}}


def expired_row(custom_id: str | None) -> dict[str, Any]:
    return error_row(custom_id, "batch_expired", "This request could not be executed before the completion window "
                                                 "expired.")


def check_line(ln: JsonlLine, endpoint: str) -> tuple[Any, str, str | None]:
    """(custom_id or MISSING, row state, error row as JSON or None) for one non-blank input line."""
    if ln.text is None:
        # Not UTF-8: the custom_id may still be readable (the bad bytes are usually in the prompt).
        return None, "failed", json.dumps(error_row(None, "invalid_utf8", ln.error))
    try:
        obj = loads(ln.text)
    except ValueError as e:
        return None, "failed", json.dumps(error_row(None, "invalid_json_line", f"line {ln.number}: {e}"))
    if not isinstance(obj, dict):
        return None, "failed", json.dumps(error_row(None, "invalid_json_line",
                                                    f"line {ln.number}: expected a JSON object"))
    cid = obj.get("custom_id")
    if not isinstance(cid, str) or not cid:
        return MISSING, "failed", None
    problem = None
    if obj.get("method", "POST") != "POST":
        problem = f"line {ln.number}: method must be 'POST', got {obj.get('method')!r}"
    elif obj.get("url") != endpoint:
        problem = f"line {ln.number}: url must be the batch's endpoint {endpoint!r}, got {obj.get('url')!r}"
    elif not isinstance(obj.get("body"), dict):
        problem = f"line {ln.number}: body must be a JSON object"
    if problem is not None:
        return cid, "failed", json.dumps(response_row(cid, 400, {"error": {
            "message": problem, "type": "invalid_request_error", "param": None, "code": "invalid_request"}}))
    return cid, "pending", None
