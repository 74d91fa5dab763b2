"""The Python API: ``LLM(target, speculative_config=...).generate(prompts, params)``."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Sequence
from typing import Any

from engine.core.args import EngineArgs
from engine.core.config import SpeculativeConfig
from engine.core.llm_engine import LLMEngine
from engine.core.outputs import RequestDelta, RequestOutput
from scheduler.sampling_params import SamplingParams


class LLM:
    """Offline batched generation.

    ``LLM()`` with no model uses the built-in default pair (engine/default_models) with chain speculation.
    ``speculative_config``: a dict or JSON string, vLLM-style: ``{"method": "draft_model", "model": DIR,
    "num_speculative_tokens": K}`` plus ``tree_branching`` / ``tree_sampling`` / ``max_tree_nodes``; None
    means no speculation (unless the default models are used; "none" turns their draft off).
    Keyword arguments: the fields of ``engine.core.args.EngineArgs`` (the CLI's flags), with the same defaults.
    """

    def __init__(self, target: str | None = None, speculative_config: str | dict | SpeculativeConfig | None = None,
                 **kwargs: Any) -> None:
        args = EngineArgs(target=target, speculative_config=speculative_config, **kwargs)
        self.engine = LLMEngine.create(args.to_engine_config())
        # One engine, one caller at a time: requests of two concurrent generate() calls would share the
        # engine's queue and ids, and each call would collect the other's outputs.
        self._lock = threading.Lock()
        self._owner: int | None = None  # thread id holding the lock

    def shutdown(self) -> None:
        """Release the workers (Ray actors and placement groups, sockets)."""
        self.engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    def generate(self, prompts: str | list[int] | Sequence[str | list[int]],
                 params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """Outputs in the order of ``prompts``. A single string or a single list of ints is one prompt."""
        with self._exclusive():
            n = len(self._add_all(prompts, params))
            return self.run(n, use_tqdm)

    def stream(self, prompts: str | list[int] | Sequence[str | list[int]],
               params: SamplingParams | Sequence[SamplingParams] | None = None) -> Iterator[RequestDelta]:
        """Deltas of a batch as the steps produce them; request ids are the prompts' positions ("0", "1", ...).

        The requests are queued when iteration starts (a refused prompt raises there, and queues nothing);
        closing the generator early aborts the batch's unfinished requests (their KV is freed).
        """
        with self._exclusive():  # taken at the first next(), held until the stream ends or is closed
            ids = self._add_all(prompts, params)
            done: set[str] = set()
            try:
                while self.engine.has_unfinished:
                    for d in self.engine.step():
                        if d.finished:
                            done.add(d.request_id)
                        yield d
            finally:
                pending = [i for i in ids if i not in done]
                if pending and self.engine.is_alive:
                    for i in pending:
                        self.engine.abort_request(i)
                    while self.engine.has_unfinished:
                        self.engine.step()

    @contextlib.contextmanager
    def _exclusive(self) -> Iterator[None]:
        """One generate/stream at a time: another thread waits its turn; the same thread (an unfinished
        stream, then another call) is refused, since waiting would deadlock and sharing would mix results."""
        if self._owner == threading.get_ident():
            raise RuntimeError("this LLM is already running a generate() or stream() in this thread (an "
                               "unfinished stream?): finish or close it first")
        with self._lock:
            self._owner = threading.get_ident()
            try:
                yield
            finally:
                self._owner = None

    def _add_all(self, prompts, params) -> list[str]:
        """Queue one request per prompt, all or nothing; their ids."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if params is None:
            params = SamplingParams()
        plist = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError(f"params: {len(plist)} SamplingParams for {len(prompts)} prompts")
        queued = []
        try:
            for i, (p, sp) in enumerate(zip(prompts, plist, strict=True)):
                queued.append(self.engine.add_request(str(i), p, sp))
        except Exception:
            # All or nothing: requests left queued would run with the next call and collide with its ids.
            for req in queued:
                self.engine.withdraw_queued(req)
            raise
        return [r.request_id for r in queued]

    def run(self, total: int, use_tqdm: bool = False) -> list[RequestOutput]:
        """Step until every queued request finishes; outputs sorted by the order they were added."""
        outs: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm import tqdm
            bar = tqdm(total=total, desc="requests", unit="req")
        while self.engine.has_unfinished:
            for o in self.engine.step_finished():
                outs[o.request_id] = o
                if bar is not None:
                    bar.update(1)
        if bar is not None:
            bar.close()
        return [outs[k] for k in sorted(outs, key=_id_key)]


def _id_key(k: str) -> tuple[int, str]:
    return (int(k), "") if k.isdigit() else (1 << 62, k)
