"""The ``nixl_vram`` section: one process registers a device buffer with NIXL as VRAM, another reads it into its
own registered device buffer (UCX picks the transport: CUDA IPC between two processes on one GPU). Tiny: the same
between two host buffers (DRAM), which runs on CPU.

The owner runs ``nixl_owner.py``; it prints its agent metadata and buffer descriptor as one JSON line and holds the
buffer until its stdin closes.
"""
from __future__ import annotations

import base64
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from probe.common import GB, device_of
from probe.memory import importable

DEADLINE_S = 30  # for the owner's line and for each read


def pattern(nbytes: int, device: str) -> torch.Tensor:
    return (torch.arange(nbytes, dtype=torch.int64, device=device) % 251).to(torch.uint8)


def nixl_vram(tiny: bool) -> dict:
    found = importable("nixl_cu12")
    if found.startswith("no:"):
        return {"skipped": f"nixl_cu12 is not importable ({found[4:]})"}
    from nixl_cu12 import nixl_agent, nixl_agent_config

    device, nbytes = device_of(tiny), (1 << 20 if tiny else 256 << 20)
    mem = "DRAM" if tiny else "VRAM"
    owner = subprocess.Popen([sys.executable, str(Path(__file__).with_name("nixl_owner.py")), str(nbytes), device],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        peer = owner_line(owner)
        if peer is None:
            return {"ok": False, "error": f"the owner process gave no descriptor (exit {owner.poll()})"}
        if device == "cuda":
            torch.cuda.set_device(0)  # NIXL posts on the current device
        local = torch.zeros(nbytes, dtype=torch.uint8, device=device)
        agent = nixl_agent("probe-reader", nixl_agent_config(backends=["UCX"]))
        agent.register_memory([local])
        name = agent.add_remote_agent(base64.b64decode(peer["metadata"]))
        ours = agent.prep_xfer_dlist("NIXL_INIT_AGENT", [(local.data_ptr(), nbytes, max(local.device.index or 0, 0))],
                                     mem)
        theirs = agent.prep_xfer_dlist(name, [(peer["addr"], nbytes, peer["dev"])], mem)
        handle = agent.make_prepped_xfer("READ", ours, [0], theirs, [0])
        times = [read(agent, handle) for _ in range(2 if tiny else 6)]
        exact = bool(torch.equal(local, pattern(nbytes, device)))
        agent.release_xfer_handle(handle)
        seconds = statistics.median(times[1:])
        return {"mem": mem, "bytes": nbytes, "exact": exact, "read_gbs": round(nbytes / seconds / GB, 2), "ok": exact}
    finally:
        owner.stdin.close()
        owner.wait(timeout=DEADLINE_S)


def owner_line(owner: subprocess.Popen) -> dict | None:
    """The owner's descriptor line, past whatever NIXL logs to stdout; None if it exits first (the section's own
    limit bounds the wait)."""
    for line in owner.stdout:
        if line.startswith('{"metadata"'):
            return json.loads(line)
    return None


def read(agent, handle) -> float:
    """Post one READ and poll it to DONE; seconds it took."""
    start = time.perf_counter()
    state = agent.transfer(handle)
    while state not in ("DONE", "ERR"):
        if time.perf_counter() - start > DEADLINE_S:
            raise TimeoutError(f"NIXL read not done after {DEADLINE_S} s")
        state = agent.check_xfer_state(handle)
    if state == "ERR":
        raise RuntimeError("NIXL read failed")
    return time.perf_counter() - start
