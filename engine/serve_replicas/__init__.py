"""Data-parallel engine replicas behind one OpenAI-compatible endpoint, on Ray Serve.

``app.build_app`` (the Serve application), ``replica`` (one engine per deployment replica), ``routed_engine``
(the ingress's per-request streams and retries), ``router`` / ``routing`` (which replica), ``config``,
``serve_cli`` (``specserve serve --replicas N``). Importing this package imports nothing of Ray.
"""
