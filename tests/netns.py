"""A third-party server that can only listen on every interface, kept off the network: it runs in a network
namespace of its own, where the only interface is loopback, and the test reaches its TCP port through a Unix
socket bridged into that namespace (a file path crosses namespaces; an address does not).

``python -m tests.netns UDS PORT`` is the bridge: each connection to the Unix socket ``UDS`` is piped to
``127.0.0.1:PORT`` of the namespace it runs in."""
from __future__ import annotations

import asyncio
import os
import shlex
import signal
import subprocess
import sys
from pathlib import Path

from tests.servers import Proc

REPO = Path(__file__).resolve().parent.parent


def why_not_isolated() -> str | None:
    """None when this process may make a network namespace (it needs CAP_SYS_ADMIN), else why not."""
    try:
        done = subprocess.run(["unshare", "-n", "ip", "link", "set", "lo", "up"], capture_output=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"cannot run unshare: {e}"
    return None if done.returncode == 0 else f"cannot make a network namespace: {done.stderr.decode().strip()}"


def start_isolated(name: str, cmd: list[str], port: int, uds: Path, log_dir: Path) -> Proc:
    """``cmd`` in a network namespace of its own, its ``port`` reachable at the Unix socket ``uds``; the process
    group (server and bridge) goes with ``stop_isolated``."""
    bridge = [sys.executable, "-m", "tests.netns", str(uds), str(port)]
    script = f"ip link set lo up && {{ {shlex.join(bridge)} & }} && exec {shlex.join(cmd)}"
    log = log_dir / f"{name}.log"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    popen = subprocess.Popen(["unshare", "-n", "sh", "-c", script], stdout=open(log, "wb"), stderr=subprocess.STDOUT,
                             env=env, start_new_session=True)
    return Proc(name, popen, f"unix:{uds}", log)


def stop_isolated(proc: Proc) -> None:
    """SIGTERM to the server and its bridge, SIGKILL after 10 s."""
    try:
        os.killpg(proc.popen.pid, signal.SIGTERM)
        proc.popen.wait(timeout=10)
    except ProcessLookupError:
        return
    except subprocess.TimeoutExpired:
        os.killpg(proc.popen.pid, signal.SIGKILL)
        proc.popen.wait()


async def _bridge(uds: str, port: int) -> None:
    async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        finally:
            writer.close()

    async def serve(client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
        except OSError:
            client_writer.close()  # the server is not listening yet: the client sees a closed connection
            return
        await asyncio.gather(pipe(client_reader, writer), pipe(reader, client_writer), return_exceptions=True)

    server = await asyncio.start_unix_server(serve, uds)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    asyncio.run(_bridge(sys.argv[1], int(sys.argv[2])))
