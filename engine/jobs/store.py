"""The durable job store behind the Batch API: SQLite (WAL) plus files under one data directory.

```
DATA_DIR/jobs.sqlite3     files, batches, and one row per batch request (state pending|done|failed, its result)
DATA_DIR/files/FILE_ID    uploaded inputs and the output / error files the runner writes
```

The store is the truth for a job's progress: a request counts as done only once its result row is committed,
so a process killed at any moment resumes from here (``engine/jobs/runner.py``): finished requests are kept,
pending ones run again, and the output file, written from the rows at the end, holds each request exactly once.
Nothing is held whole in memory: uploads are copied in chunks, the input is validated line by line into rows
(a request's body is read back from its byte range when it runs), and output files are written from a cursor.

Validation follows OpenAI's rules for a batch input file (one request per line:
``{"custom_id", "method": "POST", "url": ENDPOINT, "body": {...}}``): a missing or duplicate ``custom_id``
fails the whole batch with the line numbers; a line that cannot be read (not UTF-8, malformed or too deeply
nested JSON) or whose method/url/body is wrong becomes an error-file row for that line alone.
"""

from __future__ import annotations

import json
import os
import sqlite3
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from engine.jobs.batch_object import ACTIVE, BATCH_FIELDS, TERMINAL, batch_object
from engine.jobs.database import JobDatabase, Transaction
from engine.jobs.dir_lock import claim_dir
from engine.jobs.errors import InvalidRequestError, NotFoundError
from engine.jobs.jsonl import iter_lines, loads
from engine.jobs.lines import MISSING, check_line, expired_row, new_id, validation_error

ENDPOINTS = ("/v1/completions", "/v1/chat/completions")
COMPLETION_WINDOWS = {"24h": 24 * 3600}
MAX_VALIDATION_ERRORS = 100
_CHUNK = 1 << 20


@dataclass
class PendingRequest:
    batch_id: str
    idx: int
    custom_id: str
    body: dict[str, Any]
    line: int = 0  # 1-based line number in the input file (named in the request's error)


def default_data_dir() -> str:
    import platformdirs

    return platformdirs.user_data_dir("specserve", appauthor=False)


class JobStore:
    """Thread-safe: each thread gets its own SQLite connection (engine/jobs/database.py)."""

    def __init__(self, data_dir: str | os.PathLike[str]) -> None:
        self.root = Path(data_dir)
        self.files_dir = self.root / "files"
        self.files_dir.mkdir(parents=True, exist_ok=True)
        self._sql = JobDatabase(self.root / "jobs.sqlite3")

    def claim(self) -> None:
        """Make this process the data directory's only server, for as long as it lives.

        Two servers on one directory would both run its batch jobs (each request twice, the output file written
        by whichever finishes last). The lock is an OS file lock, so a killed server leaves nothing to clean up.
        """
        self._lock_fd = claim_dir(self.root, "server.lock")  # held open (and locked) until the process exits

    def _db(self) -> sqlite3.Connection:
        return self._sql.conn()

    def _tx(self) -> Transaction:
        return self._sql.tx()

    def close(self) -> None:
        self._sql.close()

    # ------------------------------------------------------------------------------------------------ files
    def file_path(self, file_id: str) -> Path:
        return self.files_dir / file_id

    def create_file(self, src: IO[bytes], filename: str, purpose: str) -> dict[str, Any]:
        """Copy ``src`` into the store in 1 MiB chunks (never whole in memory); returns the file object."""
        if purpose != "batch":
            raise InvalidRequestError(f"purpose: only 'batch' is supported, got {purpose!r}", "purpose")
        file_id = new_id("file-")
        tmp = self.files_dir / f".{file_id}.part"
        size = 0
        try:
            with open(tmp, "wb") as out:
                while chunk := src.read(_CHUNK):
                    out.write(chunk)
                    size += len(chunk)
                out.flush()
                os.fsync(out.fileno())
            os.replace(tmp, self.file_path(file_id))
        finally:
            tmp.unlink(missing_ok=True)
        return self._add_file(file_id, filename, purpose, size)

    def _add_file(self, file_id: str, filename: str, purpose: str, size: int) -> dict[str, Any]:
        with self._tx() as db:
            db.execute("INSERT INTO files VALUES (?, ?, ?, ?, ?)", (file_id, filename, purpose, size, int(time.time())))
        return self.get_file(file_id)

    def get_file(self, file_id: str) -> dict[str, Any]:
        row = self._db().execute("SELECT * FROM files WHERE id = ?", (file_id,)).fetchone()
        if row is None:
            raise NotFoundError(f"no file with id {file_id!r}")
        return {"id": row["id"], "object": "file", "bytes": row["bytes"], "created_at": row["created_at"],
                "filename": row["filename"], "purpose": row["purpose"], "status": "processed",
                "status_details": None, "expires_at": None}

    def list_files(self, purpose: str | None = None, limit: int = 10000, after: str | None = None) -> list[dict]:
        q, args = "SELECT id FROM files WHERE 1=1", []
        if purpose is not None:
            q += " AND purpose = ?"
            args.append(purpose)
        if after is not None:
            q += " AND rowid < (SELECT rowid FROM files WHERE id = ?)"
            args.append(after)
        rows = self._db().execute(q + " ORDER BY rowid DESC LIMIT ?", (*args, limit)).fetchall()
        return [self.get_file(r["id"]) for r in rows]

    def delete_file(self, file_id: str) -> dict[str, Any]:
        self.get_file(file_id)
        busy = self._db().execute(
            f"SELECT id FROM batches WHERE input_file_id = ? AND status IN ({','.join('?' * len(ACTIVE))})",
            (file_id, *ACTIVE)).fetchone()
        if busy is not None:
            raise InvalidRequestError(f"file {file_id} is the input of batch {busy['id']}, which is still running; "
                                      "cancel it first", "file_id")
        with self._tx() as db:
            db.execute("DELETE FROM files WHERE id = ?", (file_id,))
        self.file_path(file_id).unlink(missing_ok=True)
        return {"id": file_id, "object": "file", "deleted": True}

    # ---------------------------------------------------------------------------------------------- batches
    def create_batch(self, input_file_id: str, endpoint: str, completion_window: str = "24h",
                     metadata: dict[str, str] | None = None) -> dict[str, Any]:
        if endpoint not in ENDPOINTS:
            raise InvalidRequestError(f"endpoint: must be one of {list(ENDPOINTS)}, got {endpoint!r}", "endpoint")
        if completion_window not in COMPLETION_WINDOWS:
            raise InvalidRequestError(f"completion_window: must be one of {list(COMPLETION_WINDOWS)}, got "
                                      f"{completion_window!r}", "completion_window")
        if metadata is not None and not (isinstance(metadata, dict) and len(metadata) <= 16 and all(
                isinstance(k, str) and isinstance(v, str) and len(k) <= 64 and len(v) <= 512
                for k, v in metadata.items())):
            raise InvalidRequestError("metadata: at most 16 string keys (<= 64 chars) with string values "
                                      "(<= 512 chars)", "metadata")
        try:
            f = self.get_file(input_file_id)
        except NotFoundError:
            raise InvalidRequestError(f"input_file_id: no file with id {input_file_id!r}", "input_file_id") from None
        if f["purpose"] != "batch":
            raise InvalidRequestError("input_file_id: the file's purpose must be 'batch'", "input_file_id")
        batch_id, now = new_id("batch_"), int(time.time())
        with self._tx() as db:
            db.execute("INSERT INTO batches (id, endpoint, input_file_id, completion_window, status, metadata, "
                       "created_at, expires_at) VALUES (?, ?, ?, ?, 'validating', ?, ?, ?)",
                       (batch_id, endpoint, input_file_id, completion_window,
                        None if metadata is None else json.dumps(metadata), now,
                        now + COMPLETION_WINDOWS[completion_window]))
        return self.get_batch(batch_id)

    def _batch_row(self, batch_id: str) -> sqlite3.Row:
        row = self._db().execute("SELECT * FROM batches WHERE id = ?", (batch_id,)).fetchone()
        if row is None:
            raise NotFoundError(f"no batch with id {batch_id!r}")
        return row

    def get_batch(self, batch_id: str) -> dict[str, Any]:
        return batch_object(self._batch_row(batch_id))

    def list_batches(self, limit: int = 20, after: str | None = None) -> tuple[list[dict[str, Any]], bool]:
        """Newest first, ``limit`` of them after the batch ``after``; and whether more follow."""
        q, args = "SELECT * FROM batches", []
        if after is not None:
            self._batch_row(after)
            q += " WHERE rowid < (SELECT rowid FROM batches WHERE id = ?)"
            args.append(after)
        rows = self._db().execute(q + " ORDER BY rowid DESC LIMIT ?", (*args, limit + 1)).fetchall()
        return [batch_object(r) for r in rows[:limit]], len(rows) > limit

    def batches_in(self, *statuses: str) -> list[str]:
        rows = self._db().execute(f"SELECT id FROM batches WHERE status IN ({','.join('?' * len(statuses))}) "
                                  "ORDER BY rowid", statuses).fetchall()
        return [r["id"] for r in rows]

    def cancel_batch(self, batch_id: str) -> dict[str, Any]:
        """validating / in_progress -> cancelling (the runner stops its requests and finalizes as cancelled)."""
        with self._tx() as db:
            row = db.execute("SELECT status FROM batches WHERE id = ?", (batch_id,)).fetchone()
            if row is None:
                raise NotFoundError(f"no batch with id {batch_id!r}")
            if row["status"] in ("validating", "in_progress"):
                db.execute("UPDATE batches SET status = 'cancelling', cancelling_at = ? WHERE id = ?",
                           (int(time.time()), batch_id))
            elif row["status"] not in ("cancelling", "cancelled"):
                raise InvalidRequestError(f"batch {batch_id} is {row['status']}: only a validating or in_progress "
                                          "batch can be cancelled")
        return self.get_batch(batch_id)

    def _set_status(self, batch_id: str, status: str, only_from: tuple[str, ...], **extra: Any) -> bool:
        """Move to ``status`` (stamping ``<status>_at``) if the batch is in one of ``only_from``."""
        cols = {f"{status}_at": int(time.time()), **extra} if f"{status}_at" in BATCH_FIELDS else dict(extra)
        sets = ", ".join(["status = ?"] + [f"{k} = ?" for k in cols])
        with self._tx() as db:
            cur = db.execute(f"UPDATE batches SET {sets} WHERE id = ? AND status IN "
                             f"({','.join('?' * len(only_from))})", (status, *cols.values(), batch_id, *only_from))
            return cur.rowcount == 1

    # ------------------------------------------------------------------------------------------- validation
    def validate(self, batch_id: str) -> dict[str, Any]:
        """validating -> in_progress (rows for every line) or failed (missing/duplicate custom_id, no lines)."""
        b = self._batch_row(batch_id)
        endpoint, path = b["endpoint"], self.file_path(b["input_file_id"])
        with self._tx() as db:  # a validation cut short by a crash starts again from the first line
            db.execute("DELETE FROM requests WHERE batch_id = ?", (batch_id,))
        errors: list[dict[str, Any]] = []
        idx = 0
        pending: list[tuple] = []
        try:
            f = open(path, "rb")  # noqa: SIM115 - closed below
        except FileNotFoundError:
            errors.append(validation_error("missing_file", f"the input file {b['input_file_id']} no longer exists"))
            f = None
        if f is not None:
            with f:
                for ln in iter_lines(f):
                    if ln.blank:
                        continue
                    custom_id, state, result = check_line(ln, endpoint)
                    if custom_id is MISSING:
                        if len(errors) < MAX_VALIDATION_ERRORS:
                            errors.append(validation_error("missing_custom_id", f"line {ln.number}: 'custom_id' is "
                                                           "required (a string)", "custom_id", ln.number))
                        custom_id = None
                    pending.append((batch_id, idx, ln.number, custom_id, ln.offset, ln.length, state, result))
                    idx += 1
                    if len(pending) >= 10_000:
                        self._insert_rows(pending)
                        pending = []
            self._insert_rows(pending)
        if not errors:
            dups = self._db().execute(
                "SELECT custom_id, group_concat(line, ', ') AS lines FROM requests WHERE batch_id = ? "
                "AND custom_id IS NOT NULL GROUP BY custom_id HAVING count(*) > 1 ORDER BY min(line) LIMIT ?",
                (batch_id, MAX_VALIDATION_ERRORS)).fetchall()
            errors += [validation_error("duplicate_custom_id",
                                        f"custom_id {r['custom_id']!r} appears on lines {r['lines']}",
                                        "custom_id", int(r["lines"].split(",")[1])) for r in dups]
        if not errors and idx == 0:
            errors.append(validation_error("empty_file", "the input file has no requests"))
        if errors:
            with self._tx() as db:
                db.execute("DELETE FROM requests WHERE batch_id = ?", (batch_id,))
            self._set_status(batch_id, "failed", ("validating",),
                             errors=json.dumps({"object": "list", "data": errors}))
        else:
            failed = self._db().execute("SELECT count(*) FROM requests WHERE batch_id = ? AND state = 'failed'",
                                        (batch_id,)).fetchone()[0]
            self._set_status(batch_id, "in_progress", ("validating",), total=idx, completed=0, failed=failed)
        return self.get_batch(batch_id)

    def _insert_rows(self, rows: list[tuple]) -> None:
        if rows:
            with self._tx() as db:
                db.executemany("INSERT INTO requests VALUES (?, ?, ?, ?, ?, ?, ?, ?)", rows)

    # ---------------------------------------------------------------------------------------------- running
    def pending(self, batch_id: str, after_idx: int, limit: int) -> list[PendingRequest]:
        """The next pending requests (body read back from the input file) after index ``after_idx``."""
        b = self._batch_row(batch_id)
        rows = self._db().execute("SELECT idx, line, custom_id, offset, length FROM requests WHERE batch_id = ? AND "
                                  "state = 'pending' AND idx > ? ORDER BY idx LIMIT ?",
                                  (batch_id, after_idx, limit)).fetchall()
        out = []
        with open(self.file_path(b["input_file_id"]), "rb") as f:
            for r in rows:
                f.seek(r["offset"])
                obj = loads(f.read(r["length"]).decode("utf-8"))
                out.append(PendingRequest(batch_id, r["idx"], r["custom_id"], obj["body"], r["line"]))
        return out

    def record(self, batch_id: str, results: list[tuple[int, bool, dict[str, Any]]]) -> int:
        """Commit finished requests: (index, succeeded, output row). A row already recorded is left alone (so
        nothing is counted twice); returns how many were new."""
        new = 0
        with self._tx() as db:
            for idx, ok, row in results:
                cur = db.execute("UPDATE requests SET state = ?, result = ? WHERE batch_id = ? AND idx = ? "
                                 "AND state = 'pending'", ("done" if ok else "failed", json.dumps(row), batch_id, idx))
                if cur.rowcount:
                    new += 1
                    db.execute(f"UPDATE batches SET {'completed' if ok else 'failed'} = "
                               f"{'completed' if ok else 'failed'} + 1 WHERE id = ?", (batch_id,))
        return new

    def num_pending(self, batch_id: str) -> int:
        return self._db().execute("SELECT count(*) FROM requests WHERE batch_id = ? AND state = 'pending'",
                                  (batch_id,)).fetchone()[0]

    def finalize(self, batch_id: str, final_status: str = "completed") -> dict[str, Any]:
        """Write the output and error files from the rows and move to ``final_status``.

        completed: from in_progress / finalizing; cancelled: from cancelling; expired: from in_progress, with an
        error row (code batch_expired) for every request that did not run. Safe to repeat after a crash.
        """
        b = self._batch_row(batch_id)
        if b["status"] in TERMINAL:
            return batch_object(b)
        if final_status == "completed":
            self._set_status(batch_id, "finalizing", ("in_progress",))
        expired = final_status == "expired"
        output_id = self._write_rows(batch_id, "done", b["output_file_id"], "output")
        error_id = self._write_rows(batch_id, "failed", b["error_file_id"], "errors", with_pending=expired)
        extra: dict[str, Any] = {"output_file_id": output_id, "error_file_id": error_id}
        if expired:
            extra["failed"] = b["failed"] + self.num_pending(batch_id)
        self._set_status(batch_id, final_status, ("in_progress", "finalizing", "cancelling"), **extra)
        return self.get_batch(batch_id)

    def _write_rows(self, batch_id: str, state: str, existing: str | None, kind: str,
                    with_pending: bool = False) -> str | None:
        if existing is not None:  # written before a crash, and the batch row already names it
            return existing
        states = (state, "pending") if with_pending else (state,)
        cur = self._db().execute(f"SELECT state, custom_id, result FROM requests WHERE batch_id = ? AND state IN "
                                 f"({','.join('?' * len(states))}) ORDER BY idx", (batch_id, *states))
        file_id = new_id("file-")
        tmp = self.files_dir / f".{file_id}.part"
        size = 0
        try:
            with open(tmp, "w", encoding="utf-8") as out:
                for r in cur:
                    line = r["result"] if r["state"] != "pending" else json.dumps(expired_row(r["custom_id"]))
                    out.write(line + "\n")
                    size += len(line.encode()) + 1
                out.flush()
                os.fsync(out.fileno())
            if size == 0:
                return None
            os.replace(tmp, self.file_path(file_id))
        finally:
            tmp.unlink(missing_ok=True)
        self._add_file(file_id, f"{batch_id}_{kind}.jsonl", "batch_output", size)
        return file_id

    def iter_file(self, file_id: str, chunk: int = 64 * 1024) -> Iterator[bytes]:
        """A stored file's bytes, chunk by chunk."""
        self.get_file(file_id)
        with open(self.file_path(file_id), "rb") as f:
            while data := f.read(chunk):
                yield data
