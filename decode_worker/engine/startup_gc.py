"""Start-up's objects out of the garbage collector's reach."""
from __future__ import annotations

import atexit
import gc


def freeze_startup_objects() -> None:
    """Collect once, then freeze what is left. Start-up leaves hundreds of thousands of long-lived objects (torch,
    the tokenizer, the app); a full collection walks them all holding the interpreter lock: past the event loop's
    stall limit in the server (docs/reliability.md), a stall in the middle of a step offline. Frozen, they are out of
    every collection's reach: a full one walks only newer objects. They thaw at exit, so the interpreter's last
    collections free them (bindings such as triton's report frozen ones as leaks)."""
    gc.collect()
    gc.freeze()
    atexit.unregister(gc.unfreeze)  # once, however many engines a process starts
    atexit.register(gc.unfreeze)
