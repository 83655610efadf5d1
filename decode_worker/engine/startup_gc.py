"""Start-up's objects out of the garbage collector's reach."""
from __future__ import annotations

import gc


def freeze_startup_objects() -> None:
    """Collect once, then freeze what is left. Start-up leaves hundreds of thousands of long-lived objects (torch,
    the tokenizer, the app); a full collection walks them all holding the interpreter lock: past the event loop's
    stall limit in the server (docs/reliability.md), a stall in the middle of a step offline. Frozen, they are out of
    every collection's reach: a full one walks only newer objects."""
    gc.collect()
    gc.freeze()
