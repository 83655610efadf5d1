"""The owner side of the probe's ``nixl_vram`` section: ``nixl_owner.py NBYTES DEVICE`` registers a buffer of the
probe's pattern (VRAM on cuda, DRAM on cpu), prints its NIXL metadata and descriptor as one JSON line, and keeps
it registered until stdin closes."""
from __future__ import annotations

import base64
import json
import sys

import torch
from nixl_cu12 import nixl_agent, nixl_agent_config


def main() -> None:
    nbytes, device = int(sys.argv[1]), sys.argv[2]
    buffer = (torch.arange(nbytes, dtype=torch.int64, device=device) % 251).to(torch.uint8)
    agent = nixl_agent("probe-owner", nixl_agent_config(backends=["UCX"]))
    registered = agent.register_memory([buffer])
    print(json.dumps({"metadata": base64.b64encode(agent.get_agent_metadata()).decode(), "addr": buffer.data_ptr(),
                      "dev": max(buffer.device.index or 0, 0)}), flush=True)
    sys.stdin.read()  # until the reader closes it
    agent.deregister_memory(registered)


if __name__ == "__main__":
    main()
