"""Copies in flight between L1 and L2, each applied once it and its dependencies are done."""
from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field

import numpy as np

from decode_worker.cache.node import TreeNode
from decode_worker.cache.pool import NO_PAGES


@dataclass(eq=False)
class PendingCopy:
    """A copy on the engine and what finishing it changes."""

    kind: str  # "load" (L2->L1) or "backup" (L1->L2)
    nodes: list[TreeNode]  # nodes whose data it writes, in path order; kept current across splits
    locked: list[TreeNode]  # nodes it holds a lock on
    deps: list[PendingCopy] = field(default_factory=list)  # earlier copies it fails with (reads or loads below)
    drain: np.ndarray = field(default_factory=NO_PAGES.copy)  # L1 pages to free once done
    future: Future | None = None
    ok: bool | None = None  # set when finished

    def failed(self) -> bool:
        """It or a dependency failed (once ``future`` is done)."""
        f = self.future
        return f.cancelled() or f.exception() is not None or any(d.ok is False for d in self.deps)


class CopiesInFlight:
    """Copies submitted and not yet applied, oldest first."""

    def __init__(self) -> None:
        self.queue: deque[PendingCopy] = deque()

    def __len__(self) -> int:
        return len(self.queue)

    def add(self, op: PendingCopy, future: Future) -> None:
        op.future = future
        self.queue.append(op)

    def finished(self) -> Iterator[PendingCopy]:
        """Take out, oldest first, finished copies whose dependencies were applied (in this pass too)."""
        for op in list(self.queue):
            if op.future.done() and all(d.ok is not None for d in op.deps):
                self.queue.remove(op)
                yield op

    def futures(self) -> list[Future]:
        return [op.future for op in self.queue]

    @staticmethod
    def load_deps(nodes: list[TreeNode]) -> list[PendingCopy]:
        """Backups writing ``nodes``' L2 pages and loads of their ancestors."""
        deps = {n.saving: None for n in nodes if n.saving is not None}
        node = nodes[0].parent
        while node is not None:
            if node.loading is not None:
                deps[node.loading] = None
            node = node.parent
        return list(deps)

    @staticmethod
    def follow_split(node: TreeNode, head: TreeNode) -> None:
        """The copies writing ``node`` write ``head``, split off its front, too."""
        for op in (node.loading, node.saving):
            if op is not None:
                op.nodes.insert(op.nodes.index(node), head)

    def backup_pins(self) -> dict[TreeNode, int]:
        """Per node, the locks backups in flight hold on it."""
        pinned: dict[TreeNode, int] = {}
        for op in self.queue:
            if op.kind == "backup":
                for node in op.locked:
                    while node.parent is not None:  # the root has none
                        pinned[node] = pinned.get(node, 0) + 1
                        node = node.parent
        return pinned
