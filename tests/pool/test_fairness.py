"""A pool's queue is fair between clients (bridge_server/pool/poolstate.py): one client's flood of
calls neither fills the queue for everyone nor puts another client's call behind all of its own."""

from __future__ import annotations

import asyncio
import itertools

import grpc
import pytest

from bridge_server.pool.config import PoolConfig
from bridge_server.pool.poolstate import SESSION_CAP, Backend, Plan, PoolRouter, client_share
from bridge_server.wire.errors import BridgeError


def _pool(slots: int, queue_size: int) -> tuple[PoolRouter, Backend]:
    pool = PoolRouter(PoolConfig("p", max_concurrent=slots, queue_size=queue_size))
    backend = Backend("p-0", "p", "unix:/nowhere", slots)
    pool.add(backend)
    return pool, backend


def _anywhere(pool: PoolRouter) -> Plan:
    return Plan(pool, None, None, False, "", None)


def test_a_freed_slot_goes_to_the_client_served_least_recently_each_clients_calls_in_order() -> None:
    async def main() -> list[str]:
        pool, backend = _pool(slots=1, queue_size=100)
        assert pool.take(_anywhere(pool)) is backend            # the one slot is busy
        order: list[str] = []

        async def call(client: str, n: int) -> None:
            await pool.wait(_anywhere(pool), None, client)
            order.append(f"{client}{n}")
            await asyncio.sleep(0)
            pool.release(backend, client)

        tasks = [asyncio.create_task(call("flood", i)) for i in range(5)]
        await asyncio.sleep(0)
        tasks += [asyncio.create_task(call("other", i)) for i in range(2)]
        tasks.append(asyncio.create_task(call("third", 0)))
        await asyncio.sleep(0)
        pool.release(backend)                                   # the busy slot frees: the queue drains
        await asyncio.gather(*tasks)
        return order

    # the flood came first, so it is served first; then each client in turn, each in its own order
    assert asyncio.run(main()) == ["flood0", "other0", "third0", "flood1", "other1", "flood2", "flood3", "flood4"]


def test_one_client_may_not_fill_the_queue_and_others_still_queue() -> None:
    async def main() -> None:
        pool, backend = _pool(slots=1, queue_size=8)
        pool.take(_anywhere(pool))
        share = client_share(8)
        assert share == 6 and client_share(2) == 2 and client_share(1024) == 768
        waiting = [asyncio.create_task(pool.wait(_anywhere(pool), None, "flood")) for _ in range(share)]
        await asyncio.sleep(0)
        with pytest.raises(BridgeError) as err:
            await pool.wait(_anywhere(pool), None, "flood")
        assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and err.value.reason == "client queue full"
        assert "queue full for this client: 6 of its calls wait" in err.value.message
        other = asyncio.create_task(pool.wait(_anywhere(pool), None, "other"))
        await asyncio.sleep(0)
        pool.release(backend)                                   # to the flood's first: it came first
        await asyncio.sleep(0)
        assert waiting[0].done() and not other.done()
        pool.release(backend, "flood")
        assert await asyncio.wait_for(other, 5) is backend      # then the other client, ahead of five more
        assert not any(t.done() for t in waiting[1:])
        for t in waiting:
            t.cancel()
        await asyncio.gather(*waiting, return_exceptions=True)
        assert not pool.queue and not pool.queued               # nothing left behind, counts included

    asyncio.run(main())


def test_the_streams_of_one_host_together_leave_the_last_quarter_to_other_hosts() -> None:
    """Without authentication a client is a connection (or a Multiplex stream on it), and a stranger
    opens as many as it likes: two floods of 800 starts took 768 and 256 places of 1,024, and every
    other caller found the queue full. A host's clients together now take at most three quarters,
    and each of them at most three quarters of what its host's others left it."""
    async def main() -> None:
        pool, backend = _pool(slots=1, queue_size=64)
        pool.take(_anywhere(pool))
        attacker = [f"ipv4:10.0.0.1:{5000 + i} multiplex {i}" for i in range(6)]
        taken: list[int] = []
        waiting: list[asyncio.Task[Backend]] = []
        for stream in attacker:                     # each stream queues until it is refused
            n = 0
            while True:
                try:
                    waiting.append(asyncio.create_task(pool.wait(_anywhere(pool), None, stream)))
                    await asyncio.sleep(0)
                    if waiting[-1].done():
                        waiting[-1].result()
                    n += 1
                except BridgeError as exc:
                    waiting.pop()
                    last = exc
                    break
            taken.append(n)
        assert taken[:4] == [36, 9, 3, 0], taken    # 3/4 of 48, then of 12, then 3 (a quarter of 3 is none)
        assert sum(taken) == 48 and last.reason == "host queue full", (taken, last)
        assert "calls from ipv4:10.0.0.1 wait" in last.message
        same_host = asyncio.create_task(pool.wait(_anywhere(pool), None, "ipv4:10.0.0.1:6000"))
        other_host = [asyncio.create_task(pool.wait(_anywhere(pool), None, f"ipv4:10.0.0.2:{7000 + i}"))
                      for i in range(2)]
        await asyncio.sleep(0)
        with pytest.raises(BridgeError) as err:
            await same_host
        assert err.value.reason == "host queue full", err.value
        assert not any(t.done() for t in other_host)       # queued: the last quarter is theirs
        for t in [*waiting, *other_host]:
            t.cancel()
        await asyncio.gather(*waiting, *other_host, return_exceptions=True)
        assert not pool.queue and not pool.queued and not pool.queued_by_host   # nothing left behind

    asyncio.run(main())


def test_a_call_that_queues_after_every_slot_freed_is_served_at_once() -> None:
    """A Multiplex start that finds every slot busy queues from a task of its own: by the time that
    task runs, every running call may have ended, each release finding the queue empty. The waiter
    must not sit in the queue of an idle worker (it hung until some other call ended)."""
    async def main() -> None:
        pool, backend = _pool(slots=2, queue_size=10)
        plan = _anywhere(pool)
        assert pool.take(plan) is backend and pool.take(plan) is backend and pool.take(plan) is None
        pool.release(backend)
        pool.release(backend)                      # both end before the third call joins the queue
        assert await asyncio.wait_for(pool.wait(plan, None, "late"), 5) is backend
        assert backend.in_flight == 1 and not pool.queue

    asyncio.run(main())


def test_one_host_holds_at_most_its_share_of_the_slots_and_others_still_run() -> None:
    """One connection's 64 streams of long generations, each read as it came, held every slot of the
    pool: every other client's call, a `divide` too, waited 60 s and failed, health SERVING. A host
    holds at most 15/16 of a pool's slots (a pool of fewer than 16 keeps none back); its further calls
    wait for its own to end, while another host's run at once."""
    async def main() -> None:
        pool, backend = _pool(slots=64, queue_size=100)
        plan = _anywhere(pool)
        stranger = [f"ipv4:10.0.0.1:{5000 + i}" for i in range(64)]
        held = [c for c in stranger if pool.take(plan, c) is backend]
        assert len(held) == 60 and pool.holding["ipv4:10.0.0.1"] == 60, pool.holding
        more = asyncio.create_task(pool.wait(plan, None, stranger[60]))
        await asyncio.sleep(0)
        assert not more.done() and backend.in_flight == 60          # four slots free, kept for others
        bystander = "ipv4:10.0.0.2:7000"
        assert pool.take(plan, bystander) is backend                 # at once
        pool.release(backend, held[0])                               # one of its own ends: its next runs
        assert await asyncio.wait_for(more, 5) is backend and pool.holding["ipv4:10.0.0.1"] == 60
        pool.release(backend, bystander)
        for c in [*held[1:], stranger[60]]:
            pool.release(backend, c)
        assert backend.in_flight == 0 and not pool.holding
        small, only = _pool(slots=4, queue_size=10)                  # fewer than 16 slots: all of them
        assert all(small.take(_anywhere(small), f"ipv4:10.0.0.1:{i}") is only for i in range(4))

    asyncio.run(main())


def test_a_flood_of_new_sessions_evicts_its_own_pins_and_not_the_others() -> None:
    """The pool remembers SESSION_CAP pins, least recently used first; a stranger's 100,000 calls
    under new session names had evicted every other client's pins, moving a strict session off the
    worker holding its state. A host past half the pins evicts its own, and within it a connection
    past half of its host's, its own: a client of another host, and another connection of the
    stranger's own host, keep theirs."""
    pool, first = _pool(slots=4, queue_size=8)
    second = Backend("p-1", "p", "unix:/nowhere-1", 4)
    pool.add(second)
    pool.pin("bob", second, "ipv4:10.0.0.2:5000")
    pool.pin("carol", second, "ipv4:127.0.0.1:4000")          # the stranger's host, another connection
    for i in range(SESSION_CAP + 500):
        pool.pin(f"flood-{i}", first, "ipv4:127.0.0.1:5000")
    assert len(pool.sessions) == SESSION_CAP
    assert pool.pinned("bob") is second and pool.pinned("carol") is second
    assert "flood-0" not in pool.sessions and f"flood-{SESSION_CAP + 499}" in pool.sessions
    assert first.sessions + second.sessions == SESSION_CAP and second.sessions == 2
    # a host within its share still evicts the least recently used pin, whoever's it is
    pool.unpin("flood-1000")
    oldest, after = list(itertools.islice(pool.sessions, 2))
    pool.pin("dave", second, "ipv4:10.0.0.3:5000")
    pool.pin("erin", second, "ipv4:10.0.0.3:5001")
    assert oldest not in pool.sessions and after in pool.sessions and pool.pinned("dave") is second
    for session in list(pool.sessions):
        pool.unpin(session)
    assert first.sessions == second.sessions == 0 and not pool._pins_of


def test_a_session_is_unpinned_only_by_a_release_from_the_host_that_pinned_it() -> None:
    """Without authentication every client names sessions alike: a stranger's `Release` of a
    bystander's session name dropped its pin, and the bystander's next `strict_queue` call ran on
    another worker, away from the state it had set up. The pinner's host (the machine's own users are
    one host) unpins it; another host's release leaves it; with an identity the name is the client's own."""
    pool, first = _pool(slots=4, queue_size=8)
    pool.pin("bob", first, "ipv4:10.0.0.2:5000")
    assert not pool.unpin_for("bob", "ipv4:10.0.0.9:7000") and pool.pinned("bob") is first
    assert not pool.unpin_for("nobody", "ipv4:10.0.0.2:5000")
    assert pool.unpin_for("bob", "ipv4:10.0.0.2:6001") and pool.pinned("bob") is None   # another connection of it
    pool.pin("alice/s", first, "alice")               # (router.session_key: an identity's session)
    assert not pool.unpin_for("alice/s", "mallory") and pool.unpin_for("alice/s", "alice")
    pool.pin("server's", first)
    assert pool.unpin_for("server's", "ipv4:10.0.0.9:7000")
    assert first.sessions == 0 and not pool._pins_of

