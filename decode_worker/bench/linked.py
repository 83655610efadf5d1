"""`bench --link`: every mode per link; a shaped link runs in a namespaced child."""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from decode_worker.bench.deploy import DeploySpec
from decode_worker.bench.link import SHAPED_ENV, UNSHARE, Link, check_rate
from decode_worker.bench.runner import Plan, Row, run


def with_link(rows: list[Row], link: Link, tcp: float | None) -> list[Row]:
    out = [dataclasses.replace(r, link=link.name, link_gbit=link.gbit, tcp_probe_gbit=tcp) for r in rows]
    for r in out:
        check_rate(link, r.kv_probe_gbit, f"mode {r.mode}'s KV probe (one request alone, UCX over TCP)")
    return out


def _args_json(args: argparse.Namespace, log_dir: Path) -> dict:
    """The flags as JSON for the child."""
    out = {k: v for k, v in vars(args).items() if not callable(v)}
    return out | {"link": ",".join(link.name for link in args.link), "log_dir": str(log_dir)}


def run_links(args: argparse.Namespace, links: list[Link], plan: Plan, spec: DeploySpec,
              progress: Callable[[str], Callable[[], None]]) -> list[Row]:
    rows: list[Row] = []
    for link in links:
        link_spec = dataclasses.replace(spec, log_dir=spec.log_dir / link.name)
        if not link.shaped:
            rows += with_link(run(plan, link_spec, None, progress), link, None)
            continue
        link_spec.log_dir.mkdir(parents=True, exist_ok=True)
        request, result = link_spec.log_dir / "request.json", link_spec.log_dir / "rows.json"
        request.write_text(json.dumps({"args": _args_json(args, link_spec.log_dir),
                                       "link": dataclasses.asdict(link), "out": str(result)}))
        done = subprocess.run([*UNSHARE, sys.executable, "-m", "decode_worker.bench.link_child", str(request)],
                              env={**os.environ, **SHAPED_ENV}, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"the run over link {link.name} failed (exit {done.returncode}); logs in "
                               f"{link_spec.log_dir}")
        rows += [Row.from_dict(d) for d in json.loads(result.read_text())]
    return rows
