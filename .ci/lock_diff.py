"""Print the packages whose installed version differs from the lock's (or that only one side has).

Usage: lock_diff.py LOCK FREEZE, where LOCK is a uv-compiled requirements file and FREEZE is `pip list
--format=freeze`; a lock line whose marker does not hold on this interpreter is left out."""
from __future__ import annotations

import re
import sys
from pathlib import Path

from packaging.markers import Marker
from packaging.utils import canonicalize_name

PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;\\]+)\s*(?:;\s*([^\\]+?))?\s*\\?$")


def pins(path: str, markers: bool) -> dict[str, str]:
    found = {}
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        match = PIN.match(line.strip())
        if match and (not markers or not match[3] or Marker(match[3]).evaluate()):
            found[canonicalize_name(match[1])] = match[2]
    return found


def main(lock_path: str, freeze_path: str) -> None:
    lock, installed = pins(lock_path, markers=True), pins(freeze_path, markers=False)
    for apart in ("decode-worker", "torch", "pip"):  # the project, torch at its own pin, the installer
        installed.pop(apart, None)
    rows = [(name, lock.get(name, "-"), installed.get(name, "-")) for name in sorted(lock.keys() | installed.keys())
            if lock.get(name) != installed.get(name)]
    print(f"{len(rows)} packages differ from {lock_path} (lock -> newest allowed):")
    for name, locked, newest in rows:
        print(f"  {name}: {locked} -> {newest}")


if __name__ == "__main__":
    main(*sys.argv[1:3])
