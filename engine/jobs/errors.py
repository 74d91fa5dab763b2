"""What the job store refuses: the HTTP layer maps these to 404 and 400."""

from __future__ import annotations


class NotFoundError(KeyError):
    """No such file or batch (HTTP 404)."""

    def __str__(self) -> str:
        return str(self.args[0])


class InvalidRequestError(ValueError):
    """A request the store refuses (HTTP 400), naming the field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param
