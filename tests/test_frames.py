"""Signed zmq frames (engine/execution/frames.py): only a holder of the engine's secret gets a frame through, once."""

from __future__ import annotations

from engine.execution.frames import FrameAuth, new_secret


def test_a_signed_frame_opens_and_only_once() -> None:
    key = new_secret()
    sender, receiver = FrameAuth(key, "sender"), FrameAuth(key, "receiver")
    frame = sender.seal([b"step", b"payload"])
    assert receiver.open(frame, 2) == [b"step", b"payload"]
    assert receiver.open(frame, 2) is None  # replayed
    assert receiver.open(sender.seal([b"step", b"next"]), 2) == [b"step", b"next"]
    assert receiver.dropped == 1


def test_forged_tampered_and_malformed_frames_are_dropped() -> None:
    key = new_secret()
    sender, receiver = FrameAuth(key, "sender"), FrameAuth(key, "receiver")
    frame = sender.seal([b"step", b"payload"])
    assert receiver.open([b"step", b"payload"], 2) is None  # unsigned
    assert receiver.open(FrameAuth(new_secret(), "other").seal([b"step", b"payload"]), 2) is None  # wrong key
    assert receiver.open([b"step", b"payloaX", *frame[2:]], 2) is None  # tampered payload
    assert receiver.open([b"stepp", b"ayload", *frame[2:]], 2) is None  # parts re-split: lengths are signed
    assert receiver.open([b"step", b"payload", frame[2], frame[3][:-1] + bytes([frame[3][-1] ^ 1])], 2) is None  # mac
    assert receiver.open(frame, 3) is None  # wrong number of parts
    assert receiver.dropped == 6
    assert receiver.open(frame, 2) == [b"step", b"payload"]  # the genuine one still passes


def test_each_sender_has_its_own_sequence() -> None:
    key = new_secret()
    a, b, receiver = FrameAuth(key, "a"), FrameAuth(key, "b"), FrameAuth(key, "receiver")
    fa, fb = a.seal([b"x"]), b.seal([b"y"])  # both sequence number 1
    assert receiver.open(fb, 1) == [b"y"] and receiver.open(fa, 1) == [b"x"]
