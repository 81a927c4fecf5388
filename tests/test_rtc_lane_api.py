"""The WebRTC rung builds on the peer's public hop API: it imports nothing from mesh.peer (no circle, no private
names), and Peer provides what it needs."""
import subprocess
import sys

from mesh.peer import Peer
from mesh.rtc_lane import LaneHost


def test_rtc_lane_loads_without_the_peer():
    code = "import sys, mesh.rtc_lane; print('mesh.peer' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_the_peer_provides_the_lane_host_api():
    for name in [n for n in vars(LaneHost) if not n.startswith("_")]:
        assert callable(getattr(Peer, name)), name
    assert not hasattr(Peer(__import__("mesh.peer").peer.PeerConfig(join="127.0.0.1:1")), "nursery")
