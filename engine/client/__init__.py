"""A Python client for ``specserve serve``: online calls and batch jobs, with retries that outlast a restart.

```python
from engine.client import Client
c = Client("http://127.0.0.1:8000")
c.complete("def fib(n):", max_tokens=32).text
for piece in c.stream("def fib(n):", max_tokens=32): print(piece, end="")
job = c.submit_batch([{"prompt": "def f():", "max_tokens": 16}, ...])    # or a path to an OpenAI batch file
job.wait(progress=True)                                                   # tqdm bar of completed/failed/total
for custom_id, body in job.results(): ...                                 # streamed from the output file
```

It lives in ``engine/client/`` beside the server it talks to and needs only httpx. ``AsyncClient`` has the
same surface with ``async``. Transient failures — HTTP 429 / 503 (honouring Retry-After) and connection
errors — are retried with exponential backoff for up to ``retry_timeout_s`` seconds, so ``BatchJob.wait``
rides out a server restart; a POST is retried only when the server cannot have seen it (connection refused) or
told us to (429 / 503). Other 4xx raise ``RequestError`` at once, with the
server's message.

Its rooms: ``transport.py`` (connection settings, retry timing), ``errors.py``, ``openai_format.py`` (the wire
formats), ``sync_client.py`` / ``async_client.py`` (each client with its batch-job handle), ``batch_progress.py``.
"""

from __future__ import annotations

from engine.client.async_client import AsyncBatchJob, AsyncClient
from engine.client.batch_progress import TERMINAL
from engine.client.errors import APIError, RequestError, ServerError
from engine.client.openai_format import Completion
from engine.client.sync_client import BatchJob, Client

__all__ = ["TERMINAL", "APIError", "AsyncBatchJob", "AsyncClient", "BatchJob", "Client", "Completion", "RequestError",
           "ServerError"]
