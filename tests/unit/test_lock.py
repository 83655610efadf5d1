"""The locks in locks/ pin what pyproject.toml asks for, consistently, with hashes, and the environment the tests
run in is exactly the lock (a venv `make setup` built); every install path reads a lock."""
from __future__ import annotations

import importlib.metadata
import os
import re
import tomllib
from pathlib import Path

import pytest
from packaging.markers import Marker
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from decode_worker.pd.sglang_wire import PROTOCOL_VERSION

ROOT = Path(__file__).resolve().parents[2]
LOCKS = ROOT / "locks"
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+?)(?: ; (.+?))? \\$")
APART = {"torch"}  # pinned apart, installed first from the build that fits the machine


def pins(name: str) -> dict[str, str]:
    """Package -> version for the lock's entries whose marker holds here."""
    found = {}
    lines = (LOCKS / name).read_text().splitlines()
    for line, after in zip(lines, lines[1:] + [""]):
        if match := PIN.match(line):
            assert after.strip().startswith("--hash=sha256:"), f"{name}: {line} has no hash"
            if not match[3] or Marker(match[3]).evaluate():
                found[canonicalize_name(match[1])] = match[2]
    return found


def requirements(*extras: str) -> list[Requirement]:
    listed = list(PYPROJECT["dependencies"])
    for extra in extras:
        listed += PYPROJECT["optional-dependencies"][extra]
    return [r for r in map(Requirement, listed) if canonicalize_name(r.name) not in APART]


@pytest.mark.parametrize("lock, extras", [("runtime.txt", ()), ("main.txt", ("test", "bench")),
                                          ("eval.txt", ("test", "bench", "eval"))])
def test_each_lock_pins_what_pyproject_asks_within_its_ranges(lock, extras):
    locked = pins(lock)
    for req in requirements(*extras):
        version = locked.get(canonicalize_name(req.name))
        assert version is not None, f"{lock} does not pin {req.name}"
        assert req.specifier.contains(version, prereleases=True), f"{lock}: {req.name}=={version} outside {req}"
    assert not APART & locked.keys()


@pytest.mark.parametrize("lock", ["runtime.txt", "eval.txt"])
def test_the_locks_agree_with_main(lock):
    main, other = pins("main.txt"), pins(lock)
    differ = {name: (main[name], other[name]) for name in main.keys() & other.keys() if main[name] != other[name]}
    assert not differ


def test_no_cuda_runtime_in_the_locks():
    for lock in LOCKS.glob("*.txt"):
        for line in lock.read_text().splitlines():
            if re.match(r"^(nvidia|cuda)-", line):
                assert "sys_platform == 'never'" in line, f"{lock.name}: {line}"


def test_the_interop_lock_holds_sglangs_pinned_release_and_every_pin_it_lists():
    """locks/interop.txt is compiled without dependencies, so each pin is one locks/interop.in names, hashed, and
    `make test-interop` installs it with --require-hashes."""
    lines = (LOCKS / "interop.in").read_text().splitlines()
    listed = {canonicalize_name(m[1]): m[2] for m in (re.match(r"^([\w.-]+)==(\S+)$", line) for line in lines) if m}
    assert listed["sglang"] == PROTOCOL_VERSION and pins("interop.txt") == listed
    assert re.search(r"pip install [^\n]*--no-deps --require-hashes -r locks/interop.txt", (ROOT / "Makefile").read_text())


def test_the_dynamo_lock_holds_the_indexer_release_the_docs_were_checked_against():
    """locks/dynamo.txt, the venv of Dynamo's indexer (`make test-all`), pins what locks/dynamo.in names, hashed, and
    is installed with --require-hashes."""
    named = dict(re.findall(r"^([\w.-]+)==(\S+)$", (LOCKS / "dynamo.in").read_text(), re.MULTILINE))
    assert named == {"ai-dynamo-runtime": "1.6.1"} and pins("dynamo.txt")["ai-dynamo-runtime"] == "1.6.1"
    assert re.search(r"pip install [^\n]*--no-deps --require-hashes -r locks/dynamo.txt", (ROOT / "Makefile").read_text())


@pytest.mark.skipif(os.environ.get("DECODE_WORKER_UNLOCKED") == "1", reason="make test-latest: newest releases")
def test_the_environment_is_the_lock():
    """`make setup` installed locks/main.txt exactly (eval.txt, which `make test-all` adds, agrees with it)."""
    wrong = {}
    for name, version in pins("main.txt").items():
        try:
            installed = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            installed = None
        if installed != version:
            wrong[name] = (version, installed)
    assert not wrong, f"locked vs installed: {wrong}"


@pytest.mark.parametrize("path, lock", [("Makefile", "locks/main.txt"), ("docker/Dockerfile", "locks/runtime.txt"),
                                        ("docker/Dockerfile.cuda", "locks/runtime.txt"), ("README.md", "locks/main.txt")])
def test_every_install_path_reads_a_lock(path, lock):
    text = (ROOT / path).read_text()
    assert re.search(rf"pip install [^\n]*--no-deps --require-hashes -r \S*{re.escape(lock)}", text)
    project_installs = re.findall(r"pip install [^\n]*(?: -e)? (?:\.|/src)[ \\]*$", text, re.MULTILINE)
    assert project_installs and all("--no-deps" in line for line in project_installs), project_installs
