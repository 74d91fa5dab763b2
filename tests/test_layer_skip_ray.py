"""Self-speculation on a tensor-parallel target (Ray actors, TP 2): every rank drafts with its heads' early
layers, rank 0 draws and broadcasts the tokens (chains and trees); greedy output is the target's and the outputs
(greedy and seeded sampled) and acceptance equal the in-process engine's."""

from __future__ import annotations

import pytest

from tests.conftest import TP_PROMPTS, TPModels, ray_leftovers
from tests.test_eagle_ray import ray_cluster, uni_and_tp2  # noqa: F401

pytestmark = pytest.mark.slow  # starts Ray and two worker processes


@pytest.mark.parametrize("branching", [None, [2, 2, 1]])
def test_tp2_layer_skip_equals_in_process(ray_cluster, tp_models: TPModels, branching) -> None:  # noqa: F811
    spec = {"method": "layer_skip", "exit_layer": 1, "num_speculative_tokens": 3}
    spec |= {"tree_branching": branching} if branching else {}
    runs, workers = uni_and_tp2(tp_models.target, spec)
    assert runs["tp2"][0][: len(TP_PROMPTS)] == tp_models.expected
    assert runs["tp2"] == runs["uni"] and runs["uni"][1] > 0
    assert not ray_leftovers(workers, check_ray=False)
