"""SGLang 0.5.18's prefill-side sender in a process of its own (its threads never end): its bootstrap server,
``NixlKVManager`` in prefill mode over per-layer K and V host buffers of seeded bytes, and one ``NixlKVSender`` per
room, driven as SGLang's prefill scheduler drives them. Only the engine look-ups (parallel groups, the serving port)
are answered here, as a prefill with attention TP 1 would. Reads one JSON command a line on stdin, answers on stdout.

Its KV is seeded bytes, or with ``SGLANG_SENDER_KV`` set, a file of ``reference_kv.py`` (a prompt's real KV, in
our model's geometry). Its HTTP port answers as an SGLang prefill server where a router or decode asks
(``http_server``), with ``SGLANG_SENDER_MODEL`` as the served model name.

Run: python tests/interop/sglang_prefill.py  ->  {"boot_port": N, "http_port": M}; then {"room", "pages",
"aux_slot", "first_token"} lines, each answered {"sent": pages sent} or {"error": why}. Optional fields:
``aux_room`` (write another room into the aux slot), ``delay_s`` (compute this long first), ``notify`` (send these
notifications instead of the transfer)."""
from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
import types
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

os.environ.setdefault("SGLANG_HOST_IP", "127.0.0.1")
ANSWERS = os.fdopen(os.dup(1), "w")  # the test reads these; whatever else prints to stdout goes to stderr
os.dup2(2, 1)

import numpy as np  # noqa: E402
import requests  # noqa: E402
import torch  # noqa: E402
from sglang.srt.disaggregation.base.conn import KVArgs, KVPoll  # noqa: E402
from sglang.srt.disaggregation.common import conn as common_conn  # noqa: E402
from sglang.srt.disaggregation.common.conn import CommonKVBootstrapServer  # noqa: E402
from sglang.srt.disaggregation.nixl.conn import NixlKVManager, NixlKVSender  # noqa: E402
from sglang.srt.disaggregation.utils import DisaggregationMode, MetadataBuffers  # noqa: E402

LAYERS, PAGE, HEADS, DIM = 3, 4, 2, 8  # tokens per page, KV heads, head dim
DTYPE = torch.bfloat16
PAGES, AUX_SLOTS, HIDDEN, SEED = 40, 8, 16, 3
DEADLINE_S = 10.0


def kv_buffers() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per-layer K and V, ``[tokens, heads, dim]``: a reference file's, or seeded values the test makes too."""
    if os.environ.get("SGLANG_SENDER_KV"):
        saved = torch.load(os.environ["SGLANG_SENDER_KV"])
        return [t.contiguous() for t in saved["k"]], [t.contiguous() for t in saved["v"]]
    generator = torch.Generator().manual_seed(SEED)
    shape = (PAGES * PAGE, HEADS, DIM)
    k = [torch.randn(shape, generator=generator).to(DTYPE) for _ in range(LAYERS)]
    v = [torch.randn(shape, generator=generator).to(DTYPE) for _ in range(LAYERS)]
    return k, v


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Prefill:
    """What the HTTP side needs to send a room as SGLang's prefill server would: set up in ``main``."""

    mgr: NixlKVManager
    meta: MetadataBuffers
    boot_port: int
    page: int
    pages: list[int]  # the reference prompt's pages, sent for every ``/generate``
    lock = threading.Lock()


def http_server() -> int:
    """An HTTP port answering as an SGLang prefill server does where a router or decode asks: ``/health``,
    ``/model_info`` and the other info routes, and ``POST /generate``, which sends the reference prompt's KV to the
    room the body names (its first token ``SGLANG_SENDER_FIRST_TOKEN``); the port."""
    name = os.environ.get("SGLANG_SENDER_MODEL", "sender-model")
    info = {"model_path": name, "served_model_name": name, "tokenizer_path": name, "is_generation": True}

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def answer(self, status: int, data: object) -> None:
            body = json.dumps(data).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            if self.path.startswith("/health"):
                self.answer(200, {})
            elif self.path == "/v1/models":
                self.answer(200, {"object": "list", "data": [{"id": name, "object": "model", "owned_by": "sglang"}]})
            else:
                self.answer(200, info)

        def do_POST(self) -> None:  # noqa: N802
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
            if self.path != "/generate" or "bootstrap_room" not in body:
                self.answer(400, {"error": {"message": "this sender serves /generate with a bootstrap_room only"}})
                return
            first = int(os.environ.get("SGLANG_SENDER_FIRST_TOKEN", "0"))
            with Prefill.lock:
                sent = send(Prefill.mgr, Prefill.meta, Prefill.boot_port, {
                    "room": int(body["bootstrap_room"]), "pages": Prefill.pages, "aux_slot": 2,
                    "first_token": first}, Prefill.page)
            if "error" in sent:
                self.answer(500, {"error": {"message": sent["error"]}})
                return
            self.answer(200, {"text": "", "output_ids": [first], "meta_info": {
                "id": str(body.get("rid", "")), "finish_reason": {"type": "length", "length": 1},
                "prompt_tokens": len(body.get("input_ids") or []), "completion_tokens": 1, "cached_tokens": 0}})

        def log_message(self, *args) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server.server_address[1]


def engine_lookups(http_port: int) -> None:
    parallel = types.SimpleNamespace(attn_tp_size=1, attn_tp_rank=0, attn_cp_size=1, attn_cp_rank=0,
                                     attn_dcp_size=1, attn_dcp_rank=0, enable_dp_attention=False, dp_size=1,
                                     nnodes=1, enable_dsa_cache_layer_split=False, load_balance_method="round_robin")
    common_conn.get_parallel = lambda: parallel
    common_conn.get_serving = lambda: types.SimpleNamespace(port=http_port)
    common_conn.get_attention_dp_size = lambda: 1
    common_conn.get_attention_dp_rank = lambda: 0
    common_conn.get_pp_group = lambda: None


def manager(boot_port: int, k: list[torch.Tensor], v: list[torch.Tensor], meta: MetadataBuffers,
            page: int) -> NixlKVManager:
    args = KVArgs()
    args.engine_rank = args.pp_rank = args.system_dp_rank = args.gpu_id = 0
    args.page_size, args.kv_cache_dtype_str = page, str(k[0].dtype).removeprefix("torch.")
    buffers = k + v
    args.kv_data_ptrs = [b.data_ptr() for b in buffers]
    args.kv_data_lens = [b.nbytes for b in buffers]
    args.kv_item_lens = [b[:page].nbytes for b in buffers]
    args.kv_layer_ids = list(range(len(k))) * 2
    args.kv_data_mem_kinds = ["DRAM"] * len(buffers)
    args.aux_data_ptrs, args.aux_data_lens, args.aux_item_lens = meta.get_buf_infos()
    args.state_types, args.state_data_ptrs, args.state_data_lens, args.state_item_lens = [], [], [], []
    args.is_hybrid_mla_backend = False
    server_args = types.SimpleNamespace(host="127.0.0.1", disaggregation_bootstrap_port=boot_port,
                                        dist_init_addr=None, pp_size=1, tp_size=1)
    return NixlKVManager(args, DisaggregationMode.PREFILL, server_args, is_mla_backend=False)


def send(mgr: NixlKVManager, meta: MetadataBuffers, boot_port: int, command: dict, page: int) -> dict:
    """What SGLang's prefill scheduler does for a room: wait for decode's request, drop the pages decode already
    holds (its ``decode_prefix_len``), fill the aux slot, send, and wait for the transfer to end."""
    room, slot = command["room"], command["aux_slot"]
    sender = NixlKVSender(mgr, f"127.0.0.1:{boot_port}", room, [0], 0)
    give_up = time.monotonic() + DEADLINE_S
    while sender.poll() == KVPoll.Bootstrapping:
        if time.monotonic() > give_up:
            return {"error": "decode's request never came"}
        time.sleep(0.005)
    time.sleep(command.get("delay_s", 0))  # a prefill still computing: an abort from decode may come meanwhile
    if "notify" in command:  # a broken prefill: raw notifications to every registered decode instead of a transfer
        for name in mgr.decode_kv_args_table:
            for message in command["notify"]:
                mgr.agent.send_notif(name, message.encode())
        return {"notified": command["notify"]}
    delta = command["pages"][sender.pop_decode_prefix_len() // page:]
    meta.output_ids[slot][0] = command["first_token"]
    meta.bootstrap_room[slot][0] = command.get("aux_room", room)
    sender.init(len(delta), slot)
    sender.send(np.array(delta, dtype=np.int32))
    while (state := sender.poll()) not in (KVPoll.Success, KVPoll.Failed):
        if time.monotonic() > give_up:
            return {"error": f"the transfer did not end: {state}"}
        time.sleep(0.005)
    return {"sent": delta} if state == KVPoll.Success else {"error": "the transfer failed"}


def main() -> None:
    http_port = http_server()
    engine_lookups(http_port)
    boot_port = free_port()
    CommonKVBootstrapServer("127.0.0.1", boot_port)
    k, v = kv_buffers()
    saved = torch.load(os.environ["SGLANG_SENDER_KV"]) if os.environ.get("SGLANG_SENDER_KV") else {}
    page, hidden = saved.get("page_size", PAGE), saved.get("hidden_size", HIDDEN)
    meta = MetadataBuffers(AUX_SLOTS, hidden_size=hidden, hidden_states_dtype=k[0].dtype)
    mgr = manager(boot_port, k, v, meta, page)
    Prefill.mgr, Prefill.meta, Prefill.boot_port, Prefill.page = mgr, meta, boot_port, page
    Prefill.pages = list(range(k[0].shape[0] // page))
    give_up = time.monotonic() + DEADLINE_S
    while requests.get(f"http://127.0.0.1:{boot_port}/route?prefill_dp_rank=-1&prefill_cp_rank=-1"
                       "&target_tp_rank=-1&target_pp_rank=-1", timeout=5).status_code != 200:
        if time.monotonic() > give_up:
            sys.exit("the sender never registered with its bootstrap server")
        time.sleep(0.05)
    print(json.dumps({"boot_port": boot_port, "http_port": http_port}), file=ANSWERS, flush=True)
    for line in sys.stdin:
        with Prefill.lock:
            answer = send(mgr, meta, boot_port, json.loads(line), page)
        print(json.dumps(answer), file=ANSWERS, flush=True)
    os._exit(0)  # SGLang's transfer and bootstrap threads never end


if __name__ == "__main__":
    main()
