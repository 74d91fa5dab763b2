"""Step trace of a served engine (diagnostic; adaptive-2026-12-02g/trace_site plus the policy's view): with this folder
on PYTHONPATH and SPECSERVE_TRACE_FILE set, every engine step appends one line to that file (suffixed with the
process id): wall-clock start, seconds, decoding requests, prompt tokens, candidate nodes, requests speculating,
whether the policy explored, tokens emitted; then "PRED" where the policy chose chains (their predicted tokens /
seconds against plain decode's, both verify prices, the draft tokens priced and really due, the mean first-position
rate) and "OBS" (what the cost model was told: verify tokens / seconds, draft forwards / seconds, each forward's
seconds, state seconds, prompt tokens). Python imports ``sitecustomize`` at start-up, so a server started by
``specserve bench sweep`` (which passes on the environment) traces without changes to it."""

import os

if os.environ.get("SPECSERVE_TRACE_FILE"):
    import time

    from engine.llm_engine import LLMEngine
    from scheduler.adaptive import AdaptivePolicy
    from scheduler.scheduler import Scheduler

    _out = open(f"{os.environ['SPECSERVE_TRACE_FILE']}.{os.getpid()}", "a", buffering=1)  # noqa: SIM115 (open for the process)
    _schedule, _step = Scheduler.schedule, LLMEngine.step
    _best_chains, _observe_step = AdaptivePolicy.best_chains, AdaptivePolicy.observe_step
    _last: dict = {}

    def best_chains(self, rs):
        best = _best_chains(self, rs)
        if any(best.shapes):
            plain = self.price(rs, [()] * len(rs))
            inflight = sum(r.inflight for r in rs)
            v_spec = self._cost.verify_seconds(inflight + sum(map(len, best.shapes)), len(rs))
            v_plain = self._cost.verify_seconds(inflight, len(rs))
            _last["pred"] = (f"PRED chains {best.tokens:.1f}/{best.seconds:.3f} plain {plain.tokens:.1f}/"
                             f"{plain.seconds:.3f} v_spec {v_spec:.3f} v_plain {v_plain:.3f} "
                             f"lag {sum(r.lag for r in rs):.1f} catchup {sum(r.catchup for r in rs)} "
                             f"rates0 {sum(r.rates[0] for r in rs if r.rates) / len(rs):.3f}")
        return best

    def observe_step(self, s):
        _last["obs"] = (f"OBS v {s.verify_tokens}/{s.verify_s:.3f} d {s.draft_forward_tokens}/{s.draft_s:.3f} "
                        f"fw {[round(x, 4) for x in (s.draft_forward_s or [])]} st {s.state_s:.3f} "
                        f"pf {s.prefill_tokens}")
        return _observe_step(self, s)

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
        if "rounds" in _last:
            _out.write(f"{t0:.3f} {time.time() - t0:.4f} {_last['rounds']} {_last['prefill']} {_last['nodes']} "
                       f"{_last['spec']} {int(_last['explore'])} {sum(len(d.new_token_ids) for d in out)}"
                       f" | {_last.get('pred', '')} | {_last.get('obs', '')}\n")
        return out

    Scheduler.schedule, LLMEngine.step = schedule, step
    AdaptivePolicy.best_chains, AdaptivePolicy.observe_step = best_chains, observe_step
