"""The job store's SQLite database: its schema, one connection per thread, and write transactions.

WAL journaling lets readers run beside the one writer; each thread gets its own connection because a SQLite
connection must not be shared across threads.
"""

from __future__ import annotations

import os
import sqlite3
import threading
from typing import Any

SCHEMA = """
CREATE TABLE IF NOT EXISTS files (
    id TEXT PRIMARY KEY, filename TEXT NOT NULL, purpose TEXT NOT NULL, bytes INTEGER NOT NULL,
    created_at INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS batches (
    id TEXT PRIMARY KEY, endpoint TEXT NOT NULL, input_file_id TEXT NOT NULL, completion_window TEXT NOT NULL,
    status TEXT NOT NULL, output_file_id TEXT, error_file_id TEXT, errors TEXT, metadata TEXT,
    created_at INTEGER NOT NULL, in_progress_at INTEGER, expires_at INTEGER, finalizing_at INTEGER,
    completed_at INTEGER, failed_at INTEGER, expired_at INTEGER, cancelling_at INTEGER, cancelled_at INTEGER,
    total INTEGER NOT NULL DEFAULT 0, completed INTEGER NOT NULL DEFAULT 0, failed INTEGER NOT NULL DEFAULT 0);
CREATE TABLE IF NOT EXISTS requests (
    batch_id TEXT NOT NULL, idx INTEGER NOT NULL, line INTEGER NOT NULL, custom_id TEXT,
    offset INTEGER NOT NULL, length INTEGER NOT NULL, state TEXT NOT NULL, result TEXT,
    PRIMARY KEY (batch_id, idx));
CREATE INDEX IF NOT EXISTS requests_by_custom_id ON requests (batch_id, custom_id);
"""


class Transaction:
    """``with db.tx() as conn:`` one ``BEGIN IMMEDIATE`` transaction: committed, or rolled back on an error."""

    def __init__(self, db: sqlite3.Connection) -> None:
        self.db = db

    def __enter__(self) -> sqlite3.Connection:
        self.db.execute("BEGIN IMMEDIATE")
        return self.db

    def __exit__(self, exc_type: Any, *_: Any) -> None:
        self.db.execute("ROLLBACK" if exc_type is not None else "COMMIT")


class JobDatabase:
    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = path
        self._local = threading.local()
        self.conn().executescript(SCHEMA)

    def conn(self) -> sqlite3.Connection:
        """This thread's connection (opened on first use)."""
        db = getattr(self._local, "db", None)
        if db is None:
            db = sqlite3.connect(self.path, timeout=30.0, isolation_level=None)
            db.row_factory = sqlite3.Row
            db.execute("PRAGMA journal_mode=WAL")
            # NORMAL in WAL mode: a commit survives a killed process (it is in the WAL file); only an OS crash
            # or power loss can drop the last commits, and those requests then simply run again.
            db.execute("PRAGMA synchronous=NORMAL")
            self._local.db = db
        return db

    def tx(self) -> Transaction:
        return Transaction(self.conn())

    def close(self) -> None:
        """Close this thread's connection."""
        db = getattr(self._local, "db", None)
        if db is not None:
            db.close()
            self._local.db = None
