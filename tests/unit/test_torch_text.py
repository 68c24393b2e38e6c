"""Streamed text from token ids (agent/backends/torch/text.py), checked at every cut: whatever way
the tokens arrive, the pieces add up to the whole decode, and no byte of a stop string goes out."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agent.backends.torch.text import Text
from tests.models import tiny_safetensors

TOKENIZER: Any = None


@pytest.fixture(scope="module", autouse=True)
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    global TOKENIZER
    from tokenizers import Tokenizer  # the fast tokenizer's own core: decode() as transformers calls it

    TOKENIZER = Tokenizer.from_file(str(tiny_safetensors(tmp_path_factory.mktemp("m")) / "tokenizer.json"))
    return TOKENIZER


def pieces(tokens: list[int], cuts: list[int], stop: tuple[str, ...] = ()) -> tuple[str, bool]:
    text, out = Text(TOKENIZER, stop), []
    bounds = sorted({0, len(tokens), *(c % (len(tokens) + 1) for c in cuts)})
    for a, b in zip(bounds, bounds[1:]):
        piece, stopped = text.add(tokens[a:b])
        out.append(piece)
        if stopped:
            return "".join(out), True
    return "".join(out) + text.flush(), False


def sentence_ids(words: list[str]) -> list[int]:
    return list(TOKENIZER.encode(" ".join(words)).ids)


WORDS = st.lists(st.sampled_from(["The", "fleet", "weights", "are", "pinned", "by", "digest", "héllo", "naïve",
                                  "→", "🙂", "servers", "start", "in", "order", "."]), min_size=1, max_size=12)


@settings(max_examples=60, deadline=None)
@given(words=WORDS, cuts=st.lists(st.integers(0, 60), max_size=8))
def test_pieces_add_up_to_the_whole_decode_at_any_cut(words: list[str], cuts: list[int]) -> None:
    ids = sentence_ids(words)
    assert pieces(ids, cuts) == (TOKENIZER.decode(ids, skip_special_tokens=True), False)


@settings(max_examples=60, deadline=None)
@given(words=WORDS, cuts=st.lists(st.integers(0, 60), max_size=8), start=st.integers(0, 40), size=st.integers(1, 6))
def test_a_stop_string_ends_the_text_before_it_and_never_leaks(words: list[str], cuts: list[int], start: int,
                                                               size: int) -> None:
    ids = sentence_ids(words)
    whole = TOKENIZER.decode(ids, skip_special_tokens=True)
    stop = whole[start % len(whole):][:size] or whole
    out, stopped = pieces(ids, cuts, (stop, "never-there"))
    assert stopped and out == whole[:whole.index(stop)]


def test_an_incomplete_character_waits_for_its_last_byte() -> None:
    ids = sentence_ids(["🙂"])
    text = Text(TOKENIZER)
    first = [text.add([t])[0] for t in ids]
    assert "".join(first) == "🙂" and all("\ufffd" not in p for p in first)


def test_text_that_may_start_a_stop_string_is_held_until_it_does_not() -> None:
    ids = sentence_ids(["The", "fleet", "weights"])
    text = Text(TOKENIZER, ("fleet digest",))
    out = "".join(text.add([t])[0] for t in ids)
    assert out == "The fleet weights"[:len(out)] and text.flush() == "The fleet weights"[len(out):]
