"""The decode cache modes compared, as decode flags."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from decode_worker.launch import CACHE_FLAGS

RADIX, HICACHE = CACHE_FLAGS


@dataclass(frozen=True)
class Mode:
    name: str
    radix: bool = False
    hicache: bool = False
    storage: bool = False  # L3 on files, in a folder shared with the restart row
    restart: bool = False  # a fresh pod over the L3 an earlier storage row left warm; replays the second round

    def decode_flags(self, hicache_ratio: float, storage_dir: Path, prefetch_policy: str) -> list[str]:
        flags = [RADIX] if self.radix else []
        if self.hicache:
            flags += [HICACHE, "--disaggregation-decode-hicache-ratio", str(hicache_ratio)]
        if self.storage:
            flags += ["--hicache-storage-backend", "file", "--hicache-storage-url", str(storage_dir),
                      "--hicache-storage-prefetch-policy", prefetch_policy]
        return flags


MODES = {m.name: m for m in (
    Mode("off"),
    Mode("radix", radix=True),
    Mode("hier", radix=True, hicache=True),
    Mode("hier_l3", radix=True, hicache=True, storage=True),
    Mode("restart", radix=True, hicache=True, storage=True, restart=True),
)}
WARMS_RESTART = "hier_l3"  # the row whose L3 folder and requests the restart row starts from


def check_order(names: list[str]) -> None:
    """A restart row needs the storage row before it, in the same run."""
    if "restart" in names and (WARMS_RESTART not in names or names.index(WARMS_RESTART) > names.index("restart")):
        raise ValueError(f"mode restart needs mode {WARMS_RESTART} earlier in --modes: it restarts over that L3")
