"""A process that never opens a WebRTC hop does not import aiortc (~0.2-0.4 s of every start, and a peer runs where
aiortc may be missing): ICE flags parse from light modules, the rest of signaling/transport.webrtc loads on use."""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

CHECK = """
import sys
import mesh.cli, signaling, transport.webrtc
ice = signaling.IceConfig.from_flags(["stun.example.net:3478"])
assert ice.servers[0].url == "stun:stun.example.net:3478", ice
assert "aiortc" not in sys.modules, "aiortc imported by parsing ICE flags"
assert signaling.open_rtc_hop.__module__ == "signaling.relay"          # loaded on first use
assert transport.webrtc.RtcPeer.__module__ == "transport.webrtc.peer"
assert "aiortc" in sys.modules
print("ok")
"""


def test_ice_flags_parse_without_aiortc_and_the_rest_loads_on_use():
    p = subprocess.run([sys.executable, "-c", CHECK], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and p.stdout.strip() == "ok", p.stderr
