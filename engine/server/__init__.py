"""The OpenAI-compatible HTTP service behind ``specserve serve``.

- ``protocol``: pydantic request/response models (OpenAI field names; a bad body is a 400 naming the field);
- ``async_engine``: the engine loop thread and the asyncio front end (per-request queues, aborts, queue bound,
  health, rebuilding a failed engine and re-admitting its open requests);
- ``metrics``: the Prometheus registry (``specserve:`` names, vLLM's metric names after the prefix);
- ``auth``: bearer-key middleware for ``/v1/*``;
- ``serving``: requests -> engine calls -> responses and SSE chunks; ``routes``: the endpoints;
- ``app``: ``build_app(async_engine, config, extra_routers=[...])``; ``cli``: the ``serve`` subcommand.
"""
