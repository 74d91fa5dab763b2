"""Wraps the adaptive policy's exploration to print why each one ran (imported by served.py with EXPLDEBUG=1)."""

import scheduler.exploration as ex
from scheduler.adaptive import AdaptivePolicy

_orig = ex.Exploration._exploration


def _wrapped(self, rs, chosen, fixed):
    out = _orig(self, rs, chosen, fixed)
    if out is not None:
        cands = [[()] * len(rs), fixed] if any(chosen.shapes) else self._few_speculate(rs, fixed)
        nseqs = len(rs) + len(self._pinned)
        pinned = self._pinned_verify()
        info = []
        for c in cands:
            v = sum(r.inflight for r in rs) + pinned + sum(self.base.num_nodes(len(s)) for s in c)
            info.append((v, self._cost.verify_record(v, nseqs), c == out))
        curve = self._cost._priced_curve(nseqs)
        points = sorted((b, round(p.x), p.step) for b, p in curve.points.items())
        print(f"      EXPLORE nseqs {nseqs} chosen_nodes {sum(map(len, chosen.shapes))} cands {info} "
              f"curve clock {curve.clock} pts {points}", flush=True)
    return out


AdaptivePolicy._exploration = _wrapped
