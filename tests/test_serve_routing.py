"""Replica routing (engine/serve_replicas/routing.py): least outstanding tokens, prefix affinity, round-robin.

Pure policy on hand-made inputs; the Serve adapter (router.py) only maps replicas to ids and calls it.
"""

from __future__ import annotations

import pytest

from engine.serve_replicas.config import AutoscalingConfig, ReplicaAppConfig
from engine.serve_replicas.routing import RouteRequest, RoutingConfig, RoutingPolicy, TokenLedger, prefix_key

REPLICAS = ["r-a", "r-b", "r-c"]


def test_least_tokens_goes_where_fewest_tokens_are_outstanding_and_forgets_finished_ones():
    policy = RoutingPolicy(RoutingConfig("least_tokens"))
    ledger = policy.ledger
    ledger.start("r-a", "q1", 2000)  # one long prompt
    ledger.start("r-b", "q2", 30)
    ledger.start("r-b", "q3", 30)  # two short ones: more requests, fewer tokens
    assert policy.rank(REPLICAS, RouteRequest([1] * 10, 20)) == ["r-c", "r-b", "r-a"]
    ledger.start("r-c", "q4", 5000)
    assert policy.rank(REPLICAS, RouteRequest([1] * 10, 20))[0] == "r-b"
    ledger.finish("q1")
    assert policy.rank(REPLICAS, None)[0] == "r-a"  # the long request finished: r-a is empty again
    assert ledger.outstanding("r-a") == 0


def test_a_retried_request_counts_once_where_it_landed_and_a_dead_replica_is_forgotten():
    ledger = TokenLedger()
    ledger.start("r-a", "q1", 100)
    ledger.start("r-b", "q1", 100)  # resumed on r-b after r-a failed
    assert (ledger.outstanding("r-a"), ledger.outstanding("r-b")) == (0, 100)
    ledger.start("r-a", "q2", 50)
    ledger.drop_replica("r-a")
    ledger.finish("q2")  # finishing a request of a dropped replica changes nothing
    assert (ledger.outstanding("r-a"), ledger.outstanding("r-b")) == (0, 100)


def test_prefix_key_is_the_chained_hash_of_the_first_full_blocks():
    system = list(range(100, 164))  # 64 tokens: 4 blocks of 16
    a, b = prefix_key(system + [1, 2, 3], 16, 4), prefix_key(system + [9] * 40, 16, 4)
    assert a is not None and a == b  # the same first 4 blocks, whatever follows
    assert prefix_key([7] + system[1:] + [1], 16, 4) != a  # one token different in block 0
    assert prefix_key(system[:15], 16, 4) is None  # not one full block
    assert prefix_key(system[:40], 16, 4) == prefix_key(system[:32] + [5] * 8, 16, 4)  # 2 full blocks known


def test_prefix_affinity_keeps_a_prefix_on_one_replica_and_spreads_prefixes():
    policy = RoutingPolicy(RoutingConfig("prefix", block_size=4, prefix_blocks=2, imbalance_tokens=10_000))
    homes = {}
    for p in range(40):
        prefix = [p, p + 1, p + 2, p + 3, 0, 0, 0, p]
        firsts = {policy.rank(REPLICAS, RouteRequest(prefix + [s] * (s + 1), 8))[0] for s in range(5)}
        assert len(firsts) == 1, "requests sharing their first blocks went to different replicas"
        homes[p] = firsts.pop()
        policy.ledger.start(homes[p], f"q{p}", 50)  # load does not move a prefix below the imbalance bound
    assert set(homes.values()) == set(REPLICAS)  # 40 prefixes use every replica
    # A replica leaving moves only its own prefixes (rendezvous hashing).
    left = [r for r in REPLICAS if r != "r-c"]
    for p, home in homes.items():
        prefix = [p, p + 1, p + 2, p + 3, 0, 0, 0, p]
        now = policy.rank(left, RouteRequest(prefix, 8))[0]
        assert now == home or home == "r-c"


def test_prefix_affinity_gives_way_to_the_least_loaded_past_the_imbalance_bound():
    policy = RoutingPolicy(RoutingConfig("prefix", block_size=4, prefix_blocks=1, imbalance_tokens=100))
    req = RouteRequest([5, 6, 7, 8, 9], 10)
    home = policy.rank(REPLICAS, req)[0]
    policy.ledger.start(home, "hot", 100)
    assert policy.rank(REPLICAS, req)[0] == home  # at the bound: still home
    policy.ledger.start(home, "hot2", 1)
    assert policy.rank(REPLICAS, req)[0] != home
    assert policy.rank(REPLICAS, RouteRequest([1, 2], 10))[0] != home  # no full block: least loaded


def test_round_robin_cycles_whatever_the_load():
    policy = RoutingPolicy(RoutingConfig("round_robin"))
    policy.ledger.start("r-a", "q", 10**6)
    assert [policy.rank(REPLICAS, None)[0] for _ in range(6)] == REPLICAS * 2


def test_configs_refuse_what_cannot_work():
    with pytest.raises(ValueError, match="routing policy"):
        RoutingConfig("random")
    with pytest.raises(ValueError, match="min_replicas"):
        AutoscalingConfig(min_replicas=3, max_replicas=2)
    with pytest.raises(ValueError, match="unknown specserve app args: replica"):
        ReplicaAppConfig.from_dict({"replica": 2})
    cfg = ReplicaAppConfig.from_dict({"replicas": 2, "engine": {"max_num_seqs": 4}, "routing": {"policy": "prefix"},
                                      "autoscaling": {"min_replicas": 1, "max_replicas": 3}, "cores": [0, 1]})
    assert (cfg.engine.max_num_seqs, cfg.routing.policy, cfg.max_replicas, cfg.cores) == (4, "prefix", 3, (0, 1))
    assert cfg.autoscaling.to_serve(cfg.replicas)["initial_replicas"] == 2
