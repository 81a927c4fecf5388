"""The coordinator's fleet registry: peers dial in, authenticate, say Join, and wait in a pool.

The dialed-in socket becomes the peer's control connection, so a peer behind NAT needs no inbound port. The registry
stays open for the coordinator's whole life: late joiners land in the pool, and a session takes a snapshot of it.
A member's connection lives in the task that admitted it; a session borrows the link and hands it back with
`release()`, which closes it, and the peer re-joins for the next session.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

import trio

import transport
from mesh import proto
from mesh.errors import FleetError
from mesh.link import AuthFailed, LinkError, PreAuthGate, open_link
from mesh.logsafe import clean

log = logging.getLogger("mesh.registry")
HANDSHAKE_SECONDS = 10.0
MAX_NAME = 64


def name_problem(name: str) -> str | None:
    """Why `name` cannot name a peer in messages, or None. A name is one printable word of at most MAX_NAME
    characters (a hostname fits): it lands in logs and the topology map, so no spaces, no control characters."""
    if len(name) > MAX_NAME:
        return f"is {len(name)} characters, at most {MAX_NAME} allowed"
    if not name.isprintable() or any(c.isspace() for c in name):
        return "must be printable, without spaces"
    return None


@dataclass(eq=False)
class Member:
    link: object
    host: str
    join: proto.Join
    number: int
    label: str = ""                 # the peer's own name (Join.name), made unique in the pool; "" = "peer N"
    released: trio.Event = field(default_factory=trio.Event)
    gone: bool = False

    @property
    def hop_addr(self) -> str:
        """Where the predecessor dials this peer: its advertised address, else its source IP and listen port."""
        if self.join.advertise:
            return self.join.advertise
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.join.listen_port}"

    @property
    def key(self) -> tuple:
        """The same peer across its re-joins (a new Member each time): where it joins from, its hop port, its name."""
        return (self.host, self.join.listen_port, self.join.advertise, self.join.name)

    @property
    def name(self) -> str:
        """How every message names this peer: its own name (or its join number) and where it joined from."""
        return f"{self.label or f'peer {self.number}'} ({self.host})"

    def release(self) -> None:
        self.released.set()


async def _cancel_after(waiter, scope: trio.CancelScope) -> None:
    await waiter()
    scope.cancel()


class Registry:
    def __init__(self, token: bytes | None):
        self.token = token
        self.members: list[Member] = []
        self._joined = 0
        self._changed = trio.Event()
        self.gate = PreAuthGate()
        self.benched: set[tuple] = set()   # Member.key of peers left out of the last session that formed

    async def serve(self, host: str, port: int, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        await transport.serve_listener(host, port, self._admit, task_status=task_status)

    async def _admit(self, stream) -> None:
        host = transport.remote_host(stream) or "?"
        try:
            with trio.fail_after(HANDSHAKE_SECONDS) as handshake:
                async with open_link(stream, token=self.token, role="server", gate=self.gate) as link:
                    first = await link.receive()
                    handshake.deadline = math.inf
                    if not isinstance(first, proto.Join):
                        await link.send(proto.Error(proto.ErrorCode.UNEXPECTED,
                                                    f"expected Join, got {type(first).__name__}"))
                        log.warning("refused %s: first message was %s, not Join", host, type(first).__name__)
                        return
                    if first.advertise:
                        try:
                            transport.parse_addr(first.advertise)
                        except transport.AddressError as exc:
                            await link.send(proto.Error(proto.ErrorCode.BAD_REQUEST, f"Join.advertise: {exc}"))
                            log.warning("refused %s: %s", host, clean(exc))
                            return
                    if (why := name_problem(first.name)) is not None:
                        await link.send(proto.Error(proto.ErrorCode.BAD_REQUEST, f"Join.name {clean(first.name, 80)!r} "
                                                                                 f"{why}"))
                        log.warning("refused %s: its name %r %s", host, clean(first.name, 80), why)
                        return
                    self._joined += 1
                    member = Member(link, host, first, self._joined, self._unique(first.name, host))
                    self._add(member)
                    try:
                        # Held until a session is done with it, or until the peer goes away while pooled (the
                        # link's heartbeat notices a silent peer), so the pool only ever offers live peers.
                        async with trio.open_nursery() as watch:
                            watch.start_soon(_cancel_after, link.wait_failed, watch.cancel_scope)
                            await member.released.wait()
                            watch.cancel_scope.cancel()
                    finally:
                        member.gone = True
                        self._remove(member)
        except trio.TooSlowError:
            log.warning("refused %s: no handshake within %.0fs", host, HANDSHAKE_SECONDS)
        except AuthFailed as exc:
            log.warning("refused peer %s: %s", host, exc)
        except (LinkError, proto.ProtoError, transport.TransportError) as exc:
            log.warning("peer %s: %s", host, exc)

    def _unique(self, name: str, host: str) -> str:
        """The peer's name, or name#2, name#3... when a pooled peer already uses it (two peers on one host both
        default to its hostname)."""
        if not name:
            return ""
        taken = {m.label for m in self.members}
        label, k = name, 1
        while label in taken:
            k += 1
            label = f"{name}#{k}"
        if k > 1:
            log.warning("%s (%s) joined under a name already in the pool; calling it %s (give each peer its own "
                        "--name)", name, host, label)
        return label

    def _add(self, m: Member) -> None:
        self.members.append(m)
        log.info("%s joined (hops at %s, %d MB); %d in the pool", m.name, clean(m.hop_addr), m.join.memory_mb,
                 len(self.members))
        self._notify()

    def _remove(self, m: Member) -> None:
        if m in self.members:
            self.members.remove(m)
            log.info("%s left; %d in the pool", m.name, len(self.members))
            self._notify()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    async def wait_changed(self) -> None:
        """Wait for the next join or leave (a serving coordinator re-forms to take in new peers)."""
        await self._changed.wait()

    async def wait_rejoined(self, session: list[Member], n: int) -> None:
        """After a session lost a stage: wait until that session's members have left the pool (they re-join as new
        members once released) and `n` peers are pooled again. The caller bounds the wait."""
        while any(m in self.members for m in session) or len(self.members) < n:
            await self._changed.wait()

    async def wait_for(self, n: int, settle: float) -> list[Member]:
        """Wait until `n` peers are pooled, then for a settling window that absorbs stragglers; snapshot the pool."""
        while len(self.members) < n:
            await self._changed.wait()
        with trio.move_on_after(settle * 4):   # a quiet window of `settle` seconds, restarted by each new join
            while True:
                changed = self._changed
                with trio.move_on_after(settle) as quiet:
                    await changed.wait()
                if quiet.cancelled_caught:
                    break
        members = list(self.members)
        if len(members) < n:
            raise FleetError(f"only {len(members)} of {n} peers are still connected")
        return members
