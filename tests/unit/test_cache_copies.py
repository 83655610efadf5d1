"""The bookkeeping of copies in flight on its own (bare nodes and futures, no tree, no cache): copies come out
once finished and after their dependencies, a load's dependencies, a split keeping the copies current, and the
locks backups hold."""
from __future__ import annotations

from concurrent.futures import Future

from decode_worker.cache.copies import CopiesInFlight, PendingCopy
from decode_worker.cache.node import TreeNode


def chain(n: int) -> list[TreeNode]:
    """root -> n[0] -> n[1] ...; returns [root, *nodes]."""
    nodes = [TreeNode(key=b"")]
    for i in range(n):
        child = TreeNode(key=bytes([i]) * 4, parent=nodes[-1])
        nodes[-1].children[child.key] = child
        nodes.append(child)
    return nodes


def done(result=None, exc: Exception | None = None) -> Future:
    f = Future()
    f.set_exception(exc) if exc is not None else f.set_result(result)
    return f


def test_finished_copies_come_out_oldest_first_each_after_its_dependencies():
    copies = CopiesInFlight()
    backup, waiting = PendingCopy("backup", [], []), PendingCopy("backup", [], [])
    overtaking = PendingCopy("load", [], [])  # a load run ahead of the running backup
    dependent = PendingCopy("load", [], [], deps=[waiting])  # done, but its dependency is still running
    running = Future()
    copies.add(backup, done())
    copies.add(waiting, running)
    copies.add(overtaking, done())
    copies.add(dependent, done())
    assert apply(copies) == [backup, overtaking] and list(copies.queue) == [waiting, dependent]
    running.set_result(None)
    assert apply(copies) == [waiting, dependent] and not copies.queue


def apply(copies: CopiesInFlight) -> list[PendingCopy]:
    """Take out the finished copies, settling each as the cache does (in the same pass)."""
    out = []
    for op in copies.finished():
        op.ok = True
        out.append(op)
    return out


def test_a_copy_fails_with_its_future_or_a_failed_dependency():
    dep = PendingCopy("backup", [], [], future=done())
    op = PendingCopy("load", [], [], deps=[dep], future=done())
    assert not op.failed()
    dep.ok = False
    assert op.failed()
    assert PendingCopy("load", [], [], future=done(exc=OSError("dma"))).failed()


def test_a_load_depends_on_backups_writing_its_nodes_and_loads_of_their_ancestors():
    _, a, b, c = chain(3)
    load_a, save_c = PendingCopy("load", [a], [a]), PendingCopy("backup", [c], [c])
    a.loading, c.saving = load_a, save_c
    assert CopiesInFlight.load_deps([b, c]) == [save_c, load_a]
    assert CopiesInFlight.load_deps([a]) == []


def test_a_split_head_joins_the_copies_writing_the_node_in_path_order():
    _, a, b = chain(2)
    op = PendingCopy("load", [a, b], [b])
    b.loading = op
    head = TreeNode(key=b"h", parent=a)
    CopiesInFlight.follow_split(b, head)
    assert op.nodes == [a, head, b]


def test_backup_pins_count_each_lock_on_every_ancestor_below_the_root():
    _, a, b = chain(2)
    copies = CopiesInFlight()
    copies.add(PendingCopy("backup", [b], [b]), Future())
    copies.add(PendingCopy("backup", [a], [a]), Future())
    copies.add(PendingCopy("load", [b], [b]), Future())  # a load pins nothing here
    assert copies.backup_pins() == {a: 2, b: 1}
