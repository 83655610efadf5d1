"""A shared KV pool between real processes: its owner hands the sealed file over a Unix socket, another process on
this host maps it read-only and sees its bytes, and every way a peer could hand over other memory, or another
process could pull or change the pool, is refused with the reason."""
from __future__ import annotations

import dataclasses
import fcntl
import json
import os
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from decode_worker.cache.pool import KVLayout, KVPool
from decode_worker.core.shared_memory import SEALS, check_memory_file, shared_zeros
from decode_worker.transfer import pool_share
from decode_worker.transfer.pool_share import PoolServer, SharedRegion, receive_pool, socket_name

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}
LAYOUT = KVLayout("t@0", num_layers=2, num_kv_heads=2, head_dim=16, page_size=4, dtype=torch.bfloat16)
PAGES = 8
NBYTES = PAGES * LAYOUT.page_bytes

OWNER = """
import json, sys, torch
from decode_worker.cache.pool import KVPool
from decode_worker.transfer.pool_share import PoolServer
from tests.unit.test_shared_memory import LAYOUT, PAGES
pool = KVPool(LAYOUT, PAGES, shared=True)
pool.buffer.view(torch.uint8).view(PAGES, -1)[:, :] = torch.arange(PAGES, dtype=torch.uint8).view(PAGES, 1) + 1
server = PoolServer(pool.shared)
print(json.dumps({"region": server.region.to_dict(), "fd": pool.shared.fd}), flush=True)
sys.stdin.read()
"""

SENDER = """
import fcntl, json, os, sys
from decode_worker.core.shared_memory import SEALS, SharedFile
from decode_worker.transfer.pool_share import PoolServer
nbytes, folder, kinds = int(sys.argv[1]), sys.argv[2], sys.argv[3:]

def open_file(kind):
    path = f"/dev/shm/decode-worker-test-{os.getpid()}" if kind == "dev_shm_file" else f"{folder}/{kind}"
    if kind == "fifo":
        os.mkfifo(path)
        return os.open(path, os.O_RDWR)  # a reader that opened it by path would wait for a writer
    if kind in ("plain_file", "dev_shm_file"):
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        os.pwrite(fd, bytes(nbytes), 0)
        os.unlink(path)
        return fd
    fd = os.memfd_create("kv", os.MFD_ALLOW_SEALING)
    os.fchmod(fd, 0o644 if kind == "open_to_others" else 0o600)
    size = 2 * nbytes if kind == "wrong_size" else nbytes
    os.ftruncate(fd, size)
    if kind != "sparse":
        os.pwrite(fd, bytes(size), 0)
    if kind != "unsealed":
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
    if kind == "other_uid":
        os.fchown(fd, 65534, 65534)
    return fd

servers = {kind: PoolServer(SharedFile(open_file(kind), nbytes)) for kind in kinds}
print(json.dumps({kind: server.region.to_dict() for kind, server in servers.items()}), flush=True)
sys.stdin.read()
"""

FORGER = """
import json, os, socket, sys
from decode_worker.core.shared_memory import shared_zeros
from decode_worker.transfer.pool_share import socket_name
victim, nbytes = int(sys.argv[1]), int(sys.argv[2])
_, shared = shared_zeros((nbytes,), __import__("torch").uint8, owner=sys)
listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
listener.bind(socket_name(victim, "ab" * 16))  # the name a reader derives for the victim's pid
listener.listen()
print("ready", flush=True)
conn, _ = listener.accept()
conn.recv(128)
socket.send_fds(conn, [b"ok"], [shared.fd])
sys.stdin.read()
"""

WRITER = """
import json, sys
from decode_worker.transfer.pool_share import SharedRegion, receive_pool
mapping, why = receive_pool(SharedRegion.from_dict(json.loads(sys.argv[1])), 8, int(sys.argv[2]), 5.0)
print("mapped" if mapping else why, flush=True)
mapping.pages[0, 0] = 7  # read-only: this must kill us, never reach the owner's pool
print("wrote", flush=True)
"""

RESIZER = """
import os, sys
fd = os.open(f"/proc/{sys.argv[1]}/fd/{sys.argv[2]}", os.O_RDWR)  # we may: same uid as the owner
for size in (0, int(sys.argv[3]) * 2):
    try:
        os.ftruncate(fd, size)
        print("resized", size)
    except OSError as e:
        print(e.errno)
"""


def start(script: str, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", script, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True, cwd=ROOT, env=ENV)


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.stdin.close()
        proc.wait(10)


def start_owner() -> tuple[subprocess.Popen, SharedRegion, int]:
    """A process that owns a shared pool of ``PAGES`` pages (page ``i`` holds bytes ``i + 1``) and serves it:
    ``(process, its region, the pool file's descriptor number there)``."""
    proc = start(OWNER)
    hello = json.loads(proc.stdout.readline())
    return proc, SharedRegion.from_dict(hello["region"]), hello["fd"]


@pytest.fixture(scope="module")
def owner():
    """One owner for the tests that leave it running."""
    proc, region, fd = start_owner()
    yield proc, region, fd
    stop(proc)


SENT_KINDS = {
    "fifo": "not a regular file",
    "plain_file": "not a memory file",
    "dev_shm_file": "not a memory file",
    "unsealed": "not sealed against resizing",
    "wrong_size": f"holds {2 * NBYTES} bytes, its pool {NBYTES}",
    "sparse": "sparse",
    "open_to_others": "open to other users",
    "other_uid": "belongs to uid 65534",
}


@pytest.fixture(scope="module")
def senders(tmp_path_factory):
    """A process serving, as ``PoolServer`` serves a pool, each kind of file in ``SENT_KINDS``: kind -> region."""
    kinds = [k for k in SENT_KINDS if k != "other_uid" or os.getuid() == 0]  # only root can chown
    proc = start(SENDER, str(NBYTES), str(tmp_path_factory.mktemp("sent")), *kinds)
    regions = {kind: SharedRegion.from_dict(r) for kind, r in json.loads(proc.stdout.readline()).items()}
    yield regions
    stop(proc)


def test_a_shared_pool_is_zeroed_sealed_and_private():
    pool = KVPool(LAYOUT, 5, shared=True)
    assert pool.buffer.shape == LAYOUT.pages_shape(5) and pool.buffer.dtype == LAYOUT.dtype
    assert int(pool.buffer.count_nonzero()) == 0
    assert pool.shared.nbytes == 5 * LAYOUT.page_bytes
    assert fcntl.fcntl(pool.shared.fd, fcntl.F_GET_SEALS) & SEALS == SEALS
    assert stat.S_IMODE(os.fstat(pool.shared.fd).st_mode) == 0o600
    assert check_memory_file(pool.shared.fd, pool.shared.nbytes, os.getuid()) == ""
    assert KVPool(LAYOUT, 5).shared is None  # only when asked


def test_another_process_gets_the_pool_and_sees_its_bytes_until_it_exits():
    proc, region, _ = start_owner()
    mapping, why = receive_pool(region, PAGES, LAYOUT.page_bytes, 5.0)
    assert mapping is not None, why
    assert mapping.pages.shape == (PAGES, LAYOUT.page_bytes)
    assert torch.equal(mapping.pages[:, 0], torch.arange(1, PAGES + 1, dtype=torch.uint8))
    assert torch.equal(mapping.pages[5], torch.full((LAYOUT.page_bytes,), 6, dtype=torch.uint8))
    assert not mapping.owner_exited()
    proc.kill()
    proc.wait(10)
    assert mapping.owner_exited()  # what lets a reader drop a dead peer's memory
    mapping.close()
    mapping, why = receive_pool(region, PAGES, LAYOUT.page_bytes, 5.0)
    assert mapping is None and str(region.pid) in why


def test_the_mapping_is_read_only(owner):
    _, region, _ = owner
    writer = subprocess.run([sys.executable, "-c", WRITER, json.dumps(region.to_dict()), str(LAYOUT.page_bytes)],
                            capture_output=True, text=True, cwd=ROOT, env=ENV, timeout=60)
    assert writer.stdout.splitlines() == ["mapped"] and writer.returncode != 0
    mapping, _ = receive_pool(region, PAGES, LAYOUT.page_bytes, 5.0)
    assert int(mapping.pages[0, 0]) == 1  # the owner's byte is intact


def test_a_third_process_cannot_resize_the_pool_under_its_readers(owner):
    """Reopened read-write through /proc (which its uid may do), the file still neither shrinks (a reader's next
    copy would die with SIGBUS) nor grows: both are sealed."""
    proc, region, fd = owner
    resizer = subprocess.run([sys.executable, "-c", RESIZER, str(proc.pid), str(fd), str(region.nbytes)],
                             capture_output=True, text=True, timeout=60)
    assert resizer.stdout.split() == ["1", "1"], resizer.stdout + resizer.stderr  # EPERM twice
    mapping, why = receive_pool(region, PAGES, LAYOUT.page_bytes, 5.0)
    assert mapping is not None, why
    assert int(mapping.pages[PAGES - 1, -1]) == PAGES


@pytest.mark.parametrize("change, reason", [
    (dict(host="another-boot-id"), "another host"),
    (dict(key="0" * 64), "wrong key"),
    (dict(socket="0" * 32), "cannot be reached"),
    (dict(nbytes=NBYTES + LAYOUT.page_bytes), f"not its pool of {PAGES} pages"),
    (dict(nbytes=NBYTES - 1), f"not its pool of {PAGES} pages"),
])
def test_a_region_naming_other_memory_is_refused_with_the_reason(owner, change, reason):
    _, region, _ = owner
    mapping, why = receive_pool(dataclasses.replace(region, **change), PAGES, LAYOUT.page_bytes, 5.0)
    assert mapping is None and reason in why


def test_a_pool_larger_than_this_host_is_never_asked_for(owner):
    _, region, _ = owner
    pages = (1 << 50) // LAYOUT.page_bytes
    mapping, why = receive_pool(dataclasses.replace(region, nbytes=pages * LAYOUT.page_bytes), pages,
                                LAYOUT.page_bytes, 5.0)
    assert mapping is None and "larger than this host's memory" in why


def test_a_sender_of_another_uid_is_refused(owner):
    _, region, _ = owner
    mapping, why = receive_pool(region, PAGES, LAYOUT.page_bytes, 5.0, uid=os.getuid() + 1)
    assert mapping is None and f"served by uid {os.getuid()}" in why


@pytest.mark.parametrize("kind", SENT_KINDS)
def test_a_file_that_is_not_a_sealed_private_pool_is_refused(senders, kind):
    """Whatever a peer sends, the reader never maps it unless it is a fully allocated memfd of the size its pool
    implies, sealed against resizing and private to its uid; a FIFO is refused without waiting on it."""
    if kind not in senders:
        pytest.skip("only root can give a file to another uid")
    started = time.monotonic()
    mapping, why = receive_pool(senders[kind], PAGES, LAYOUT.page_bytes, 5.0)
    assert mapping is None and SENT_KINDS[kind] in why, why
    assert time.monotonic() - started < 1.0


def test_a_forged_sender_is_refused_by_its_pid():
    """A process that binds the socket name a reader derives for another pid (ours here) still is not that pid."""
    forger = start(FORGER, str(os.getpid()), str(NBYTES))
    try:
        assert forger.stdout.readline().strip() == "ready"
        region = SharedRegion("", os.getpid(), "ab" * 16, NBYTES, "cd" * 32)
        region = dataclasses.replace(region, host=pool_share.boot_id())
        mapping, why = receive_pool(region, PAGES, LAYOUT.page_bytes, 5.0)
        assert mapping is None and why == f"its pool socket is served by process {forger.pid}, not {os.getpid()}"
    finally:
        forger.kill()
        forger.wait(10)


def test_a_silent_sender_costs_the_reader_its_timeout_and_no_more():
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(socket_name(os.getpid(), "ef" * 16))
    listener.listen()  # never accepts, never answers
    try:
        region = SharedRegion(pool_share.boot_id(), os.getpid(), "ef" * 16, NBYTES, "cd" * 32)
        started = time.monotonic()
        mapping, why = receive_pool(region, PAGES, LAYOUT.page_bytes, 0.3)
        assert mapping is None and "did not answer in time" in why
        assert 0.25 < time.monotonic() - started < 1.0
    finally:
        listener.close()


def ask(region: SharedRegion, key: str, user: int | None = None) -> str:
    """What the owner answers a local process (of ``user``) that connects and sends ``key``."""
    client = (f"import socket\ns = socket.socket(socket.AF_UNIX)\n"
              f"s.connect({socket_name(region.pid, region.socket)!r})\n"
              f"try:\n    s.sendall(b'{key}\\n')\n    m, fds, _, _ = socket.recv_fds(s, 128, 1)\n"
              "    print(m.decode(), len(fds))\nexcept OSError as e:\n    print(type(e).__name__)")
    python = sys.executable if user is None else "/usr/bin/python3"  # ours may lie where that user cannot reach
    return subprocess.run([python, "-c", client], capture_output=True, text=True, timeout=30, user=user).stdout.strip()


def test_the_owner_sends_the_file_only_to_its_uid_with_the_key(owner):
    _, region, _ = owner
    assert ask(region, region.key) == "ok 1"
    assert ask(region, "0" * 64) == "refused: wrong key 0"
    if os.getuid() == 0 and os.path.exists("/usr/bin/python3"):  # only root can start a process of another uid
        # refused at connect: it reads why, or finds the connection closed under its key; never the file
        assert ask(region, region.key, user=65534) in ("refused: uid 65534 is not ours 0", "BrokenPipeError",
                                                       "ConnectionResetError")


def test_a_stalled_client_does_not_hold_up_the_next(owner):
    _, region, _ = owner
    stalled = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stalled.connect(socket_name(region.pid, region.socket))  # and sends nothing
    stalled.settimeout(5)
    try:
        started = time.monotonic()
        mapping, why = receive_pool(region, PAGES, LAYOUT.page_bytes, 5.0)
        assert mapping is not None, why
        assert time.monotonic() - started < 0.5
        assert stalled.recv(16) == b""  # hung up on once its time to send the key ran out
    finally:
        stalled.close()


@pytest.mark.parametrize("field, value", [
    ("pid", "12"), ("pid", True), ("pid", 0), ("nbytes", -1), ("socket", "../etc"), ("key", "xyz"), ("host", ""),
])
def test_a_malformed_region_is_refused_naming_the_field(field, value):
    good = SharedRegion("boot", 12, "ab" * 16, NBYTES, "cd" * 32).to_dict()
    with pytest.raises(ValueError, match=f"shared.{field}"):
        SharedRegion.from_dict({**good, field: value})
    assert "cd" * 32 not in repr(SharedRegion.from_dict(good))  # the key stays out of logs


def test_the_owner_closes_the_file_when_its_pool_goes():
    owner = object.__new__(type("Owner", (), {}))
    _, shared = shared_zeros((4, 16), torch.float32, owner)
    assert os.path.exists(f"/proc/self/fd/{shared.fd}")
    del owner
    deadline = time.monotonic() + 5
    while os.path.exists(f"/proc/self/fd/{shared.fd}") and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not os.path.exists(f"/proc/self/fd/{shared.fd}")


def test_the_server_stops_serving_when_closed():
    pool = KVPool(LAYOUT, 2, shared=True)
    server = PoolServer(pool.shared)
    region = server.region
    server.close()
    mapping, why = receive_pool(region, 2, LAYOUT.page_bytes, 1.0)
    assert mapping is None and "cannot be reached" in why
