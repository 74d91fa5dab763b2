"""What both clients' batch jobs share while they wait: the terminal states and the progress bar."""

from __future__ import annotations

from typing import Any

TERMINAL = ("completed", "failed", "cancelled", "expired")


def update_bar(bar: Any, b: dict[str, Any]) -> Any:
    from tqdm import tqdm

    c = b["request_counts"]
    if bar is None:
        bar = tqdm(total=c["total"] or None, desc=b["id"], unit="req")
    bar.total = c["total"] or bar.total
    bar.n = c["completed"] + c["failed"]
    bar.set_postfix(status=b["status"], failed=c["failed"], refresh=False)
    bar.refresh()
    return bar
