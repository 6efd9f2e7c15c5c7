"""The engine's side of a switch (Controller.use_config): a new cache capacity empties the
response cache, as Horovod's set_capacity does, and a pending tensor the cache knew is then
negotiated in full rather than announced by a slot no rank holds any more (it would be lost)."""
from __future__ import annotations

import dataclasses

from hvdlite.common.config import Config
from hvdlite.common.engine.controller import Controller
from hvdlite.common.engine.messages import Response
from tests.unit.engine.fake_transport import FakeNetwork
from tests.unit.engine.test_controller import entry


def test_cache_switch_empties_the_cache_and_renegotiates_pending():
    config = Config()
    pending = {}
    controller = Controller(FakeNetwork(1).transport(0), config, pending)
    known = entry("grad")
    slot = controller.cache.put(Response("grad", "allreduce", "float32", (4,)), known.request)
    assert slot == 0
    again = entry("grad")
    controller.cache.match([again])
    assert again.slot == 0
    pending["grad"] = again
    faster = dataclasses.replace(config, cycle_time_ms=7.0, fusion_threshold=1)
    assert controller.use_config(faster) is False   # same capacity: the cache stays
    assert controller.config is faster and len(controller.cache) == 1 and again.slot == 0
    off = dataclasses.replace(faster, cache_capacity=0)
    assert controller.use_config(off) is True
    assert len(controller.cache) == 0 and controller.cache.capacity == 0
    assert again.slot is None and not again.sent   # sent in full in the next round
    on = dataclasses.replace(off, cache_capacity=1024)
    assert controller.use_config(on) is True and controller.cache.capacity == 1024
