"""Our SGLang wire frames through SGLang 0.5.18's own parsers (``make test-interop``, which builds a venv with
that release; the project's venv, without sglang, does not collect them)."""
from __future__ import annotations

import struct
from collections import defaultdict
from types import MethodType, SimpleNamespace

import pytest
import torch
from sglang.srt.disaggregation.common.utils import pack_int_lists as sglang_pack_int_lists
from sglang.srt.disaggregation.common.utils import unpack_list_of_buffers
from sglang.srt.disaggregation.nixl.conn import (
    KVArgsRegisterInfo,
    NixlKVManager,
    TransferInfo,
    TransferStatus,
)
from sglang.srt.disaggregation.utils import MetadataBuffers

from decode_worker.pd.sglang_wire import (
    AuxLayout,
    Endpoint,
    Registration,
    RoomProgress,
    TransferRequest,
    pack_buffers,
    pack_int_lists,
    parse_notification,
    unpack_buffers,
)

ME = Endpoint("127.0.0.1", 17001, "decode-abc")


def test_the_registration_reads_back_field_for_field():
    """The prefill's bootstrap thread drops the guard and hands the rest to ``KVArgsRegisterInfo.from_zmq``."""
    layers, page_bytes, layer_bytes = 3, 6 * 1024, 1024
    base = 1 << 32
    ptrs = [base + r * layer_bytes for r in range(2 * layers)]
    reg = Registration(ME, b"agent-metadata", ptrs, [page_bytes] * len(ptrs), num_pages=500, aux_ptrs=[7, 8, 9],
                       layer_ids=[r // 2 for r in range(2 * layers)])
    info = KVArgsRegisterInfo.from_zmq(reg.frames()[1:])
    assert (info.room, info.endpoint, info.dst_port, info.agent_name) == ("None", "127.0.0.1", 17001, "decode-abc")
    assert info.agent_metadata == b"agent-metadata"
    assert info.dst_kv_ptrs == ptrs and info.dst_aux_ptrs == [7, 8, 9]
    assert info.dst_kv_item_lens == [page_bytes] * len(ptrs) and info.dst_kv_item_len == page_bytes
    assert info.dst_kv_mem_kinds == ["DRAM"] * len(ptrs) and info.gpu_id == 0
    assert (info.decode_tp_size, info.decode_tp_rank, info.dst_num_slots) == (1, 0, 500)
    assert info.dst_kv_layer_ids == reg.layer_ids and (info.dst_dcp_size, info.dst_dcp_rank) == (1, 0)
    assert info.dst_state_data_ptrs == [] and (info.staging_base_ptr, info.staging_total_size) == (0, 0)


@pytest.mark.parametrize("pages,prefix", [([5, 1, 9, 2], 0), ([3], 128), ([], 256)])
def test_a_request_reads_back_field_for_field(pages, prefix):
    req = TransferRequest(2**63 - 1, ME, pages, aux_slot=6, prefix_tokens=prefix)
    info = TransferInfo.from_zmq(req.frames()[1:])
    assert (info.room, info.endpoint, info.dst_port, info.agent_name) == (2**63 - 1, "127.0.0.1", 17001,
                                                                         "decode-abc")
    assert info.dst_kv_indices.tolist() == pages and info.dst_aux_index == 6
    assert (info.required_dst_info_num, info.decode_prefix_len, info.dst_state_indices) == (1, prefix, [])
    assert info.is_dummy() is False  # a full hit (no pages, a prefix) still gets its aux slot


def test_buffer_lists_match_sglangs_packing():
    lists = [[1, 2, 3], [], [2**31 - 1]]
    assert pack_int_lists(lists, "i") == sglang_pack_int_lists(lists, "i")
    assert unpack_list_of_buffers(pack_buffers([b"ab", b"", b"c"])) == [b"ab", b"", b"c"]
    assert unpack_buffers(sglang_pack_int_lists(lists, "Q")) == [struct.pack(f"<{len(x)}Q", *x) for x in lists]


@pytest.mark.parametrize("hidden,dtype", [(576, torch.bfloat16), (2048, torch.float32)])
def test_the_aux_layout_is_sglangs_metadata_buffers(hidden, dtype):
    buffers = MetadataBuffers(4, hidden_size=hidden, hidden_states_dtype=dtype)
    _, _, item_lens = buffers.get_buf_infos()
    assert AuxLayout(hidden * dtype.itemsize).item_lens == item_lens
    slot = 2
    buffers.output_ids[slot][0] = 4242
    buffers.cached_tokens[slot][:4] = torch.tensor([64, 32, 16, 16])
    buffers.output_token_logprobs_val[slot][0] = -0.75
    buffers.output_top_logprobs_val[slot][:2] = torch.tensor([-0.1, -2.0])
    buffers.output_top_logprobs_idx[slot][:2] = torch.tensor([4242, 7])
    buffers.bootstrap_room[slot][0] = 2**62 + 3
    raw = [b.view(torch.uint8)[slot].numpy().tobytes() for b in (
        buffers.output_ids, buffers.cached_tokens, buffers.output_token_logprobs_val,
        buffers.output_token_logprobs_idx, buffers.output_top_logprobs_val, buffers.output_top_logprobs_idx,
        buffers.output_topk_p, buffers.output_topk_index, buffers.output_hidden_states, buffers.bootstrap_room)]
    record = AuxLayout(hidden * dtype.itemsize).read(raw)
    assert (record.first_token, record.cached_tokens, record.room) == (4242, (64, 32, 16, 16), 2**62 + 3)
    assert record.logprob == pytest.approx(-0.75) and record.top_logprobs[:2] == [(4242, pytest.approx(-0.1)),
                                                                                    (7, pytest.approx(-2.0))]


def sglang_receiver(messages: list[bytes]) -> SimpleNamespace:
    """The state SGLang's decode-side manager keeps per room, fed ``messages`` through its own
    ``update_transfer_status`` (the manager's other parts, NIXL included, are not needed for it)."""
    fake = SimpleNamespace(agent=SimpleNamespace(get_new_notifs=lambda: {"prefill": messages}),
                           transfer_statuses=defaultdict(TransferStatus), required_prefill_response_num_table={},
                           enable_staging=False, _staging_handler=None)
    for name in ("_track_kv_arrival", "_handle_aux_notification"):
        setattr(fake, name, MethodType(getattr(NixlKVManager, name), fake))
    NixlKVManager.update_transfer_status(fake)
    return fake


@pytest.mark.parametrize("chunks", [[(0, 0), (1, 1)], [(1, 1), (0, 0)], [(0, 1)], []])
def test_room_progress_agrees_with_sglangs_own_tracking(chunks):
    """The notifications a prefill sends for a room, as its sender spells them, after each one: done for us
    exactly when SGLang's receiver calls it done."""
    room = 99
    messages = [f"{room}_kv_{chunk}_{last}_0".encode() for chunk, last in chunks]
    messages.append(f"{room}_aux".encode() if chunks else f"{room}_aux_nokv_0_0".encode())
    ours = RoomProgress()
    for i, message in enumerate(messages):
        ours.note(parse_notification(message))
        theirs = sglang_receiver(messages[: i + 1]).transfer_statuses[room]
        assert ours.done == theirs.is_done() == (i == len(messages) - 1)
