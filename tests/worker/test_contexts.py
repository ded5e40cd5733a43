"""The context managers clients enter through refs (`worker/contexts.py`): a shared state is one
client's at a time, from the moment its enter is checked, and a hold its client stopped using lapses.
Real generator context managers, entered and exited as the worker does (check, run, moved)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import grpc
import pytest

from bridge_server.wire.errors import BridgeError
from bridge_server.worker.contexts import EnteredContexts

STATE: list[str] = []       # what the managers below change: one module-level state, as vLLM's forward context


@contextlib.contextmanager
def setting(value: str) -> Iterator[None]:
    STATE.append(value)
    try:
        yield
    finally:
        if value in STATE:      # (a manager a test left entered ends when it is collected)
            STATE.remove(value)


@pytest.fixture(autouse=True)
def fresh_state() -> Iterator[None]:
    STATE.clear()
    yield
    STATE.clear()


def enter(contexts: EnteredContexts, manager: contextlib.AbstractContextManager[None], who: str) -> None:
    contexts.check("setting", "__enter__", manager, who)
    try:
        manager.__enter__()
    finally:
        contexts.moved(manager)


def refused(contexts: EnteredContexts, manager: object, who: str, method: str = "__enter__") -> BridgeError:
    with pytest.raises(BridgeError) as err:
        contexts.check("setting", method, manager, who)
    assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION, err.value
    return err.value


def test_an_enter_counts_from_its_check_so_two_clients_at_once_do_not_both_get_in() -> None:
    contexts = EnteredContexts(held=lambda obj: True)
    alices, bobs = setting("alice"), setting("bob")
    contexts.check("setting", "__enter__", alices, "alice")       # alice's enter is under way...
    assert refused(contexts, bobs, "bob").reason == "context in force"     # ...and bob's is refused
    alices.__enter__()
    contexts.moved(alices)
    assert STATE == ["alice"] and contexts.holder(__file__, "bob") == "alice"    # this module's state
    contexts.check("setting", "__exit__", alices, "alice")
    alices.__exit__(None, None, None)
    contexts.moved(alices)
    enter(contexts, bobs, "bob")                                   # free again: bob's turn
    assert STATE == ["bob"]


def test_a_hold_its_client_stopped_using_lapses_to_the_next_client_that_asks() -> None:
    contexts = EnteredContexts(held=lambda obj: True, lapse_s=0.2)
    outer, inner, bobs = setting("a-outer"), setting("a-inner"), setting("bob")
    enter(contexts, outer, "alice")
    enter(contexts, inner, "alice")
    assert refused(contexts, bobs, "bob").reason == "context in force"
    time.sleep(0.1)
    contexts.check("setting", "__exit__", inner, "alice")         # alice's use keeps her hold
    time.sleep(0.15)
    assert refused(contexts, bobs, "bob").reason == "context in force"
    inner.__exit__(None, None, None)
    contexts.moved(inner)
    time.sleep(0.3)                                                # alice goes quiet, holding `outer`
    enter(contexts, bobs, "bob")                                   # her hold has lapsed: it is ended
    assert STATE == ["bob"]
    assert "exited already" in refused(contexts, outer, "alice", "__exit__").message


def test_a_hold_kept_alive_by_nested_use_lapses_after_max_s_to_the_next_client_that_asks() -> None:
    """Alice enters and exits a manager nested under her own every 0.1 s, which renewed her hold for
    good: bob was refused for as long as she kept it up. A hold kept for max_s goes to the next client
    that asks, however it is used."""
    contexts = EnteredContexts(held=lambda obj: True, lapse_s=10.0, max_s=0.5)
    outer, bobs = setting("a-outer"), setting("bob")
    enter(contexts, outer, "alice")
    t0 = time.monotonic()
    refusals = 0
    while time.monotonic() - t0 < 1.5:
        inner = setting("a-inner")
        enter(contexts, inner, "alice")
        contexts.check("setting", "__exit__", inner, "alice")
        inner.__exit__(None, None, None)
        contexts.moved(inner)
        try:
            enter(contexts, bobs, "bob")
            break
        except BridgeError as err:
            assert err.reason == "context in force" and "or kept for 0.5 s, lapses" in err.message
            refusals += 1
        time.sleep(0.1)
    held_for = time.monotonic() - t0
    assert STATE == ["bob"], STATE                       # bob got in, alice's managers exited
    assert refusals >= 3 and 0.5 <= held_for < 1.0, (refusals, held_for)
    assert "exited already" in refused(contexts, outer, "alice", "__exit__").message


def test_a_hold_entered_again_at_once_after_an_exit_still_lapses_after_max_s() -> None:
    """Alice exited just before max_s and entered again at once, and held the state for good: bob,
    asking every 5 s, was refused 130 times in 700 s. Entered again within turn_s, her hold counts
    from her first enter; entered again after a longer pause, it is a new hold."""
    contexts = EnteredContexts(held=lambda obj: True, lapse_s=10.0, max_s=0.5, turn_s=0.3)
    bobs = setting("bob")
    t0 = time.monotonic()
    refusals = 0
    while time.monotonic() - t0 < 1.5:
        mine = setting("alice")
        enter(contexts, mine, "alice")
        try:
            enter(contexts, bobs, "bob")
            break
        except BridgeError as err:
            assert err.reason == "context in force"
            refusals += 1
        time.sleep(0.1)
        contexts.check("setting", "__exit__", mine, "alice")     # out, and at once in again
        mine.__exit__(None, None, None)
        contexts.moved(mine)
    held_for = time.monotonic() - t0
    assert STATE == ["bob"] and refusals >= 3 and 0.5 <= held_for < 1.0, (STATE, refusals, held_for)
    contexts.check("setting", "__exit__", bobs, "bob")
    bobs.__exit__(None, None, None)
    contexts.moved(bobs)
    enter(contexts, setting("alice-later"), "alice")             # a new hold: bob is refused again
    assert refused(contexts, setting("bob-2"), "bob").reason == "context in force"


@pytest.mark.parametrize("how", ["release", "another connection of the host"])
def test_a_hold_ended_otherwise_and_taken_again_at_once_still_lapses_after_max_s(how: str) -> None:
    """The same as an exit and an enter: a release of the entered manager, or its host's other
    connection entering next, does not start a new hold."""
    live: set[int] = set()
    contexts = EnteredContexts(held=lambda obj: id(obj) in live, lapse_s=10.0, max_s=0.5, turn_s=0.3)
    bobs = setting("bob")
    live.add(id(bobs))
    t0, n, mine = time.monotonic(), 0, None
    while time.monotonic() - t0 < 1.5:
        if mine is not None and how == "release":
            live.discard(id(mine))                     # released while entered: exited when pruned
        elif mine is not None:
            contexts.check("setting", "__exit__", mine, f"ipv4:10.0.0.1:{n}")
            mine.__exit__(None, None, None)
            contexts.moved(mine)
        n += 1
        mine = setting(f"alice-{n}")
        live.add(id(mine))
        enter(contexts, mine, "ipv4:10.0.0.1:1" if how == "release" else f"ipv4:10.0.0.1:{n}")
        try:
            enter(contexts, bobs, "ipv4:10.0.0.2:1")
            break
        except BridgeError as err:
            assert err.reason == "context in force"
        time.sleep(0.1)
    assert STATE == ["bob"] and 0.5 <= time.monotonic() - t0 < 1.0, (STATE, time.monotonic() - t0)


def test_settle_exits_released_managers_of_states_no_one_asks_of_again() -> None:
    live: set[int] = set()
    contexts = EnteredContexts(held=lambda obj: id(obj) in live)
    mine = setting("alice")
    live.add(id(mine))
    enter(contexts, mine, "alice")
    live.discard(id(mine))
    assert STATE == ["alice"]          # nothing asks of its state: still entered...
    contexts.settle()
    assert STATE == []                 # ...until it is settled


def test_only_the_client_that_entered_a_manager_exits_it() -> None:
    contexts = EnteredContexts(held=lambda obj: True)
    alices = setting("alice")
    enter(contexts, alices, "alice")
    with pytest.raises(BridgeError) as err:
        contexts.check("setting", "__exit__", alices, "bob")
    assert err.value.code == grpc.StatusCode.PERMISSION_DENIED and err.value.reason == "not yours", err.value
    assert STATE == ["alice"] and contexts.holder(__file__, "alice") == "alice"
    contexts.check("setting", "__exit__", alices, "alice")
    alices.__exit__(None, None, None)
    contexts.moved(alices)
    assert STATE == []


def test_a_released_manager_is_exited_once_it_is_innermost() -> None:
    live: set[int] = set()
    contexts = EnteredContexts(held=lambda obj: id(obj) in live)
    outer, inner = setting("outer"), setting("inner")
    live.update((id(outer), id(inner)))
    enter(contexts, outer, "alice")
    enter(contexts, inner, "alice")
    live.discard(id(outer))                # released under one still held: waits for it
    assert contexts.holder(__file__, "alice") == "alice" and STATE == ["outer", "inner"]
    others = setting("other")
    live.add(id(others))
    refused(contexts, others, "bob")
    assert STATE == ["outer", "inner"]
    live.discard(id(inner))                # now both are released: both exit, the innermost first
    bobs = setting("bob")
    live.add(id(bobs))
    enter(contexts, bobs, "bob")
    assert STATE == ["bob"]
