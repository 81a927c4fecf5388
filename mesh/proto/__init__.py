"""mesh.proto: the sans-IO wire protocol. No trio, no sockets, no clock: bytes in, events out, time as an argument.

See NOTES.md "Wire protocol" for the frame format and the message table.
"""
from .auth import ClientHandshake, ServerHandshake
from .codec import (EOF_ as EOF, HANDSHAKE_MAX_FRAME, HEADER_SIZE, MAX_FRAME, MAX_VERSION, MIN_VERSION, NEED_DATA, PROTOCOL_VERSION,
                    Codec)
from .errors import AuthError, ErrorCode, ProtocolError, ProtoError
from .events import (ALL_EVENTS, DTYPES, NONCE_SIZE, Ack, Activation, AuthOk, AuthProof, BatchInit, BatchStep,
                     BlockTable, Chain, Column, Done, Draft, DraftBatch, DraftSeed, Error, Event, Hello, Hidden,
                     Info, InfoRequest, Join, LeftOut, LeftOutCode, Load, LoadCode, MsgType, Ping, Pong, Reset,
                     Rollback, RtcChain, RtcServe, Sampling, SamplingParams, ShipBegin, ShipChunk, ShipEnd,
                     ShipResume, Shutdown, Signal, SignalKind, Stats, StatsRequest, Step, Tokens, Vocab, Welcome,
                     WindowUpdate, ZeroSlot, activation_head, tokens_reply)
from .seal import SEAL_OVERHEAD, LinkKeys
from .flow import MIN_FRAME_COST, FlowWindow, Liveness, flow_controlled, frame_cost
from .steady import SteadyStep

__all__ = [
    "ALL_EVENTS", "DTYPES", "EOF", "HANDSHAKE_MAX_FRAME", "HEADER_SIZE", "MAX_FRAME", "MAX_VERSION", "MIN_FRAME_COST", "MIN_VERSION", "SEAL_OVERHEAD", "LinkKeys",
    "NEED_DATA", "NONCE_SIZE", "PROTOCOL_VERSION", "Ack", "Activation", "AuthError", "AuthOk", "AuthProof",
    "BatchInit", "BatchStep", "BlockTable", "Chain", "ClientHandshake", "Codec", "Column", "Done", "Draft",
    "DraftBatch", "DraftSeed", "Error", "ErrorCode", "Event", "FlowWindow", "Hello", "Hidden", "Info",
    "InfoRequest", "Join", "LeftOut", "LeftOutCode", "Liveness", "Load", "LoadCode", "MsgType", "Ping", "Pong",
    "ProtoError", "ProtocolError", "Reset", "Rollback", "RtcChain", "RtcServe", "Sampling", "SamplingParams",
    "ServerHandshake", "ShipBegin", "ShipChunk", "ShipEnd", "ShipResume", "Shutdown", "Signal", "SignalKind", "Stats",
    "StatsRequest", "Step", "SteadyStep", "Tokens",
    "Vocab", "Welcome", "WindowUpdate", "ZeroSlot", "activation_head", "flow_controlled", "frame_cost",
    "tokens_reply",
]
