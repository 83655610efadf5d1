"""What the prefill sender and the decode receiver say to each other about one KV transfer.

Every control message is one fixed-size record, so the receiving side can always post a buffer of
``MSG_SIZE`` bytes. The receiver grants each room a payload ``tag`` when it starts expecting the room and
posts the payload's receive at once; the tag travels to the sender inside the push address of the
handshake. A transfer of room R then costs one round trip on top of the payload:

    sender -> OFFER(room, xfer, nbytes, tag, trailer), and at once the payload on the bulk endpoint
              under ``tag``; it lands in the receive posted for it without waiting for the OFFER
    receiver -> DONE                every byte landed and the OFFER matched; the sender may release its copy
             or REJECT(reason)      unknown_room, size_mismatch, ...: sent once nothing reads the
                                    payload any more; a payload we will not take is drained into a
                                    1-byte receive (UCX truncates it without moving the data)
    sender -> ABORT(reason)         the sender gave up (deadline, cancel); the receiver answers REJECT

``xfer`` pairs replies with the sender's pending sends. Tags are never reused by a receiver, so a payload
can never land in another transfer's buffer, even a retry of the same room. Posting the receive before the
OFFER arrives takes the OFFER's trip through both event loops off the payload's path (measured in
``bench/bench_transfer.py``).
"""
from __future__ import annotations

import struct
from dataclasses import dataclass
from enum import IntEnum

REASONS = ("timeout", "peer_lost", "size_mismatch", "unknown_room", "cancelled")
"""Why a transfer failed; also the ``reason`` label of ``transfer_failures_total``."""

MAX_EXTRA = 4


class TransferError(Exception):
    """A failed transfer of one room; other rooms are not affected."""

    def __init__(self, room: int, reason: str, detail: str = ""):
        if reason not in REASONS:
            raise ValueError(f"unknown transfer failure reason {reason!r}")
        self.room = room
        self.reason = reason
        self.detail = detail
        super().__init__(f"KV transfer of room {room} failed: {reason}" + (f" ({detail})" if detail else ""))


@dataclass(frozen=True)
class Trailer:
    """What travels with the KV: the first output token sampled by prefill, and a few spare ints."""

    first_token: int
    logprob: float = 0.0
    extra: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if len(self.extra) > MAX_EXTRA:
            raise ValueError(f"a trailer carries at most {MAX_EXTRA} extra ints")


_ADDRESS_HEAD = struct.Struct("<QHH")  # payload tag, listener port, host length; then host and worker address


@dataclass(frozen=True)
class PeerAddress:
    """Everything a sender needs to push one room: the receiver's control listener, its UCX worker address,
    and the tag its payload receive was posted under.

    Packed into one opaque ``bytes`` (base64 it for the JSON handshake) so the handshake carries a single field.
    """

    host: str
    port: int
    worker: bytes
    tag: int

    def pack(self) -> bytes:
        host = self.host.encode()
        return _ADDRESS_HEAD.pack(self.tag, self.port, len(host)) + host + self.worker

    @classmethod
    def unpack(cls, data: bytes) -> PeerAddress:
        head = _ADDRESS_HEAD.size
        if len(data) < head:
            raise ValueError("malformed peer address")
        tag, port, host_len = _ADDRESS_HEAD.unpack_from(data)
        host = data[head : head + host_len].decode()
        worker = bytes(data[head + host_len :])
        if not host or not worker:
            raise ValueError("malformed peer address")
        return cls(host, port, worker, tag)

    @property
    def receiver(self) -> tuple[str, int, bytes]:
        """Which receiver this is, whatever the room: links to it are shared by all its rooms."""
        return self.host, self.port, self.worker


class Kind(IntEnum):
    OFFER = 1
    DONE = 2
    REJECT = 3
    ABORT = 4


# magic, version, kind, reason (index into REASONS, 0 = none), n_extra, room, xfer, nbytes, tag,
# first_token, logprob, extra[MAX_EXTRA]
_FORMAT = struct.Struct(f"<4sBBBBQQQQqd{MAX_EXTRA}q")
_MAGIC = b"DWKV"
_VERSION = 1
MSG_SIZE = _FORMAT.size


@dataclass(frozen=True)
class Msg:
    kind: Kind
    room: int
    xfer: int
    nbytes: int = 0
    tag: int = 0
    reason: str = ""
    trailer: Trailer | None = None

    def pack(self) -> bytes:
        t = self.trailer or Trailer(0)
        code = REASONS.index(self.reason) + 1 if self.reason else 0
        extra = t.extra + (0,) * (MAX_EXTRA - len(t.extra))
        return _FORMAT.pack(_MAGIC, _VERSION, self.kind, code, len(t.extra), self.room, self.xfer,
                            self.nbytes, self.tag, t.first_token, t.logprob, *extra)

    @classmethod
    def unpack(cls, data: bytes | bytearray) -> Msg:
        magic, version, kind, code, n_extra, room, xfer, nbytes, tag, token, logprob, *extra = _FORMAT.unpack(data)
        if magic != _MAGIC or version != _VERSION or code > len(REASONS) or n_extra > MAX_EXTRA:
            raise ValueError("malformed KV transfer control message")
        trailer = Trailer(token, logprob, tuple(extra[:n_extra])) if kind == Kind.OFFER else None
        return cls(Kind(kind), room, xfer, nbytes, tag, REASONS[code - 1] if code else "", trailer)
