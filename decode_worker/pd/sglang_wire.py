"""SGLang's PD wire format over NIXL, as its 0.5.18 speaks it, for a decode paired with an unmodified SGLang
prefill.

Decode pushes ZMQ multipart frames to each prefill rank (a registration once, then one frame set per request, or an
abort); prefill WRITEs the KV pages and one aux slot into decode's registered memory and tells decode with NIXL
notifications. This module is bytes in, typed values out, with no I/O: everything a peer sends is checked and a
bad value raises ``ValueError`` naming the field.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass, field

GUARD = b"NixlMsgGuard"  # the first frame of every registration and request
ABORT = b"ABORT"
PROTOCOL_VERSION = "0.5.18"  # the SGLang release whose frames these are
MAX_ROOM = (1 << 64) - 1  # rooms travel as unsigned 64-bit (the aux slot's echo)


def pack_buffers(buffers: list[bytes]) -> bytes:
    """SGLang's list-of-buffers frame: a little-endian count, each length, then the bytes; empty for none."""
    if not buffers:
        return b""
    return struct.pack(f"<{len(buffers) + 1}I", len(buffers), *map(len, buffers)) + b"".join(buffers)


def unpack_buffers(frame: bytes) -> list[bytes]:
    """``pack_buffers`` read back; the lengths must account for every byte."""
    if not frame:
        return []
    if len(frame) < 4:
        raise ValueError("buffer list: shorter than its count")
    (count,) = struct.unpack_from("<I", frame)
    start = 4 + 4 * count
    if len(frame) < start:
        raise ValueError(f"buffer list: {count} lengths do not fit in {len(frame)} bytes")
    lengths = struct.unpack_from(f"<{count}I", frame, 4)
    if start + sum(lengths) != len(frame):
        raise ValueError(f"buffer list: lengths add up to {sum(lengths)}, the frame holds {len(frame) - start}")
    out, at = [], start
    for length in lengths:
        out.append(frame[at: at + length])
        at += length
    return out


def pack_int_lists(lists: list[list[int]], fmt: str) -> bytes:
    """Lists of integers of struct format ``fmt``, as one list-of-buffers frame."""
    return pack_buffers([struct.pack(f"<{len(values)}{fmt}", *values) for values in lists])


def _ascii(value: int | str) -> bytes:
    return str(value).encode("ascii")


def _u64s(values: list[int]) -> bytes:
    return struct.pack(f"<{len(values)}Q", *values)


@dataclass(frozen=True)
class Endpoint:
    """Who decode is to a prefill rank: the address prefill may reach it at, and its NIXL agent's name."""

    ip: str
    port: int
    agent: str


@dataclass(frozen=True)
class Registration:
    """Decode's memory, sent once per prefill rank (SGLang's ``KVArgsRegisterInfo``): prefill may WRITE page
    ``p`` of region ``r`` at ``kv_ptrs[r] + p * kv_strides[r]``, for ``p < num_pages``, and aux slot ``s`` of
    buffer ``b`` at ``aux_ptrs[b] + s * item length``. Host memory, attention TP 1."""

    endpoint: Endpoint
    agent_metadata: bytes
    kv_ptrs: list[int]  # per region: 2 per layer, K then V
    kv_strides: list[int]  # bytes from one page of a region to the next
    num_pages: int
    aux_ptrs: list[int]
    layer_ids: list[int] = field(default_factory=list)  # per region; empty: regions pair by position

    def frames(self) -> list[bytes]:
        e = self.endpoint
        return [
            GUARD, b"None", e.ip.encode("ascii"), _ascii(e.port), e.agent.encode("ascii"), self.agent_metadata,
            _u64s(self.kv_ptrs), _u64s(self.aux_ptrs),
            b"",  # state buffers (hybrid models): none
            b"0",  # gpu id: host memory
            b"1", b"0",  # attention TP size and this rank
            _ascii(self.kv_strides[0] if self.kv_strides else 0),
            b"", b"",  # state item lengths and dims
            b"", b"",  # staging buffer: none
            _ascii(self.num_pages),
            ",".join(["DRAM"] * len(self.kv_ptrs)).encode("ascii"),
            _u64s(self.kv_strides),
            b"",  # state layer ids
            struct.pack(f"<{len(self.layer_ids)}I", *self.layer_ids),
            b"1", b"0",  # decode context parallel: size, rank
        ]


@dataclass(frozen=True)
class TransferRequest:
    """One request's destination (SGLang's ``TransferInfo``): the pages decode lacks, in prompt order, after
    ``prefix_tokens`` it already holds, and the aux slot for the first token."""

    room: int
    endpoint: Endpoint
    pages: list[int]
    aux_slot: int
    prefix_tokens: int = 0
    ranks: int = 1  # prefill ranks that send this room (``required_dst_info_num``)

    def frames(self) -> list[bytes]:
        e = self.endpoint
        return [
            GUARD, _ascii(self.room), e.ip.encode("ascii"), _ascii(e.port), e.agent.encode("ascii"),
            struct.pack(f"<{len(self.pages)}i", *self.pages), _ascii(self.aux_slot), _ascii(self.ranks),
            b"",  # state slots: none
            _ascii(self.prefix_tokens), b"0",  # not a dummy rank
        ]


def abort_frames(room: int) -> list[bytes]:
    """Tells prefill to drop ``room`` (0.5.18 sends no acknowledgement)."""
    return [ABORT, _ascii(room)]


@dataclass(frozen=True)
class Notification:
    """A NIXL notification from prefill: ``kv`` (chunk ``chunk`` of pages landed; ``last`` ends the room's
    chunks) or ``aux`` (the aux slot landed; ``chunks`` set when the room had no KV left to send, as after a full
    decode-side hit: the number of chunks sent before it)."""

    room: int
    kind: str
    chunk: int = 0
    last: bool = False
    pp_rank: int = 0
    chunks: int | None = None


def parse_notification(message: bytes) -> Notification:
    """``{room}_kv_{chunk}_{last}_{pp_rank}``, ``{room}_aux`` or ``{room}_aux_nokv_{pp_rank}_{chunks}``; the
    staging, state and multi-part forms (models and options decode does not register for) are refused."""
    try:
        parts = message.decode("ascii").split("_")
    except UnicodeDecodeError:
        raise ValueError("notification: not ASCII") from None
    room = _number(parts[0], "notification room", MAX_ROOM)
    kind, rest = (parts[1], parts[2:]) if len(parts) > 1 else ("", [])
    if kind == "kv" and len(rest) in (2, 3):
        last = _number(rest[1], "notification last flag", 1)
        pp_rank = _number(rest[2], "notification pp rank", 0) if len(rest) == 3 else 0
        return Notification(room, "kv", _number(rest[0], "notification chunk", 1 << 31), bool(last), pp_rank)
    if kind == "aux" and not rest:
        return Notification(room, "aux")
    if kind == "aux" and len(rest) == 3 and rest[0] == "nokv":
        return Notification(room, "aux", pp_rank=_number(rest[1], "notification pp rank", 0),
                            chunks=_number(rest[2], "notification chunk count", 1 << 31))
    raise ValueError(f"notification: unsupported form {message[:80]!r}")


def _number(text: str, name: str, most: int) -> int:
    if not text.isdigit() or (len(text) > 1 and text[0] == "0") or int(text) > most:
        raise ValueError(f"{name}: expected an integer from 0 to {most}, got {text[:24]!r}")
    return int(text)


@dataclass
class RoomProgress:
    """What has landed of one room, from its notifications (prefill pipeline-parallel size 1)."""

    chunks: set[int] = field(default_factory=set)
    expected: int | None = None  # chunks in all, once the last one (or a no-KV aux) said
    aux: bool = False

    def note(self, n: Notification) -> None:
        if n.kind == "kv":
            if n.chunk in self.chunks:
                raise ValueError(f"room {n.room}: chunk {n.chunk} arrived twice")
            self.chunks.add(n.chunk)
            if n.last:
                self._expect(n.room, n.chunk + 1)
        else:
            if self.aux:
                raise ValueError(f"room {n.room}: its aux slot arrived twice")
            self.aux = True
            if n.chunks is not None:
                self._expect(n.room, n.chunks)

    def _expect(self, room: int, count: int) -> None:
        if self.expected is not None and self.expected != count:
            raise ValueError(f"room {room}: told {self.expected} chunks, then {count}")
        self.expected = count

    @property
    def done(self) -> bool:
        return self.aux and self.expected is not None and len(self.chunks) == self.expected \
            and all(c < self.expected for c in self.chunks)


@dataclass(frozen=True)
class AuxLayout:
    """The buffers of SGLang's aux ("metadata") slot, in its order, each slot's bytes per buffer: the first token,
    cached-token counts, its logprob, top logprobs, speculative-decoding fields, the last hidden state, and the
    room it belongs to. Prefill writes with its own item lengths, so both sides must agree on these."""

    hidden_bytes: int  # hidden size x the hidden state's element size
    top_logprobs: int = 128
    sampling_mask_tokens: int = 0  # SGLANG_DISAGGREGATION_SAMPLING_MASK_MAX_TOKENS

    @property
    def item_lens(self) -> list[int]:
        lens = [16 * 4, 16 * 4, 16 * 4, 16 * 4, self.top_logprobs * 4, self.top_logprobs * 4]
        if self.sampling_mask_tokens:
            lens += [16 * 4, self.sampling_mask_tokens * 4, 16 * 4]
        return lens + [16 * 4, 16 * 8, self.hidden_bytes, 8 * 8]

    def read(self, slot: list[bytes]) -> AuxRecord:
        """One slot's values from its bytes per buffer."""
        lens = self.item_lens
        if [len(b) for b in slot] != lens:
            raise ValueError(f"aux slot: buffers of {[len(b) for b in slot]} bytes, expected {lens}")
        ids, cached, logprob, _, top_values, top_ids = slot[:6]
        k = self.top_logprobs
        return AuxRecord(
            first_token=struct.unpack_from("<i", ids)[0],
            cached_tokens=struct.unpack_from("<4i", cached),
            logprob=struct.unpack_from("<f", logprob)[0],
            top_logprobs=list(zip(struct.unpack(f"<{k}i", top_ids), struct.unpack(f"<{k}f", top_values))),
            room=struct.unpack_from("<Q", slot[-1])[0],
        )


@dataclass(frozen=True)
class AuxRecord:
    first_token: int
    cached_tokens: tuple[int, ...]  # all, device, host, storage: prefill's own cache hits
    logprob: float
    top_logprobs: list[tuple[int, float]]  # (token, logprob); zero-filled past what was asked
    room: int  # the room prefill wrote this slot for: checked against the request's


@dataclass(frozen=True)
class PrefillServerInfo:
    """A prefill's answer to ``GET /route`` with every rank at -1: its parallel layout and KV format."""

    attn_tp_size: int
    attn_cp_size: int
    dp_size: int
    pp_size: int
    page_size: int | None
    kv_cache_dtype: str | None

    @classmethod
    def parse(cls, data: object) -> PrefillServerInfo:
        if not isinstance(data, dict):
            raise ValueError(f"bootstrap /route: expected an object, got {type(data).__name__}")
        sizes = {name: _positive(data, name) for name in ("attn_tp_size", "attn_cp_size", "dp_size", "pp_size")}
        page_size = data.get("page_size")
        if page_size is not None:
            page_size = _positive(data, "page_size")
        dtype = data.get("kv_cache_dtype")
        if dtype is not None and (not isinstance(dtype, str) or len(dtype) > 32):
            raise ValueError("bootstrap /route: kv_cache_dtype is not a short string")
        return cls(**sizes, page_size=page_size, kv_cache_dtype=dtype)


@dataclass(frozen=True)
class RankInfo:
    """A prefill rank's ZMQ endpoint, from ``GET /route`` for that rank."""

    ip: str
    port: int

    @classmethod
    def parse(cls, data: object) -> RankInfo:
        if not isinstance(data, dict) or not isinstance(data.get("rank_ip"), str):
            raise ValueError("bootstrap /route: expected an object with rank_ip and rank_port")
        ip, port = data["rank_ip"], data.get("rank_port")
        if not 0 < len(ip) <= 253 or any(c.isspace() or c in "/@?#" for c in ip):
            raise ValueError(f"bootstrap /route: rank_ip {ip[:40]!r} is not a host")
        if not isinstance(port, int) or isinstance(port, bool) or not 0 < port < 65536:
            raise ValueError(f"bootstrap /route: rank_port {port!r} is not a port")
        return cls(ip, port)


def _positive(data: dict, name: str) -> int:
    value = data.get(name)
    if not isinstance(value, int) or isinstance(value, bool) or not 0 < value < 1 << 20:
        raise ValueError(f"bootstrap /route: {name} {value!r} is not a positive integer")
    return value
