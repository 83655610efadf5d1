"""``n`` choices of a prompt, each its own request and, in a PD pair, its own transfer room (README's
``n`` paragraph says why)."""
from __future__ import annotations

import hashlib
from dataclasses import replace

from pydantic import BaseModel

from decode_worker.config import ServerConfig
from decode_worker.core.request import GenerateInput, RequestError
from decode_worker.server.inputs import BOOTSTRAP, bootstrap, fan_out


def bootstrap_per_choice(body: BaseModel, prompts: int, total: int) -> bool:
    """True when the bootstrap fields give one entry per choice, False when one per prompt; else refused."""
    lists = {name: len(v) for name in BOOTSTRAP if isinstance(v := getattr(body, name), list)}
    lengths = set(lists.values())
    if len(lengths) > 1:  # name the field that disagrees with the prompts (or, failing that, with the others)
        name, length = min(lists.items(), key=lambda item: (item[1] in (prompts, total), item[0]))
        raise RequestError(f"{name} has {length} entries for {prompts} prompts; {', '.join(BOOTSTRAP)} must have as "
                           "many entries each")
    if not lengths or lengths == {prompts}:
        return False
    if lengths == {total}:
        return True
    per_choice = f" or {total} (one per choice)" if total != prompts else ""
    name, length = next(iter(lists.items()))
    raise RequestError(f"{name} has {length} entries: give {prompts} (one per prompt){per_choice}")


def choice_room(room: int, j: int) -> int:
    """Choice ``j``'s room, hashed from the prompt's (choice 0 keeps it), alike on prefill and decode."""
    if j == 0:
        return room
    return int.from_bytes(hashlib.sha256(f"{room}/{j}".encode()).digest()[:8], "big")


def choice_inputs(inp: GenerateInput, n: int, body: BaseModel, first: int | None,
                  cfg: ServerConfig) -> list[GenerateInput]:
    """``inp``'s ``n`` choices with their rooms; ``first``: their first bootstrap entry, None when per prompt."""
    samples = fan_out(replace(inp, bootstrap=None), n)
    if first is not None:
        boots = [bootstrap(body, first + j, cfg) for j in range(n)]
    else:
        base = inp.bootstrap
        boots = [None if base is None else replace(base, room=choice_room(base.room, j)) for j in range(n)]
    return [replace(s, bootstrap=b) for s, b in zip(samples, boots)]
