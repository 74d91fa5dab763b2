"""What signing the zmq frames adds to a round: HMAC-SHA256 seal + check of a realistic step and its reply.

Per round on the zmq transport the controller seals the step once, every rank checks it (in parallel, so
one check is on the critical path), rank 0 seals its reply and the controller checks it. This times exactly
that work, in one process, for the messages engine/benchmarks/transport.py sends (compare with its round trips).

    python -m engine.benchmarks.frame_auth [--rounds 200]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from engine import codec
from engine.benchmarks.transport import make_step
from engine.frames import FrameAuth, new_secret
from engine.worker_actor import _echo_result
from workers.messages import WorkerReply


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=200)
    ap.add_argument("--vocab", type=int, default=4096)
    args = ap.parse_args(argv)
    key = new_secret()
    rows = []
    for batch in (1, 32):
        for sampled in (False, True):
            msg = make_step(batch, sampled, args.vocab)
            step = codec.encode(msg)
            reply = codec.encode(WorkerReply(result=_echo_result(msg)))
            controller, worker = FrameAuth(key, "controller"), FrameAuth(key, "worker")
            times = []
            for _ in range(args.rounds):
                t0 = time.perf_counter()
                assert worker.open(controller.seal([b"step", step]), 2) is not None
                assert controller.open(worker.seal([b"target/1", b"0", reply]), 3) is not None
                times.append(time.perf_counter() - t0)
            times.sort()
            rows.append({"batch": batch, "law": "sampled" if sampled else "greedy", "step_bytes": len(step),
                         "reply_bytes": len(reply), "median_us": round(statistics.median(times) * 1e6, 1),
                         "p90_us": round(times[int(0.9 * len(times))] * 1e6, 1)})
    for r in rows:
        print(json.dumps(r))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
