"""The errors the client raises: the server answered with an error status."""

from __future__ import annotations

from typing import Any

import httpx


class APIError(Exception):
    """The server answered with an error."""

    def __init__(self, status_code: int, message: str, body: Any = None) -> None:
        super().__init__(f"HTTP {status_code}: {message}")
        self.status_code, self.message, self.body = status_code, message, body


class RequestError(APIError):
    """4xx: the request is wrong (the message names the field); retrying will not help."""


class ServerError(APIError):
    """5xx that did not go away within the retry budget."""


def error_of(resp: httpx.Response) -> APIError:
    try:
        body = resp.json()
        message = body.get("error", {}).get("message") or resp.text
    except (ValueError, AttributeError):
        body, message = None, resp.text
    cls = RequestError if 400 <= resp.status_code < 500 else ServerError
    return cls(resp.status_code, message, body)
