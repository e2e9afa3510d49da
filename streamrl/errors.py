"""The one exception hierarchy of streamrl.

    StreamrlError
    ├── ConfigError          bad job spec or override; message names the key path (and YAML line)
    ├── WireError            a frame that cannot become a message
    │   ├── FrameTooLarge    over the configured frame limit
    │   └── DecodeError      unknown message type, wrong field type, bad protocol version
    ├── TransportError
    │   ├── TransportTimeout a bounded wait ran out
    │   ├── PeerGone         the other side closed or was never there
    │   └── RemoteError      the peer answered Error(code, detail) instead of a reply
    ├── WorkerFailed         a role process died or gave up
    └── WeightSyncError      a weight update to the engines failed (unreachable, refused, broadcast
                             failed, timed out, or the receiver was told to give up)

Code that runs untrusted programs (sandbox_bridge) returns result objects rather than raising for
failures of the user's code; it raises only for its own faults.
"""

from __future__ import annotations


class StreamrlError(Exception):
    """Base of every error streamrl raises on purpose."""


class ConfigError(StreamrlError, ValueError):
    """A job spec, override or config file is invalid. The message names the key path."""


class WireError(StreamrlError):
    """A received frame could not be turned into a message."""


class FrameTooLarge(WireError):
    """A frame is larger than the receiver accepts."""


class DecodeError(WireError):
    """A frame is not a valid message: unknown type tag, wrong field type, or bad protocol version."""


class TransportError(StreamrlError):
    """Sending or receiving failed."""


class TransportTimeout(TransportError, TimeoutError):
    """A bounded wait on the transport expired."""


class PeerGone(TransportError):
    """The peer is unreachable (unknown routing id, closed socket)."""


class WorkerFailed(StreamrlError):
    """A role process died or stopped with an error."""


class RemoteError(TransportError):
    """The server answered with Error(code, detail) where a normal reply was expected."""

    def __init__(self, code: str, detail: str, address: str) -> None:
        super().__init__(f"{address} answered error {code!r}: {detail}")
        self.code, self.detail = code, detail


class WeightSyncError(StreamrlError):
    """A weight update failed: an engine was unreachable or refused, or the broadcast failed or timed out."""
