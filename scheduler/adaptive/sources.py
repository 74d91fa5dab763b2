"""Several drafting sources for one request (stdlib only): a proposer in the controller (an n-gram or suffix
match, where it has one) and a draft model (where configured as its fallback), each priced with its own
acceptance and costs (docs/adaptive.md, Draftless methods).

Per request per round the policy asks the proposer how deep a proposal it has now (``Match``), builds one view
of the request per available source (the proposer's rounds cost no draft forward; the model's pay its catch-up
and forwards) and keeps the one whose best round, priced for this request alone, has the highest rate; the
planner then plans the batch from the kept views. The drafter proposes from the source of each request's view.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from scheduler.adaptive.config import AdaptiveConfig
from scheduler.adaptive.costs import CostModel
from scheduler.adaptive.plan import Req, best_chains
from scheduler.request import Request

Match = Callable[[Request, int], int]  # (request, deepest allowed) -> depth of the proposal it has now (0: none)


@dataclass(frozen=True)
class Sources:
    """What drafts besides (or instead of) a draft model."""

    match: Match  # the proposer's look-up (engine/drafting/controller_drafter.py)
    name: str  # its source name (the metrics' and the drafter's)
    fallback_depth: int = 0  # a draft model drafts the other rounds up to this depth (0: no draft model)


def choose(options: Sequence[Req], costs: CostModel, config: AdaptiveConfig) -> Req:
    """The view whose best round, for this request alone, has the highest expected rate (a tie: the first)."""
    if len(options) == 1 or not costs.ready:
        return options[0]
    rates = [best_chains([o], costs, config).rate for o in options]
    return options[max(range(len(options)), key=lambda i: (rates[i], -i))]
