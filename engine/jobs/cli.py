"""``specserve batch submit|status|wait|results|cancel``: batch jobs on a running ``specserve serve``.

Every command retries through a server restart (429 / 503 / refused connections, for ``--retry-timeout``
seconds), so ``specserve batch wait ID`` outlives a crashed-and-restarted server. Exit status: 0 success
(``wait``: the job completed); 1 the job ended failed, cancelled or expired; 2 a bad request or an
unreachable server.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from engine.client import APIError, Client


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser("batch", help="OpenAI-style batch jobs on a running server (submit, wait, results)")
    p.add_argument("--url", default=os.environ.get("SPECSERVE_URL", "http://127.0.0.1:8000"),
                   help="the server (default: $SPECSERVE_URL or http://127.0.0.1:8000)")
    p.add_argument("--api-key", default=os.environ.get("SPECSERVE_API_KEY"), help="default: $SPECSERVE_API_KEY")
    p.add_argument("--retry-timeout", type=float, default=300.0,
                   help="seconds to keep retrying while the server is unreachable or busy")
    sub = p.add_subparsers(dest="batch_command", required=True)
    s = sub.add_parser("submit", help="upload an OpenAI batch input file and start a job; prints the job id")
    s.add_argument("input", help="JSONL, one {custom_id, method, url, body} per line")
    s.add_argument("--endpoint", default="/v1/completions", choices=["/v1/completions", "/v1/chat/completions"])
    s.add_argument("--metadata", default=None, help='JSON object of strings, e.g. \'{"project": "x"}\'')
    for name, text in (("status", "print the job (JSON)"), ("cancel", "cancel the job; finished results are kept")):
        c = sub.add_parser(name, help=text)
        c.add_argument("id")
    w = sub.add_parser("wait", help="wait for the job to end, with a progress bar; prints the final job (JSON)")
    w.add_argument("id")
    w.add_argument("--poll", type=float, default=1.0, help="seconds between status checks")
    w.add_argument("--no-progress", action="store_true")
    r = sub.add_parser("results", help="write the job's output file (and optionally its error file)")
    r.add_argument("id")
    r.add_argument("-o", "--output", required=True, help="where to write the output lines (JSONL)")
    r.add_argument("--errors", default=None, help="where to write the error lines (JSONL)")
    p.set_defaults(func=cmd_batch)
    return p


def _download(client: Client, file_id: str | None, path: str) -> int:
    n = 0
    with open(path, "w", encoding="utf-8") as f:
        if file_id:
            for row in client._lines(file_id):
                f.write(json.dumps(row) + "\n")
                n += 1
    return n


def cmd_batch(args: argparse.Namespace) -> int:
    with Client(args.url, args.api_key, retry_timeout_s=args.retry_timeout) as client:
        try:
            return _run(client, args)
        except APIError as e:
            print(f"specserve: error: {e}", file=sys.stderr)
            return 2


def _run(client: Client, args: argparse.Namespace) -> int:
    cmd = args.batch_command
    if cmd == "submit":
        metadata = json.loads(args.metadata) if args.metadata else None
        job = client.submit_batch(args.input, endpoint=args.endpoint, metadata=metadata)
        print(job.id)
        return 0
    job = client.job(args.id)
    if cmd == "status":
        print(json.dumps(job.status(), indent=2))
        return 0
    if cmd == "cancel":
        print(json.dumps(job.cancel(), indent=2))
        return 0
    if cmd == "wait":
        b = job.wait(progress=not args.no_progress, poll_s=args.poll)
        print(json.dumps(b, indent=2))
        return 0 if b["status"] == "completed" else 1
    b = job.status()  # results
    n = _download(client, b.get("output_file_id"), args.output)
    msg = f"{n} result lines written to {args.output}"
    if args.errors:
        msg += f", {_download(client, b.get('error_file_id'), args.errors)} error lines to {args.errors}"
    print(msg, file=sys.stderr)
    return 0
