"""Step trace of a served engine (diagnostic): with this folder on PYTHONPATH and SPECSERVE_TRACE_FILE set, every
engine step appends one line to that file (suffixed with the process id): wall-clock start, seconds, decoding
requests, prompt tokens, candidate nodes, requests speculating, whether the policy explored, tokens emitted.
Python imports ``sitecustomize`` at start-up, so a server started by ``specserve bench sweep`` (which passes on
the environment) traces without changes to it; phases.py summarises a trace."""

import os

if os.environ.get("SPECSERVE_TRACE_FILE"):
    import time

    from engine.llm_engine import LLMEngine
    from scheduler.scheduler import Scheduler

    _out = open(f"{os.environ['SPECSERVE_TRACE_FILE']}.{os.getpid()}", "a", buffering=1)  # noqa: SIM115 (open for the process)
    _schedule, _step = Scheduler.schedule, LLMEngine.step
    _last: dict = {}

    def schedule(self, *a, **k):
        pol = self.policy
        e0 = getattr(pol, "explored_steps", 0)
        b = _schedule(self, *a, **k)
        _last.update(rounds=len(b.rounds), prefill=sum(c.end - c.start for c in b.prefills),
                     nodes=sum(map(len, b.shapes)), spec=sum(1 for s in b.shapes if s),
                     explore=getattr(pol, "explored_steps", 0) > e0)
        return b

    def step(self):
        _last.clear()
        t0 = time.time()
        out = _step(self)
        if _last:
            _out.write(f"{t0:.3f} {time.time() - t0:.4f} {_last['rounds']} {_last['prefill']} {_last['nodes']} "
                       f"{_last['spec']} {int(_last['explore'])} {sum(len(d.new_token_ids) for d in out)}\n")
        return out

    Scheduler.schedule, LLMEngine.step = schedule, step
