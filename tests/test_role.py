"""Worker roles are an enum on the controller's side and the same plain strings everywhere they leave it."""

from __future__ import annotations

import json

import msgpack

from engine.execution.placement import plan_placement
from engine.execution.role import Role


def test_a_role_is_its_string_in_messages_logs_and_frames() -> None:
    assert Role.TARGET == "target" and Role("draft") is Role.DRAFT
    assert {"target": 1}[Role.TARGET] == 1 and {Role.DRAFT: 2}["draft"] == 2  # dicts keyed either way agree
    assert f"the {Role.DRAFT} workers" == "the draft workers" and str(Role.TARGET) == "target"
    assert json.dumps({Role.TARGET: [Role.DRAFT]}) == '{"target": ["draft"]}'
    assert msgpack.packb({Role.TARGET: Role.DRAFT}) == msgpack.packb({"target": "draft"})


def test_a_plan_gives_each_role_its_bundles_and_restarts_one_alone() -> None:
    plan = plan_placement(4, 2, True, cluster_gpus=0)
    assert len(plan.bundles(Role.TARGET)) == 4 and len(plan.bundles(Role.DRAFT)) == 2
    assert plan.only(Role.DRAFT).total == 2 and plan.only(Role.DRAFT).bundles(Role.TARGET) == []
    assert plan.only(Role.TARGET).total == 4 and plan.only(Role.TARGET).draft_bundles == []
