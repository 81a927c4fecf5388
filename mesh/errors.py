"""The mesh layer's own errors. Each message names the host or stage and the reason, in one line."""
from contextlib import contextmanager

import trio


class MeshError(Exception):
    """Base of every error the mesh layer raises on purpose."""


class FleetError(MeshError):
    """The fleet cannot serve: a refused peer, a load that failed, a chain that would not tile the model."""


class HopError(MeshError):
    """A peer-to-peer hop could not be brought up, or broke while serving."""


class SessionError(MeshError):
    """A generation could not finish: a stage disappeared or answered out of turn."""


@contextmanager
def single_errors():
    """Callers see the error that ended a nursery (a LinkClosed, a ShipFailed), not trio's group of them.

    With strict exception groups even one failure arrives wrapped, which `except LinkError:` would miss. The
    Cancelled leaves that a failing sibling caused are dropped; when only ordinary errors remain, the first is
    raised as itself. Anything else (KeyboardInterrupt among them) keeps its group."""
    try:
        yield
    except BaseExceptionGroup as group:
        real = [e for e in leaf_errors(group) if not isinstance(e, trio.Cancelled)]
        if real and all(isinstance(e, Exception) for e in real):
            raise real[0] from None
        raise


def leaf_errors(exc: BaseException) -> list[BaseException]:
    """The exceptions inside (nested) exception groups, in order; a plain exception is its own only leaf."""
    if isinstance(exc, BaseExceptionGroup):
        return [leaf for sub in exc.exceptions for leaf in leaf_errors(sub)]
    return [exc]
