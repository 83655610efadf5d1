"""SGLang's PD wire format (``decode_worker/pd/sglang_wire.py``): what decode sends is laid out frame by frame as
SGLang 0.5.18 reads it (its own parsers check the same frames in ``tests/interop``), and what a prefill sends is
checked before use. Golden byte strings below were read off SGLang's sources."""
from __future__ import annotations

import struct

import pytest

from decode_worker.pd.sglang_wire import (
    GUARD,
    AuxLayout,
    Endpoint,
    Notification,
    PrefillServerInfo,
    RankInfo,
    Registration,
    RoomProgress,
    TransferRequest,
    abort_frames,
    pack_buffers,
    pack_int_lists,
    parse_notification,
    unpack_buffers,
)

ME = Endpoint("10.0.0.9", 17001, "decode-abc")


def test_buffer_lists_round_trip_and_refuse_lengths_that_do_not_add_up():
    assert pack_buffers([]) == b""
    assert pack_buffers([b"ab", b""]) == struct.pack("<3I", 2, 2, 0) + b"ab"
    for buffers in ([], [b""], [b"x" * 70, b"", b"yz"]):
        assert unpack_buffers(pack_buffers(buffers)) == buffers
    assert pack_int_lists([[1, 2], []], "i") == struct.pack("<3I", 2, 8, 0) + struct.pack("<2i", 1, 2)
    good = pack_buffers([b"abc"])
    for bad in (good[:3], good[:-1], good + b"!", struct.pack("<I", 1000)):
        with pytest.raises(ValueError, match="buffer list"):
            unpack_buffers(bad)


def test_a_registration_is_the_24_frames_sglang_reads():
    reg = Registration(ME, b"meta", kv_ptrs=[4096, 4096 + 640], kv_strides=[2560, 2560], num_pages=100,
                       aux_ptrs=[1, 2, 3], layer_ids=[0, 0])
    f = reg.frames()
    assert len(f) == 24 and f[0] == GUARD and f[1] == b"None"
    assert f[2:6] == [b"10.0.0.9", b"17001", b"decode-abc", b"meta"]
    assert f[6] == struct.pack("<2Q", 4096, 4736) and f[7] == struct.pack("<3Q", 1, 2, 3)
    assert f[9:13] == [b"0", b"1", b"0", b"2560"]  # gpu 0 (host), TP 1 rank 0, first stride
    assert f[17] == b"100" and f[18] == b"DRAM,DRAM" and f[19] == struct.pack("<2Q", 2560, 2560)
    assert f[21] == struct.pack("<2I", 0, 0) and f[22:] == [b"1", b"0"]


def test_a_request_names_its_pages_slot_and_prefix():
    f = TransferRequest(2**63 - 5, ME, pages=[7, 3, 9], aux_slot=4, prefix_tokens=64).frames()
    assert f == [GUARD, b"9223372036854775803", b"10.0.0.9", b"17001", b"decode-abc",
                 struct.pack("<3i", 7, 3, 9), b"4", b"1", b"", b"64", b"0"]
    assert abort_frames(12) == [b"ABORT", b"12"]


@pytest.mark.parametrize("message,expected", [
    (b"77_kv_0_0_0", Notification(77, "kv", 0, False, 0)),
    (b"77_kv_3_1_0", Notification(77, "kv", 3, True, 0)),
    (b"77_kv_2_1", Notification(77, "kv", 2, True, 0)),  # older senders leave the pp rank out
    (b"77_aux", Notification(77, "aux")),
    (b"77_aux_nokv_0_2", Notification(77, "aux", chunks=2)),
])
def test_notifications_sglang_sends_are_read(message, expected):
    assert parse_notification(message) == expected


@pytest.mark.parametrize("message,says", [
    (b"", "notification room"),
    (b"x_aux", "notification room"),
    (b"077_aux", "notification room"),  # one number, one spelling
    (b"18446744073709551616_aux", "notification room"),  # past 64 bits
    (b"7_kv_1_2_0", "last flag"),
    (b"7_kv_1_1_3", "pp rank"),  # pipeline-parallel prefills are not paired with
    (b"7_kv_1_0_0_part_0_2", "unsupported form"),
    (b"7_stg_0_1_0_0_0_4_agent", "unsupported form"),
    (b"7_state_0", "unsupported form"),
    ("7_aux\u00e9".encode(), "not ASCII"),
])
def test_a_malformed_notification_is_refused_naming_what(message, says):
    with pytest.raises(ValueError, match=says):
        parse_notification(message)


def track(*messages: bytes) -> RoomProgress:
    progress = RoomProgress()
    for m in messages:
        progress.note(parse_notification(m))
    return progress


def test_a_room_is_done_once_every_chunk_and_its_aux_landed():
    assert track(b"5_kv_0_0_0", b"5_kv_1_1_0", b"5_aux").done
    assert track(b"5_kv_1_1_0", b"5_aux", b"5_kv_0_0_0").done  # notifications may arrive in any order
    assert not track(b"5_kv_1_1_0", b"5_aux").done  # chunk 0 missing
    assert not track(b"5_kv_0_1_0").done  # no aux yet
    assert track(b"5_aux_nokv_0_0").done  # a full decode-side hit: nothing but the aux slot
    assert track(b"5_kv_0_0_0", b"5_aux_nokv_0_1").done  # the last chunk had no pages


@pytest.mark.parametrize("messages,says", [
    ((b"5_kv_0_0_0", b"5_kv_0_0_0"), "chunk 0 arrived twice"),
    ((b"5_aux", b"5_aux"), "aux slot arrived twice"),
    ((b"5_kv_1_1_0", b"5_aux_nokv_0_3"), "told 2 chunks, then 3"),
])
def test_a_room_told_contradicting_things_is_refused(messages, says):
    with pytest.raises(ValueError, match=says):
        track(*messages)


def test_the_aux_slot_is_read_from_sglangs_buffers():
    layout = AuxLayout(hidden_bytes=576 * 2)
    assert layout.item_lens == [64, 64, 64, 64, 512, 512, 64, 128, 1152, 64]
    assert AuxLayout(8, sampling_mask_tokens=32).item_lens[6:9] == [64, 128, 64]
    top = [(11, -0.5), (12, -1.5)] + [(0, 0.0)] * 126
    slot = [struct.pack("<16i", 42, *[0] * 15), struct.pack("<16i", 32, 32, 0, 0, *[0] * 12),
            struct.pack("<16f", -0.25, *[0] * 15), bytes(64), struct.pack("<128f", *[v for _, v in top]),
            struct.pack("<128i", *[t for t, _ in top]), bytes(64), bytes(128), bytes(1152),
            struct.pack("<8Q", 2**63 + 1, *[0] * 7)]
    record = layout.read(slot)
    assert (record.first_token, record.cached_tokens, record.logprob, record.room) == (42, (32, 32, 0, 0), -0.25,
                                                                                       2**63 + 1)
    assert record.top_logprobs[:2] == [(11, -0.5), (12, -1.5)]
    with pytest.raises(ValueError, match="aux slot: buffers of"):
        layout.read(slot[:-1])


def test_bootstrap_answers_are_checked():
    info = PrefillServerInfo.parse({"attn_tp_size": 1, "attn_cp_size": 1, "dp_size": 1, "pp_size": 1,
                                    "page_size": 16, "kv_cache_dtype": "auto", "follow_bootstrap_room": True})
    assert (info.attn_tp_size, info.page_size, info.kv_cache_dtype) == (1, 16, "auto")
    assert RankInfo.parse({"rank_ip": "10.0.0.3", "rank_port": 41000}) == RankInfo("10.0.0.3", 41000)
    for bad, says in (([], "expected an object"), ({"attn_tp_size": 0}, "attn_tp_size"),
                      ({"attn_tp_size": 1, "attn_cp_size": 1, "dp_size": 1, "pp_size": True}, "pp_size")):
        with pytest.raises(ValueError, match=says):
            PrefillServerInfo.parse(bad)
    for bad, says in (({"rank_ip": "a/b", "rank_port": 1}, "not a host"), ({"rank_ip": "h", "rank_port": 0},
                                                                            "not a port")):
        with pytest.raises(ValueError, match=says):
            RankInfo.parse(bad)
