"""Zero-config join on a LAN: a peer started without `--join` asks the local network for a coordinator of its fleet.

A UDP query/answer in trio (NOTES "Mesh", "Discovery" says why not DNS-SD):

    peer -> 239.255.77.77:9000 (multicast, on every IPv4 interface) and each interface's broadcast address:
            Query  = MAGIC 0x01 | fleet id (8) | nonce (16)
    coordinator -> the querier's address (unicast), only when the fleet id is its own:
            Answer = MAGIC 0x02 | fleet id (8) | nonce (16) | port u16 | host (u8 + ascii) | name (u8 + utf-8)
                     | mac (16)

Keys come from the fleet token through scrypt (`FleetKeys`): the fleet id keeps two fleets on one LAN apart, the MAC
proves the answer comes from someone holding the token, for this query (the nonce) and for the address inside it.
The peer dials that address, never the datagram's source, so an impostor without the token can neither redirect a
peer nor get the handshake's proof from it. The top half of this module is sans-IO (bytes in, events out); the
bottom half is the trio glue: `Responder.serve` on the coordinator, `find_coordinator` on the peer.
"""
from __future__ import annotations

import errno
import functools
import hashlib
import hmac
import ipaddress
import itertools
import logging
import os
import socket
import struct
from collections import OrderedDict
from dataclasses import dataclass

import trio

from mesh.errors import MeshError

log = logging.getLogger("mesh.discovery")

GROUP = "239.255.77.77"     # IPv4 organization-local scope (RFC 2365): routers do not forward it off the site
PORT = 9000                 # UDP; the registry's default TCP port, so one firewall rule names both
MAGIC = b"MESHd1"
QUERY, ANSWER = 1, 2
FLEET_ID = 8
NONCE = 16
MAC = 16
MAX_DATAGRAM = 512
SCRYPT = dict(n=2**14, r=8, p=1)        # ~16 MiB and 0.05-0.6 s once per process; every offline guess pays it too
ANSWERS_PER_SECOND = 20                 # a coordinator is no amplifier: at most this many answers a second


class DiscoveryError(MeshError):
    """No coordinator of this fleet could be found on the local network; the message says what was tried."""


# ---------------------------------------------------------------------------------------------------------- sans-IO
@dataclass(frozen=True)
class FleetKeys:
    fleet_id: bytes
    mac_key: bytes

    @staticmethod
    @functools.lru_cache(maxsize=8)
    def from_token(token: bytes | None) -> FleetKeys:
        """scrypt(token) -> the fleet id and the answer MAC's key. An open fleet (no token) uses the empty token:
        every open fleet on a LAN shares one id, as they share having no secret."""
        base = hashlib.scrypt(token or b"", salt=b"mesh-discovery-v1", dklen=32, **SCRYPT)
        return FleetKeys(hmac.digest(base, b"fleet id", "sha256")[:FLEET_ID],
                         hmac.digest(base, b"answer mac", "sha256"))


@dataclass(frozen=True)
class Query:
    fleet_id: bytes
    nonce: bytes


@dataclass(frozen=True)
class Answer:
    fleet_id: bytes
    nonce: bytes
    host: str          # the registry's address, as the coordinator reaches the querier
    port: int
    name: str          # the coordinator's name, for messages

    @property
    def addr(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


def encode_query(q: Query) -> bytes:
    _check(len(q.fleet_id) == FLEET_ID and len(q.nonce) == NONCE, "query fields have the wrong size")
    return MAGIC + bytes([QUERY]) + q.fleet_id + q.nonce


def encode_answer(a: Answer, keys: FleetKeys) -> bytes:
    host, name = a.host.encode("ascii"), a.name.encode()[:64]
    _check(len(host) < 256 and 0 < a.port < 65536, "answer host or port out of range")
    body = (MAGIC + bytes([ANSWER]) + a.fleet_id + a.nonce + struct.pack("<H", a.port) + bytes([len(host)]) + host
            + bytes([len(name)]) + name)
    return body + hmac.digest(keys.mac_key, body, "sha256")[:MAC]


def decode(data: bytes, keys: FleetKeys) -> Query | Answer | None:
    """A datagram of this fleet, or None for anything else: another fleet's, a stranger's, a forged or damaged
    answer, garbage. Nothing here raises on network input."""
    head = len(MAGIC) + 1 + FLEET_ID + NONCE
    if len(data) < head or not data.startswith(MAGIC):
        return None
    if data[len(MAGIC) + 1:len(MAGIC) + 1 + FLEET_ID] != keys.fleet_id:
        return None
    kind, nonce = data[len(MAGIC)], data[head - NONCE:head]
    if kind == QUERY:
        return Query(keys.fleet_id, nonce) if len(data) == head else None
    if kind != ANSWER or len(data) < head + 4 + MAC:
        return None
    body, mac = data[:-MAC], data[-MAC:]
    if not hmac.compare_digest(hmac.digest(keys.mac_key, body, "sha256")[:MAC], mac):
        return None
    try:
        (port,) = struct.unpack_from("<H", body, head)
        at = head + 2
        host = body[at + 1:at + 1 + body[at]].decode("ascii")
        at += 1 + body[at]
        name = body[at + 1:at + 1 + body[at]].decode("utf-8", "replace")
        if at + 1 + body[at] != len(body) or port == 0:
            return None
        ipaddress.ip_address(host)
    except (IndexError, struct.error, UnicodeDecodeError, ValueError):
        return None
    return Answer(keys.fleet_id, nonce, host, port, name)


def _check(ok: bool, what: str) -> None:
    if not ok:
        raise ValueError(what)


class AnswerGate:
    """Which queries a coordinator answers: its fleet's, once per nonce (the same query arrives by multicast and by
    broadcast, on every interface), at most `rate` a second (a spoofed source must not turn it into a flood)."""

    def __init__(self, rate: int = ANSWERS_PER_SECOND, memory: int = 256) -> None:
        self.rate, self.memory = rate, memory
        self._seen: OrderedDict[bytes, None] = OrderedDict()
        self._window, self._count = -1, 0

    def admit(self, q: Query, now: float) -> bool:
        if q.nonce in self._seen:
            return False
        second = int(now)
        if second != self._window:
            self._window, self._count = second, 0
        if self._count >= self.rate:
            return False
        self._count += 1
        self._seen[q.nonce] = None
        if len(self._seen) > self.memory:
            self._seen.popitem(last=False)
        return True


# ----------------------------------------------------------------------------------------------------- interfaces
@dataclass(frozen=True)
class Interface:
    name: str
    ip: str
    broadcast: str | None      # the subnet's broadcast address; None for /31, /32 and loopback


def interfaces() -> list[Interface]:
    """IPv4 interfaces with an address, loopback last. `ifaddr` (a dependency of aioice, pure Python, Linux, macOS
    and Windows) reads them: the standard library has no portable way."""
    import ifaddr
    out = []
    for adapter in ifaddr.get_adapters():
        for ip in adapter.ips:
            if not isinstance(ip.ip, str):
                continue
            net = ipaddress.ip_network(f"{ip.ip}/{ip.network_prefix}", strict=False)
            loop = net.is_loopback
            bcast = str(net.broadcast_address) if not loop and net.prefixlen < 31 else None
            out.append(Interface(adapter.nice_name, ip.ip, bcast))
    return sorted(out, key=lambda i: ipaddress.ip_address(i.ip).is_loopback)


# ------------------------------------------------------------------------------------------------ coordinator side
class Responder:
    """Answers its fleet's queries with the registry's address, for as long as `serve` runs."""

    def __init__(self, token: bytes | None, registry_host: str, registry_port: int, name: str, *,
                 port: int = PORT, group: str = GROUP) -> None:
        self.token, self.registry_host, self.registry_port, self.name = token, registry_host, registry_port, name
        self.port, self.group = port, group
        self.gate = AnswerGate()

    async def serve(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        keys = await trio.to_thread.run_sync(FleetKeys.from_token, self.token)
        sock = trio.socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        with sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)    # two coordinators on one host both hear
            if hasattr(socket, "SO_REUSEPORT"):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)  # macOS/BSD need it for that
            try:
                await sock.bind(("0.0.0.0", self.port))
            except OSError as exc:
                log.warning("LAN discovery is off: cannot bind UDP port %d (%s); peers need --join", self.port,
                            exc.strerror or exc)
                task_status.started(False)
                return
            joined = self._join_group(sock)
            log.info("answering LAN discovery for this fleet on UDP %d (%s)", self.port,
                     f"multicast {self.group} on {', '.join(joined)}, and broadcast" if joined else
                     "broadcast only: joining the multicast group failed on every interface")
            task_status.started(True)
            while True:
                data, src = await sock.recvfrom(MAX_DATAGRAM)
                q = decode(data, keys)
                if not isinstance(q, Query) or not self.gate.admit(q, trio.current_time()):
                    continue
                host = self.registry_host if self.registry_host not in ("", "0.0.0.0") else await _route_to(src)
                if host is None:
                    continue
                answer = encode_answer(Answer(keys.fleet_id, q.nonce, host, self.registry_port, self.name), keys)
                try:
                    await sock.sendto(answer, src)
                except OSError as exc:
                    log.debug("discovery answer to %s failed: %s", src, exc)

    def _join_group(self, sock) -> list[str]:
        joined = []
        for iface in interfaces():
            mreq = socket.inet_aton(self.group) + socket.inet_aton(iface.ip)
            try:
                sock.setsockopt(socket.IPPROTO_IP, socket.IP_ADD_MEMBERSHIP, mreq)
                joined.append(iface.name)
            except OSError as exc:
                if exc.errno != errno.EADDRINUSE:
                    log.debug("multicast join on %s failed: %s", iface.name, exc)
        return joined


async def _route_to(src: tuple) -> str | None:
    """Our address on the route back to `src`: connect() on a UDP socket picks it without sending anything."""
    probe = trio.socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    with probe:
        try:
            await probe.connect(src)
        except OSError:
            return None
        return probe.getsockname()[0]


# ------------------------------------------------------------------------------------------------------- peer side
QUERY_TIMES = (0.0, 0.25, 0.75, 1.5, 3.0)  # then every 3 s; a lost datagram costs little
COLLECT_SECONDS = 0.3                      # after the first answer, how long other coordinators may still answer


def _targets(port: int, group: str) -> list[tuple[str | None, tuple[str, int]]]:
    """(interface address to send from, destination): the group on each interface, each subnet's broadcast
    address, and loopback's own address for a coordinator on this machine."""
    out: list[tuple[str | None, tuple[str, int]]] = []
    for iface in interfaces():
        if iface.broadcast is None and iface.ip.startswith("127."):
            out.append((None, (iface.ip, port)))
            continue
        out.append((iface.ip, (group, port)))
        if iface.broadcast:
            out.append((None, (iface.broadcast, port)))
    return out


def describe_failure(seconds: float, port: int, group: str, errors: list[str]) -> str:
    where = f"multicast {group} and broadcast on UDP {port}"
    sent = f"; sending failed: {'; '.join(errors)}" if errors else ""
    return (f"no coordinator of this fleet answered on the local network within {seconds:g}s (asked by {where}"
            f"{sent}). If one is running with the same token, multicast and broadcast may be blocked (Wi-Fi client "
            f"isolation, another subnet, a firewall on UDP {port}): give its address with --join HOST:PORT")


async def find_coordinator(token: bytes | None, *, within: float, port: int = PORT, group: str = GROUP) -> Answer:
    """Ask the LAN for a coordinator of this fleet; the first valid answer (others heard within COLLECT_SECONDS are
    logged). Raises DiscoveryError after `within` seconds, or at once when no query could be sent anywhere."""
    keys = await trio.to_thread.run_sync(FleetKeys.from_token, token)
    nonce = os.urandom(NONCE)
    query = encode_query(Query(keys.fleet_id, nonce))
    errors: dict[str, str] = {}
    heard: list[Answer] = []
    sock = trio.socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    with sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_BROADCAST, 1)
        sock.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_TTL, 1)   # this link only
        await sock.bind(("0.0.0.0", 0))

        async def ask(task_status=trio.TASK_STATUS_IGNORED) -> None:
            started = trio.current_time()
            for k in itertools.count():
                at = QUERY_TIMES[k] if k < len(QUERY_TIMES) else QUERY_TIMES[-1] * (k - len(QUERY_TIMES) + 2)
                await trio.sleep_until(started + at)
                sent = 0
                for iface, dest in _targets(port, group):
                    try:
                        if iface is not None:
                            sock.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_IF, socket.inet_aton(iface))
                        await sock.sendto(query, dest)
                        sent += 1
                    except OSError as exc:
                        errors[f"to {dest[0]} from {iface or 'the routed interface'}"] = exc.strerror or str(exc)
                if k == 0:
                    task_status.started(sent)

        nothing_sent = False
        with trio.move_on_after(within) as bound:
            async with trio.open_nursery() as nursery:
                if await nursery.start(ask) == 0:
                    nothing_sent = True
                    nursery.cancel_scope.cancel()
                while not nothing_sent:
                    data, _src = await sock.recvfrom(MAX_DATAGRAM)
                    a = decode(data, keys)
                    if isinstance(a, Answer) and a.nonce == nonce and a.addr not in {h.addr for h in heard}:
                        heard.append(a)
                        if len(heard) == 1:      # a little longer, to notice a second coordinator of this fleet
                            bound.deadline = min(bound.deadline, trio.current_time() + COLLECT_SECONDS)
    failures = [f"{k}: {v}" for k, v in errors.items()]
    if not heard:
        raise DiscoveryError(describe_failure(0 if nothing_sent else within, port, group, failures))
    if len(heard) > 1:
        log.warning("%d coordinators of this fleet answered: %s; joining the first (--join picks one)", len(heard),
                    ", ".join(f"{a.name} at {a.addr}" for a in heard))
    return heard[0]
