"""``n`` choices of a prompt, each its own request and, in a PD pair, its own transfer room.

sglang-router sends one bootstrap entry per choice on the chat route, but one per prompt on ``/generate`` and
``/v1/completions``. Either way each choice becomes a PD request of its own: a room given per choice is used as
it is; a room given per prompt is the first choice's, and choice ``j`` takes a room derived from it and ``j``.
Prefill and decode get the same body, so both derive the same rooms, without a word between them.

Why a room per choice rather than one prefill shared by all choices: each choice's first token is sampled on
prefill under the choice's own seed, so a PD answer is the colocated one; the PD path stays one request, one room,
one hand-off, with no sharing of received pages between requests; and the copies cost prefill little, since
they arrive together and run in one extend batch (and its prefix cache holds the prompt for later ones).
"""
from __future__ import annotations

import hashlib
from dataclasses import replace

from pydantic import BaseModel

from decode_worker.config import ServerConfig
from decode_worker.core.request import GenerateInput, RequestError
from decode_worker.server.inputs import BOOTSTRAP, bootstrap, fan_out


def bootstrap_per_choice(body: BaseModel, prompts: int, total: int) -> bool:
    """True when the bootstrap fields give one entry per choice (``total`` choices over ``prompts`` prompts), False
    when one per prompt (or one for all); anything else is refused, naming the field."""
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
    """Choice ``j``'s transfer room when the router gave one room for all of a prompt's choices: choice 0 keeps it,
    the others take a 64-bit room drawn from it by hash, which prefill and decode compute alike."""
    if j == 0:
        return room
    return int.from_bytes(hashlib.sha256(f"{room}/{j}".encode()).digest()[:8], "big")


def choice_inputs(inp: GenerateInput, n: int, body: BaseModel, first: int | None,
                  cfg: ServerConfig) -> list[GenerateInput]:
    """``inp``'s ``n`` choices (``inputs.fan_out``: own ids and seeds), each with its own room in a PD pair:
    entries ``first``.. of the bootstrap lists when they are per choice (``first`` None when they are not)."""
    samples = fan_out(replace(inp, bootstrap=None), n)
    if first is not None:
        boots = [bootstrap(body, first + j, cfg) for j in range(n)]
    else:
        base = inp.bootstrap
        boots = [None if base is None else replace(base, room=choice_room(base.room, j)) for j in range(n)]
    return [replace(s, bootstrap=b) for s, b in zip(samples, boots)]
