"""What signing the zmq frames adds: HMAC-SHA256 seal + check of one frame and of its reply, by frame size.

Per round on the zmq transport the controller seals a step once, every rank checks it (in parallel, so one
check is on the critical path), rank 0 seals its reply and the controller checks it; the draft's laws take
one more signed frame, draft rank 0 to target rank 0. Sizes: the steps of benchmarks/transport.py's
table (greedy B=1 and B=32; 82 KB and 2.6 MB are what one and 32 sampled requests' dense [5, 4096] float32 q
weigh, i.e. the largest law frames at that vocabulary).

    python -m benchmarks.frame_auth [--rounds 200]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

from engine.execution.frames import FrameAuth, new_secret

SIZES = (109, 3_030, 82_059, 2_625_336)
REPLY_BYTES = 1_015


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=200)
    args = ap.parse_args(argv)
    key = new_secret()
    reply = os.urandom(REPLY_BYTES)
    for size in SIZES:
        payload = os.urandom(size)
        sender, receiver = FrameAuth(key, "sender"), FrameAuth(key, "receiver")
        times = []
        for _ in range(args.rounds):
            t0 = time.perf_counter()
            assert receiver.open(sender.seal([b"step", payload]), 2) is not None
            assert sender.open(receiver.seal([b"target/1", b"0", reply]), 3) is not None
            times.append(time.perf_counter() - t0)
        times.sort()
        print(json.dumps({"frame_bytes": size, "reply_bytes": REPLY_BYTES,
                          "median_us": round(statistics.median(times) * 1e6, 1),
                          "p90_us": round(times[int(0.9 * len(times))] * 1e6, 1)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
