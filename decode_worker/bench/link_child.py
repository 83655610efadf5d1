"""A shaped ``bench --link`` run's child; a module apart so imports run one way."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from decode_worker.bench.command import _plan, _progress_bar
from decode_worker.bench.link import Link, check_rate, parse_links, shape_loopback, tcp_gbit
from decode_worker.bench.linked import with_link
from decode_worker.bench.runner import run


def _child(request_path: str) -> int:
    request = json.loads(Path(request_path).read_text())
    link = Link(**request["link"])
    shape_loopback(link)
    tcp = tcp_gbit()
    check_rate(link, tcp, "a plain TCP stream")
    print(f"link {link.name}: private loopback shaped, a TCP stream carries {tcp:.3f} Gbit/s", file=sys.stderr)
    args = argparse.Namespace(**request["args"])
    args.link = parse_links(args.link)
    plan, spec, _ = _plan(args)
    bar, progress = _progress_bar(plan.total_requests)
    try:
        rows = with_link(run(plan, spec, None, progress), link, tcp)
    finally:
        bar.close()
    Path(request["out"]).write_text(json.dumps([r.to_dict() for r in rows]))
    return 0


if __name__ == "__main__":
    try:
        sys.exit(_child(sys.argv[1]))
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
