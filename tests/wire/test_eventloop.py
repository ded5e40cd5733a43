"""The choice of event loop (bridge_server/wire/eventloop.py): each name gives that loop, a bad one is refused."""

from __future__ import annotations

import asyncio

import pytest

from bridge_server.wire import eventloop


async def running_loop_name() -> str:
    await asyncio.sleep(0)
    return eventloop.loop_name(asyncio.get_running_loop())


@pytest.mark.parametrize("name", eventloop.LOOPS)
def test_each_loop_runs_on_its_own_kind_of_loop(name: str) -> None:
    assert eventloop.run(running_loop_name(), name) == name


def test_the_default_is_uvloop() -> None:
    assert eventloop.run(running_loop_name()) == "uvloop"


def test_an_unknown_loop_is_refused_by_name(recwarn: pytest.WarningsRecorder) -> None:
    with pytest.raises(ValueError, match="event loop: expected one of uvloop, asyncio, got 'trio'"):
        eventloop.run(running_loop_name(), "trio")
    assert not [w for w in recwarn if "never awaited" in str(w.message)]
