"""Signed zmq frames: only peers holding the engine's secret can make a worker or the controller act.

Every multipart frame travels as ``parts + [tag, mac]``: ``tag`` is the sender's random nonce (8 bytes) and a
sequence number (8 bytes, big-endian), ``mac`` the HMAC-SHA256 under the per-engine secret of every part
(length-prefixed, so parts cannot be re-split) and the tag. The receiver checks the MAC with
``hmac.compare_digest`` before anything is decoded, and refuses a sequence number it has already passed for that
sender (a replayed frame). A refused frame is logged and dropped, never acted on.

The secret is drawn per engine (``secrets.token_bytes``) and reaches the workers as an actor constructor
argument, i.e. through Ray's own (token-authenticated) channel, never through the sockets it protects.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import secrets
import struct

log = logging.getLogger("specserve.frames")

SECRET_BYTES = 32
_TAG = struct.Struct(">8sQ")  # sender nonce, sequence number


def new_secret() -> bytes:
    return secrets.token_bytes(SECRET_BYTES)


class FrameAuth:
    """Seals outgoing frames and opens incoming ones for one socket owner (thread-confined, like the socket)."""

    def __init__(self, secret: bytes, name: str) -> None:
        if len(secret) < 16:
            raise ValueError("the frame secret must be at least 16 bytes")
        self._secret = secret
        self._name = name  # for the log: whose socket dropped the frame
        self._nonce = secrets.token_bytes(8)
        self._seq = 0
        self._last_seen: dict[bytes, int] = {}  # sender nonce -> highest sequence number accepted
        self.dropped = 0

    def _mac(self, parts: list[bytes], tag: bytes) -> bytes:
        h = hmac.new(self._secret, digestmod=hashlib.sha256)
        for p in parts:
            h.update(len(p).to_bytes(8, "big"))
            h.update(p)
        h.update(tag)
        return h.digest()

    def seal(self, parts: list[bytes]) -> list[bytes]:
        self._seq += 1
        tag = _TAG.pack(self._nonce, self._seq)
        return [*parts, tag, self._mac(parts, tag)]

    def open(self, frame: list[bytes], num_parts: int) -> list[bytes] | None:
        """The frame's ``num_parts`` payload parts if it is signed with our secret and new; None (logged) if not."""
        if len(frame) != num_parts + 2 or len(frame[-2]) != _TAG.size:
            return self._drop(f"{len(frame)} parts, expected {num_parts} + tag + mac")
        *parts, tag, mac = (bytes(p) for p in frame)
        if not hmac.compare_digest(mac, self._mac(parts, tag)):
            return self._drop("bad signature")
        nonce, seq = _TAG.unpack(tag)
        if seq <= self._last_seen.get(nonce, 0):
            return self._drop(f"replayed sequence number {seq}")
        self._last_seen[nonce] = seq
        return parts

    def _drop(self, why: str) -> None:
        self.dropped += 1
        log.warning("%s: dropped a frame that is not from this engine (%s)", self._name, why)
        return None
