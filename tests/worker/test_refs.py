"""What a ref is charged for (`worker/refs.py` `held_bytes`): everything a client's data holds,
however it nests, once."""

from __future__ import annotations

import sys

import pytest

from bridge_server.worker.refs import MAX_PARTS, TooManyParts, held_bytes


class Params:
    """A record built from a client's map, as vLLM's are: the data hangs off its attributes."""

    def __init__(self, extra: object) -> None:
        self.extra = extra
        self.max_tokens = 4


def test_text_is_counted_however_deep_and_however_far_back_it_lies() -> None:
    """A walk that stopped four levels down, or after 10,000 parts, left text nested five deep, or
    behind 10,001 empty lists, uncounted: a stranger's refs held 1.4 GB past a 1 GiB bound."""
    text = "x" * 1_000_000
    assert held_bytes(Params({"a": text})) >= len(text)
    assert held_bytes(Params({"a": [[[[[[text]]]]]]})) >= len(text)
    assert held_bytes(Params({"a": [text] + [[] for _ in range(10_001)]})) >= len(text) + 10_001 * sys.getsizeof([])
    assert held_bytes(Params({text: 1})) >= len(text)           # a key is text the client sent too


def test_what_another_ref_holds_counts_again_and_what_the_server_publishes_does_not() -> None:
    """Charged to the other ref only, it went uncounted once that ref was released while this
    object still kept it alive (300 such refs held 1.1 GB past the bound)."""
    inner = Params(["y" * 100_000])
    outer = Params([inner])
    assert held_bytes(outer) >= 100_000
    assert held_bytes(outer, published={id(inner)}) < 10_000     # (an engine the server publishes)
    assert held_bytes(inner, published={id(inner)}) >= 100_000   # the object itself is what is counted


def test_an_object_of_too_many_parts_is_refused() -> None:
    with pytest.raises(TooManyParts) as err:
        held_bytes(Params([[] for _ in range(MAX_PARTS + 1)]))
    assert err.value.reason == "max_ref_bytes_per_client" and "more than 100,000 parts" in err.value.message
