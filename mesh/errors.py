"""The mesh layer's own errors. Each message names the host or stage and the reason, in one line."""


class MeshError(Exception):
    """Base of every error the mesh layer raises on purpose."""


class FleetError(MeshError):
    """The fleet cannot serve: a refused peer, a load that failed, a chain that would not tile the model."""


class HopError(MeshError):
    """A peer-to-peer hop could not be brought up, or broke while serving."""


class SessionError(MeshError):
    """A generation could not finish: a stage disappeared or answered out of turn."""
