"""Credit-based flow control and liveness arithmetic, with time passed in (`now`) rather than read.

Credit is counted in bytes of flow-controlled frames, each costing `frame_cost(size)`. Ping, Pong, WindowUpdate and
Shutdown, and the handshake, are not flow-controlled: the link answers or acts on them in the reader without queueing
them, so they cannot make a receiver buffer. Error IS flow-controlled: it is queued in order with the replies it
stands in for, so it must count against the queue's bound; a sender's very last Error before it closes may go out
without credit, and a receiver keeps that one and stops reading.
"""
from __future__ import annotations

from .errors import ErrorCode, ProtocolError
from .events import MsgType, Ping, WindowUpdate

MIN_FRAME_COST = 64
"""A frame costs at least this much credit, so a window also bounds the *number* of queued events (whose Python
objects weigh far more than an 8-byte empty frame)."""

UNCONTROLLED = frozenset({
    MsgType.HELLO, MsgType.WELCOME, MsgType.AUTH_PROOF, MsgType.AUTH_OK,
    MsgType.PING, MsgType.PONG, MsgType.WINDOW_UPDATE, MsgType.SHUTDOWN,
})


def flow_controlled(msg_type: MsgType) -> bool:
    return msg_type not in UNCONTROLLED


def frame_cost(frame_size: int) -> int:
    """Credit consumed by a frame of `frame_size` bytes (header included)."""
    return max(frame_size, MIN_FRAME_COST)


class FlowWindow:
    """Both directions of one connection's credit.

    Sending: starts at 0 credit; the peer's first WindowUpdate opens the window. A frame may be sent while credit is
    positive and may take it negative, so outstanding bytes never exceed the peer's window plus one frame.

    Receiving: grants `window` up front (`initial_update()`), checks the peer stays within grant + one max frame, and
    returns credit as the application consumes events, in updates of at least half a window so updates stay rare.
    """

    __slots__ = ("window", "max_frame", "send_credit", "_granted", "_received", "_consumed_ungranted")

    def __init__(self, window: int, max_frame: int) -> None:
        if window < MIN_FRAME_COST:
            raise ValueError(f"flow window must be at least {MIN_FRAME_COST} bytes, got {window}")
        self.window = window
        self.max_frame = max_frame
        self.send_credit = 0
        self._granted = 0
        self._received = 0
        self._consumed_ungranted = 0

    # sending side
    def can_send(self) -> bool:
        return self.send_credit > 0

    def on_sent(self, cost: int) -> None:
        if self.send_credit <= 0:
            raise RuntimeError("sent a flow-controlled frame without credit")
        self.send_credit -= cost

    def on_window_update(self, update: WindowUpdate) -> None:
        # A peer cannot grant more than it could ever buffer; an absurd grant is a broken peer, not a gift.
        if update.credit == 0 or self.send_credit + update.credit > 1 << 48:
            raise ProtocolError(ErrorCode.FLOW_CONTROL, f"window update of {update.credit} bytes is out of range")
        self.send_credit += update.credit

    # receiving side
    def initial_update(self) -> WindowUpdate:
        if self._granted:
            raise RuntimeError("initial window already granted")
        self._granted = self.window
        return WindowUpdate(self.window)

    def on_received(self, cost: int) -> None:
        """A flow-controlled frame arrived. Raises ProtocolError(FLOW_CONTROL) if the peer overran its credit."""
        self._received += cost
        overrun = self._received - self._granted
        if overrun > frame_cost(self.max_frame + 8):
            raise ProtocolError(ErrorCode.FLOW_CONTROL,
                                f"peer sent {overrun} bytes beyond the {self._granted} bytes of credit granted")

    def on_consumed(self, cost: int) -> WindowUpdate | None:
        """The application took an event off the queue; maybe return credit to the peer."""
        self._consumed_ungranted += cost
        if self._consumed_ungranted * 2 < self.window:
            return None
        credit, self._consumed_ungranted = self._consumed_ungranted, 0
        self._granted += credit
        return WindowUpdate(credit)

    def buffered(self) -> int:
        """Bytes of frames received and not yet consumed (the receiver's queue)."""
        return self._received - (self._granted - self.window) - self._consumed_ungranted


class Liveness:
    """When to ping, and when a silent peer counts as dead. Anything received counts as a sign of life."""

    __slots__ = ("ping_interval", "dead_after", "last_received", "next_ping_at", "_nonce", "_ping_sent_at", "rtt")

    def __init__(self, now: float, *, ping_interval: float, dead_after: float) -> None:
        if not 0 < ping_interval < dead_after:
            raise ValueError(f"need 0 < ping_interval ({ping_interval}) < dead_after ({dead_after})")
        self.ping_interval = ping_interval
        self.dead_after = dead_after
        self.last_received = now
        self.next_ping_at = now
        self._nonce = 0
        self._ping_sent_at: float | None = None
        self.rtt: float | None = None
        """Round-trip time of the latest answered ping."""

    def on_receive(self, now: float) -> None:
        self.last_received = now

    def dead_at(self) -> float:
        return self.last_received + self.dead_after

    def is_dead(self, now: float) -> bool:
        return now >= self.dead_at()

    def ping_due(self, now: float) -> Ping | None:
        """A Ping to send now, or None if the next one is not yet due."""
        if now < self.next_ping_at:
            return None
        self._nonce += 1
        self._ping_sent_at = now
        self.next_ping_at = now + self.ping_interval
        return Ping(self._nonce)

    def on_pong(self, nonce: int, now: float) -> None:
        if nonce == self._nonce and self._ping_sent_at is not None:
            self.rtt = now - self._ping_sent_at
            self._ping_sent_at = None
