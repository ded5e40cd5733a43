"""A client's tokenizer work, as the worker does it (`adapters/tokenizer_calls.py`): a truncation
is made on the text's encoding, with the ids the library's own truncation gives, the shared
tokenizer's settings untouched; a long text is encoded one at a time in the process, hosts taking
turns."""

from __future__ import annotations

import random
import threading
import time
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from adapters import tokenizer_calls
from bridge_server.tools.tiny_model import ensure_tiny_model


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    """The one the worker's calls use, whose settings no call changes (the worker's path would go
    to the library's own where they were set)."""
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(ensure_tiny_model())


@pytest.fixture(scope="module")
def library() -> Any:
    """Another, whose own truncations (which set its settings) give the ids expected."""
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(ensure_tiny_model())


def _texts() -> list[str]:
    rng = random.Random(7)
    words = ["the", "tokenizer", " ", "  ", "\n", "42", "3.14", "naïve", "日本語", "🙂", "--", "Ünïcödé", "x" * 30]
    mixed = "".join(rng.choice(words) + rng.choice(["", " ", ",", ". "]) for _ in range(4_000))
    return [
        "Once upon a time there was a tokenizer that everyone shared. " * 300,
        "\u4e00\u4e8c" * 9_000,                      # one run with no break for a pre-tokenizer
        mixed,
        "a" * 18_000,                                # one word
        "1" * 7_001,                                  # a run whose tokens pair from its start: a window of
        "1" * 9_001,                                  # its end (tried) kept other tokens, windows agreeing
        " " * 18_000 + "end",
    ]


@pytest.mark.parametrize("side", ["left", "right"])
def test_a_truncated_long_text_gets_the_library_s_ids(tokenizer: Any, library: Any, side: str) -> None:
    """Both sides, with and without special tokens, lengths from one token up: the ids are those of
    the library's own truncation of the whole text, and the shared tokenizer's settings are left as
    they were."""
    tokenizer.truncation_side = library.truncation_side = side
    backend = tokenizer._tokenizer
    try:
        for text in _texts():
            for add in (True, False):
                for max_length in (1, 5, 37):
                    want = library.encode(text, add_special_tokens=add, truncation=True, max_length=max_length)
                    got = tokenizer_calls.encode_unchanged(tokenizer, text, add, max_length)
                    assert got == want, (side, text[:20], add, max_length)
        assert backend.truncation is None
    finally:
        tokenizer.truncation_side = library.truncation_side = "right"


@settings(max_examples=40, deadline=None)
@given(st.lists(st.sampled_from(list("ab cd.,\n日🙂é1") + ["the ", "ing", "  ", "x" * 25]), min_size=1, max_size=12),
       st.integers(1, 80), st.sampled_from(["left", "right"]), st.integers(0, 2**32), st.integers(2_000, 12_000))
def test_a_truncation_agrees_with_the_library_s_on_any_text(tokenizer: Any, library: Any, pieces: list[str],
                                                             max_length: int, side: str, seed: int, n: int) -> None:
    """Long texts of random pieces."""
    rng = random.Random(seed)
    text = "".join(rng.choice(pieces) for _ in range(n))
    tokenizer.truncation_side = library.truncation_side = side
    try:
        assert tokenizer_calls.encode_unchanged(tokenizer, text, True, max_length) == \
            library.encode(text, add_special_tokens=True, truncation=True, max_length=max_length)
        assert tokenizer._tokenizer.truncation is None
    finally:
        tokenizer.truncation_side = library.truncation_side = "right"


def test_long_encodings_take_turns_by_host() -> None:
    """One long encoding at a time: a host that queued three waits behind the host that asked once
    while its first ran, and a short text never waits."""
    order: list[str] = []
    started = threading.Event()
    release = threading.Event()
    long_text = "x" * tokenizer_calls.LONG_TEXT_CHARS

    def encode(caller: str, hold: bool = False) -> None:
        with tokenizer_calls.cpu_turn(caller, long_text):
            order.append(caller)
            if hold:
                started.set()
                release.wait(10)

    first = threading.Thread(target=encode, args=("ipv4:10.0.0.1:1", True))
    first.start()
    assert started.wait(10)
    waiting = []
    for caller in ("ipv4:10.0.0.1:2", "ipv4:10.0.0.1:3", "ipv4:10.0.0.2:1"):
        waiting.append(threading.Thread(target=encode, args=(caller,)))
        waiting[-1].start()
        time.sleep(0.2)         # queued in this order
    with tokenizer_calls.cpu_turn("ipv4:10.0.0.3:1", "short"):
        order.append("short")   # at once, beside the long one
    release.set()
    for t in (first, *waiting):
        t.join(10)
    assert order == ["ipv4:10.0.0.1:1", "short", "ipv4:10.0.0.1:2", "ipv4:10.0.0.2:1", "ipv4:10.0.0.1:3"], order
