"""The transport ladder for one hop: a direct dial first, WebRTC second; both failures reported together."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TypeVar

import trio

from .errors import HopError
from .relay import HopProgress

T = TypeVar("T")


async def climb(
    hop: str,
    direct: Callable[[], Awaitable[T]],
    rtc: Callable[[], Awaitable[T]] | None,
    *,
    progress: HopProgress | None = None,
) -> T:
    """Return the first rung that comes up; raise `HopError(hop, direct_error, rtc_error)` if none does.

    Each rung bounds itself (`trio.fail_after` inside the callable): a timeout is that rung's failure, not the
    ladder's. `rtc=None` means WebRTC is not allowed for this hop. `progress`, if the rtc rung shares it with
    `open_rtc_hop`, names the step a WebRTC timeout hit.
    """
    try:
        return await direct()
    except Exception as exc:  # any rung failure, ours or foreign, becomes half of the HopError
        direct_error: BaseException = exc
    if rtc is None:
        raise HopError(hop, direct_error, "not allowed for this hop") from direct_error
    try:
        return await rtc()
    except trio.TooSlowError as exc:
        where = f" while waiting for {progress.step}" if progress is not None else ""
        raise HopError(hop, direct_error, f"timed out{where}") from exc
    except Exception as exc:
        raise HopError(hop, direct_error, exc) from exc
