"""tests/netns.py itself: the topology isolates the peers, lets them reach the public segment, and cleans up."""

from __future__ import annotations

import subprocess

import pytest

from tests.netns import NAT_B_WAN, PEER_B_IP, PUB_IP, STUN_PORT, coturn_unavailable, nat_topology, netns_unavailable

pytestmark = [pytest.mark.netns, pytest.mark.skipif((why := netns_unavailable()) is not None, reason=str(why))]


def _namespaces() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def test_peers_reach_the_public_segment_but_not_each_other() -> None:
    before = _namespaces()
    with nat_topology() as net:
        assert set(net.namespaces) <= _namespaces()
        net.listen_tcp(net.pub, PUB_IP, 7000)
        net.listen_tcp(net.peer_b, PEER_B_IP, 7001)
        assert net.try_connect(net.peer_a, PUB_IP, 7000) == "connected"
        assert net.try_connect(net.peer_b, PUB_IP, 7000) == "connected"
        # No route to the other peer's private address, and its router drops what arrives unsolicited.
        assert "unreachable" in net.try_connect(net.peer_a, PEER_B_IP, 7001)
        assert net.try_connect(net.peer_a, NAT_B_WAN, 7001, timeout=0.5) == "timeout"
        assert net.try_connect(net.pub, NAT_B_WAN, 7001, timeout=0.5) == "timeout"
    assert _namespaces() == before


def test_teardown_happens_even_when_the_body_fails() -> None:
    before = _namespaces()
    with pytest.raises(RuntimeError, match="boom"):
        with nat_topology():
            raise RuntimeError("boom")
    assert _namespaces() == before


@pytest.mark.skipif((no_turn := coturn_unavailable()) is not None, reason=str(no_turn))
def test_coturn_serves_on_the_public_segment_and_is_stopped() -> None:
    with nat_topology() as net:
        net.start_coturn()
        bound = net.run(net.pub, "ss", "-Hlun", f"sport = :{STUN_PORT}").stdout
        assert PUB_IP in bound
        procs = list(net._procs)
    assert all(p.poll() is not None for p in procs)
