"""Streamed text deltas never send half of a multi-byte character."""
from __future__ import annotations

from decode_worker.server.routes_openai import _new_text


def test_replacement_character_is_held_back_until_complete():
    sent = ""
    for text, finished, expected in [("Hi ", False, "Hi "), ("Hi \ufffd", False, ""), ("Hi 你", False, "你"),
                                     ("Hi 你好", True, "好")]:
        delta = _new_text(text, sent, finished)
        assert delta == expected
        sent += delta
    assert sent == "Hi 你好"


def test_a_stream_that_ends_on_a_broken_character_still_sends_it():
    assert _new_text("ab\ufffd", "ab", finished=True) == "\ufffd"


def test_incremental_text_equals_the_full_decode(smollm2_path):
    from decode_worker.model.tokenizer import Tokenizer
    from decode_worker.server.generation import IncrementalText

    tok = Tokenizer.load(smollm2_path, ())
    ids = tok.encode("Hello 世界! 🚀 Ünïcödé,  two  spaces\nand code: def f(x): return x**2 <|im_end|> done")
    stream = IncrementalText(tok.decode)
    full = tok.decode(ids)
    pieces = []
    for t in ids:
        pieces.append(stream.add([t]))
        assert "\ufffd" not in stream.text and full.startswith(stream.text)
    assert "".join(pieces) == stream.text == full
