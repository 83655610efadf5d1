"""The package's layers import downward only: the import-linter contract in pyproject.toml."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_import_contract_is_kept():
    lint = Path(sys.executable).with_name("lint-imports")
    run = subprocess.run([str(lint), "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    assert "2 kept, 0 broken" in run.stdout  # the package layers, and the cache's inner layers


MAX_MODULE_LINES, MAX_FUNCTION_LINES = 400, 60
LONG_REASON = "Long because"  # a docstring that says why lets a function pass the limit


def _sources() -> list[Path]:
    return sorted([*(ROOT / "decode_worker").rglob("*.py"), *(ROOT / "kernels").rglob("*.py")])


def test_no_module_or_function_outgrows_its_limit_without_a_stated_reason():
    """Small modules with one job: a newcomer finds each in one screenful or two."""
    too_long = []
    for path in _sources():
        source = path.read_text()
        if source.count("\n") > MAX_MODULE_LINES and LONG_REASON not in (ast.get_docstring(ast.parse(source)) or ""):
            too_long.append(f"{path.relative_to(ROOT)}: {source.count(chr(10))} lines")
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES and LONG_REASON not in (ast.get_docstring(node) or ""):
                    too_long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}: {lines} lines")
    assert not too_long, "over the limit without a stated reason:\n" + "\n".join(too_long)
