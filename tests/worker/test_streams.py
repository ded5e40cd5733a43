"""How the worker steps a stream (bridge_server/worker/streams.py): pacing by what its items cost."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest

from bridge_server.worker.deadlines import Deadlines
from bridge_server.worker.streams import PACE_FACTOR, PACE_MIN_S, Pace, iterate

NO_DEADLINES = Deadlines(call=None, total=None, stream_idle_s=None)


async def _in_thread(step: Any) -> Any:
    raise AssertionError("an async source is never stepped in a thread")


def _busy(seconds: float) -> None:
    """Holds the event loop, as encoding a large item does."""
    until = time.perf_counter() + seconds
    while time.perf_counter() < until:
        pass


async def _stream_beside_a_ticker(cost_s: float, items: int) -> tuple[list[float], list[float]]:
    """Puts every item of a stream, each costing `cost_s` of the loop, while another task of the same
    loop notes each turn it gets. Returns (when each put started, the ticker's turns)."""
    async def source() -> AsyncIterator[int]:
        for i in range(items):
            yield i

    pace = Pace()
    put = pace.timed(lambda item, msg: _busy(cost_s))
    turns: list[float] = []

    async def ticker() -> None:
        while True:
            turns.append(time.perf_counter())
            await asyncio.sleep(0)

    other = asyncio.create_task(ticker())
    await asyncio.sleep(0)
    puts: list[float] = []
    async for item in iterate(source(), "test.stream", NO_DEADLINES, _in_thread, None, pace):
        puts.append(time.perf_counter())
        put(item, None)
    other.cancel()
    return puts, turns


def test_a_stream_whose_items_hold_the_loop_waits_in_proportion_and_the_loop_serves_others_meanwhile() -> None:
    cost = 4 * PACE_MIN_S
    puts, turns = asyncio.run(_stream_beside_a_ticker(cost, 6))
    assert len(puts) == 6
    for a, b in zip(puts[1:], puts[2:]):      # from the second dear item on
        # the next item is asked for only after PACE_FACTOR times the put's cost...
        assert b - a >= cost * (1 + PACE_FACTOR) * 0.95, (a, b)
        # ...and meanwhile the other task had the loop
        assert any(a + cost < t < b for t in turns)


def test_a_stream_whose_items_are_cheap_is_not_held_back() -> None:
    puts, turns = asyncio.run(_stream_beside_a_ticker(0.0, 200))
    assert len(puts) == 200
    # the source never waits, so a stream that is not paced never gives up the loop between items
    assert not any(puts[0] < t < puts[-1] for t in turns)


def test_pace_counts_every_put_of_an_item_and_the_lesser_of_two_items_decides() -> None:
    pace = Pace()
    put = pace.timed(lambda item, msg: _busy(PACE_MIN_S * 0.6))
    for _ in range(2):
        put(1, None)
        put(1, None)      # a tee puts each item twice: both count (each alone is under the bound)
        rest = pace.rest_s()
    assert rest >= PACE_MIN_S * 1.2 * PACE_FACTOR
    assert pace.rest_s() == 0.0     # nothing put since


def test_one_dear_item_among_cheap_ones_holds_nothing_back() -> None:
    pace = Pace()
    rests = []
    for spent in (0.0, 10 * PACE_MIN_S, PACE_MIN_S / 8, 10 * PACE_MIN_S, 10 * PACE_MIN_S):
        pace.spent = spent
        rests.append(pace.rest_s())
    assert rests == [0.0, 0.0, 0.0, 0.0, 10 * PACE_MIN_S * PACE_FACTOR]


def test_a_put_that_fails_still_counts() -> None:
    pace = Pace()

    def put(item: Any, msg: Any) -> None:
        _busy(PACE_MIN_S * 1.5)
        raise ValueError("cannot encode")

    for _ in range(2):
        with pytest.raises(ValueError):
            pace.timed(put)(1, None)
        rest = pace.rest_s()
    assert rest >= PACE_MIN_S * 1.5 * PACE_FACTOR


def test_a_dear_item_counts_what_sending_its_bytes_costs_too() -> None:
    """A 16 MB item of text is put by one copy (~5 ms) and copied again on its way out: the rest
    after it counts the send, as a turn does for a result."""
    from bridge_server.wire.turns import SEND_S_PER_BYTE
    from vllm_bridge.v1 import bridge_pb2 as pb

    text = "x" * 16_000_000
    for msg, dear in ((pb.StreamItem(), True), (pb.StreamItem(), False)):
        pace = Pace()

        def put_item(item: str, out: pb.StreamItem, dear: bool = dear) -> None:
            if dear:
                _busy(PACE_MIN_S)
            out.value.str = item

        put = pace.timed(put_item)
        for _ in range(2):
            put(text if dear else "x", msg)
            rest = pace.rest_s()
        if dear:
            assert rest >= (PACE_MIN_S + 16_000_000 * SEND_S_PER_BYTE) * PACE_FACTOR
        else:
            assert rest == 0.0               # a cheap put is not measured for its bytes: every token's is


def test_iterate_sends_a_caller_to_stream_only_for_what_a_stream_can_walk() -> None:
    """ITERATE on an iterable receiver is Stream's (a Call of it says so); on one that is not, both
    RPCs say why, instead of each sending the caller to the other."""
    import grpc

    from bridge_server.wire.errors import BridgeError
    from bridge_server.worker.catalog import Catalog
    from bridge_server.worker.invoke import Caller, Invoker
    from bridge_server.worker.refs import RefRegistry
    from vllm_bridge.v1 import bridge_pb2 as pb

    async def run() -> None:
        invoker = Invoker(Catalog(), RefRegistry("w-test"))

        def iterate_request(obj: object) -> pb.CallRequest:
            ref = invoker.refs.put(obj, Caller().session)
            return pb.CallRequest(target=pb.Target(kind=pb.Target.ITERATE, ref=pb.Ref(id=ref.id)))

        with pytest.raises(BridgeError) as err:
            await invoker.call(iterate_request([1, 2, 3]), Caller(), NO_DEADLINES)
        assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION and err.value.reason == "use Stream"
        items = invoker.stream(iterate_request([1, 2, 3]), Caller(), NO_DEADLINES)
        assert [item async for item, _ in items] == [1, 2, 3]
        for whole in (object(), "text", {"a": 1}):
            for run_it in (lambda r: invoker.call(r, Caller(), NO_DEADLINES),
                           lambda r: invoker.stream(r, Caller(), NO_DEADLINES).__anext__()):
                with pytest.raises(BridgeError) as err:
                    await run_it(iterate_request(whole))
                assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT, err.value
                assert "ITERATE streams the items" in err.value.message and "use Stream" not in err.value.message
        invoker.close()

    asyncio.run(run())


def test_an_object_that_answers_every_attribute_is_not_taken_for_an_iterable() -> None:
    """vLLM's platform object answers every attribute name (`__getattr__`), `__iter__` included: a
    Stream of it tried to iterate it and ended INTERNAL, where it is the caller's mistake."""
    import grpc

    from bridge_server.wire.errors import BridgeError
    from bridge_server.worker.streams import iterable

    class Anything:
        def __getattr__(self, name: str) -> None:
            return None

    class Broken:
        def __iter__(self) -> Any:
            raise TypeError("not today")

    assert hasattr(Anything(), "__iter__") and not iterable(Anything())
    assert iterable([1]) and iterable(Broken()) and not iterable("text")

    async def first(source: object) -> Any:
        return await iterate(source, "f", NO_DEADLINES, lambda step: asyncio.to_thread(step)).__anext__()

    for source, said in ((Anything(), "not iterable"), (Broken(), "not today")):
        with pytest.raises(BridgeError) as err:
            asyncio.run(first(source))
        assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT and said in err.value.message, err.value


def test_a_method_is_planned_once_per_class_and_what_replaces_it_is_planned_anew() -> None:
    """What planning a method call learns from the class is kept per class and name; each call still
    binds its own receiver, and a method the class or the instance replaced since is planned again
    (the surface's checks with it), never served from what was kept."""
    import grpc

    from bridge_server.wire.errors import BridgeError
    from bridge_server.worker.catalog import Catalog
    from bridge_server.worker.invoke import Caller, Invoker
    from bridge_server.worker.refs import RefRegistry
    from vllm_bridge.v1 import bridge_pb2 as pb

    class Box:
        def __enter__(self) -> str:
            return f"class {id(self)}"

        def __exit__(self, *exc: object) -> None:
            return None

    invoker = Invoker(Catalog(), RefRegistry("w-test"))

    def plan(obj: object, name: str = "__enter__") -> Any:
        ref = invoker.refs.put(obj, Caller().session)
        return invoker.plan(pb.Target(kind=pb.Target.METHOD, name=name, ref=pb.Ref(id=ref.id)), Caller())

    a, b = Box(), Box()
    first, second = plan(a), plan(b)
    assert (first.receiver, second.receiver) == (a, b)
    assert (first.fn(), second.fn()) == (f"class {id(a)}", f"class {id(b)}")
    assert second.signature is first.signature and not second.fill_exit_args and plan(a, "__exit__").fill_exit_args

    async def patched(self: Box, how: str) -> str:
        return how

    Box.__enter__ = patched                     # type: ignore[method-assign, assignment]
    again = plan(a)
    assert again.is_async and again.receiver is a
    b.__enter__ = lambda *given: given          # type: ignore[method-assign]
    again = plan(b)
    assert not again.is_async and again.fn(1, 2) == (1, 2) and list(again.signature.parameters) == ["given"]
    for _ in range(2):      # a member off the surface is refused every time, however often it is asked for
        with pytest.raises(BridgeError) as err:
            plan(a, "__init__")
        assert err.value.code == grpc.StatusCode.PERMISSION_DENIED
    invoker.close()
