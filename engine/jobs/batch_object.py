"""A batch as OpenAI's Batch API returns it, built from its row, and the statuses it moves through."""

from __future__ import annotations

import json
import sqlite3
from typing import Any

ACTIVE = ("validating", "in_progress", "finalizing", "cancelling")
TERMINAL = ("completed", "failed", "cancelled", "expired")
# The batches table's columns (engine/jobs/database.py), in order.
BATCH_FIELDS = ("id", "endpoint", "input_file_id", "completion_window", "status", "output_file_id",
                "error_file_id", "errors", "metadata", "created_at", "in_progress_at", "expires_at",
                "finalizing_at", "completed_at", "failed_at", "expired_at", "cancelling_at", "cancelled_at",
                "total", "completed", "failed")


def batch_object(row: sqlite3.Row) -> dict[str, Any]:
    """The batch as OpenAI's API returns it."""
    d = {k: row[k] for k in BATCH_FIELDS}
    return {
        "id": d["id"], "object": "batch", "endpoint": d["endpoint"],
        "errors": None if d["errors"] is None else json.loads(d["errors"]),
        "input_file_id": d["input_file_id"], "completion_window": d["completion_window"], "status": d["status"],
        "output_file_id": d["output_file_id"], "error_file_id": d["error_file_id"],
        **{k: d[k] for k in ("created_at", "in_progress_at", "expires_at", "finalizing_at", "completed_at",
                             "failed_at", "expired_at", "cancelling_at", "cancelled_at")},
        "request_counts": {"total": d["total"], "completed": d["completed"], "failed": d["failed"]},
        "metadata": None if d["metadata"] is None else json.loads(d["metadata"]),
    }
