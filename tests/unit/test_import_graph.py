"""The package's import graph has no circle, imports made only for type checking included: each circle marks a
piece in the wrong module (a lower layer naming a higher one). grimp builds the graph import-linter checks its
layer contract on; this test finds what a layer contract cannot, a circle inside one layer."""
from __future__ import annotations

import graphlib

import grimp


def import_circles(package: str) -> list[list[str]]:
    """Every circle in ``package``'s graph, one per strongly connected group of modules, as a module path."""
    graph = grimp.build_graph(package)
    edges = {m: graph.find_modules_directly_imported_by(m) for m in graph.modules}
    circles = []
    while True:
        try:
            graphlib.TopologicalSorter(edges).prepare()
            return circles
        except graphlib.CycleError as err:
            circle = err.args[1][::-1]  # [a, b, ..., a]: a imports b, ...
            circles.append(circle)
            edges[circle[0]] = edges[circle[0]] - {circle[1]}  # break it and look for the next


def test_finds_a_circle(tmp_path, monkeypatch):
    pkg = tmp_path / "circ"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from circ import b\n")
    (pkg / "b.py").write_text("import circ.a\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert [sorted(set(c)) for c in import_circles("circ")] == [["circ.a", "circ.b"]]


def test_decode_worker_has_no_import_circle():
    circles = import_circles("decode_worker")
    assert not circles, "import circles: " + "; ".join(" -> ".join(c) for c in circles)
