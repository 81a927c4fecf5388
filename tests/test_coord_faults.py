"""The coordinator's negotiation under a failing member: every answer is awaited together, so the first member whose
link fails ends the call at once, not after the slowest member's answer (a load and its compile can take a minute
on a busy CPU while a frozen peer's link has long timed out: found by bench/soak.py, a re-form that waited 47 s)."""
from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import trio

from mesh import proto
from mesh.coordinator import _rpc_all
from mesh.errors import FleetError
from mesh.link import LinkDead


@dataclass
class FakeLink:
    answer: object = None           # None: never answers (a peer busy loading)
    fail: bool = False
    sent: list = field(default_factory=list)

    async def send(self, msg) -> None:
        self.sent.append(msg)

    async def receive(self):
        if self.fail:
            await trio.lowlevel.checkpoint()
            raise LinkDead("nothing received from the peer for 5s")
        if self.answer is None:
            await trio.sleep_forever()
        return self.answer


@dataclass
class FakeMember:
    name: str
    link: FakeLink


async def test_a_member_that_fails_ends_the_call_while_another_still_works():
    slow, frozen = FakeMember("p0", FakeLink()), FakeMember("p1", FakeLink(fail=True))
    start = trio.current_time()
    with trio.fail_after(5):
        with pytest.raises(FleetError, match="p1: nothing received from the peer for 5s"):
            await _rpc_all([slow, frozen], lambda m: proto.InfoRequest(), proto.Info)
    assert trio.current_time() - start < 5
    assert len(slow.link.sent) == len(frozen.link.sent) == 1      # both asked before any answer was awaited


async def test_answers_come_back_in_member_order_and_a_wrong_one_is_named():
    a = FakeMember("a", FakeLink(answer=proto.Ack(proto.MsgType.LOAD, 0, "")))
    b = FakeMember("b", FakeLink(answer=proto.Ack(proto.MsgType.LOAD, 1, "b")))
    assert [x.reason for x in await _rpc_all([a, b], lambda m: proto.InfoRequest(), proto.Ack)] == ["", "b"]
    with pytest.raises(FleetError, match="b: expected Info, got Ack"):
        await _rpc_all([b], lambda m: proto.InfoRequest(), proto.Info)
