"""The bookkeeping of copies in flight on its own (bare nodes and futures, no tree, no cache): copies come out in
submission order and only once finished, a load's dependencies, a split keeping the copies current, and the
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


def test_finished_copies_come_out_in_submission_order_stopping_at_one_still_running():
    copies = CopiesInFlight()
    first, second, third = (PendingCopy("backup", [], []) for _ in range(3))
    running = Future()
    copies.add(first, done())
    copies.add(second, running)
    copies.add(third, done())  # finished, but queued behind a running copy
    assert list(copies.finished()) == [first] and len(copies) == 2
    running.set_result(None)
    assert list(copies.finished()) == [second, third] and not copies.queue


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
