"""Costly results take turns on the worker's event loop (`wire/turns.py`): one caller's large
results leave the loop to everyone else between them, and turns go round the callers waiting."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from bridge_server.wire.codec import Encoder, TooCostly
from bridge_server.wire.turns import Turns
from tests.conftest import WorkerProcess
from vllm_bridge.v1 import bridge_pb2 as pb

FC = "vllm.forward_context"


def small_call_after_the_first_of(address: str, heavy: bytes, n: int) -> tuple[int, list[bytes | grpc.StatusCode]]:
    """Starts n Calls of the serialized request `heavy` at once, then, once the first is answered, a
    small call (divide(6, 3)) on the same connection. Returns how many of the n were answered before
    the small one, and their outcomes (the reply's bytes, or the status it failed with)."""
    async def run() -> tuple[int, list[bytes | grpc.StatusCode]]:
        async with grpc.aio.insecure_channel(address, options=[("grpc.max_receive_message_length", 64 << 20),
                                                               ("grpc.max_send_message_length", 64 << 20)]) as ch:
            call = ch.unary_unary("/vllm_bridge.v1.Bridge/Call")
            done: list[bytes | grpc.StatusCode] = []

            async def one() -> None:
                try:
                    done.append(await call(heavy, timeout=60))
                except grpc.aio.AioRpcError as err:
                    done.append(err.code())

            tasks = [asyncio.get_running_loop().create_task(one()) for _ in range(n)]
            while not done:
                await asyncio.sleep(0.001)
            assert pb.CallReply.FromString(await call(SMALL, timeout=60)).value.int == 2
            before = len(done)
            await asyncio.gather(*tasks)
            return before, done

    return asyncio.run(run())


# divide(6, 3), as a serialized CallRequest
SMALL = pb.CallRequest(target=pb.Target(kind=pb.Target.FUNCTION, name="vllm.distributed.divide"),
                       args=[pb.Value(int=6), pb.Value(int=3)]).SerializeToString()


def test_turns_go_round_the_callers_and_a_cancelled_wait_gives_up_its_place() -> None:
    async def run() -> None:
        turns = Turns(rest_factor=0.0)
        order: list[str] = []

        async def one(caller: str, tag: str) -> None:
            await turns.acquire(caller)
            order.append(tag)
            await asyncio.sleep(0)       # the turn is held across a loop turn, as an await inside it would
            turns.release()

        await turns.acquire("holder")    # held while the others line up
        tasks = {}
        for caller, tag in [("a", "a1"), ("a", "a2"), ("a", "a3"), ("b", "b1"), ("c", "c1"), ("a", "a4"),
                            ("c", "c2")]:
            tasks[tag] = asyncio.get_running_loop().create_task(one(caller, tag))
            await asyncio.sleep(0)       # each starts waiting in this order
        tasks["c2"].cancel()             # gives up while waiting
        turns.release()
        await asyncio.gather(*tasks.values(), return_exceptions=True)
        assert order == ["a1", "b1", "c1", "a2", "a3", "a4"]
        assert turns.waiting() == 0

        # A wait given the turn and cancelled before it ran passes the turn on.
        await turns.acquire("x")
        late = asyncio.get_running_loop().create_task(turns.acquire("y"))
        after = asyncio.get_running_loop().create_task(one("z", "z1"))
        await asyncio.sleep(0)
        turns.release()              # the turn goes to "y" ...
        late.cancel()                # ... which is cancelled before it runs
        await asyncio.gather(late, return_exceptions=True)
        await asyncio.wait_for(after, 5)
        assert order[-1] == "z1"

    asyncio.run(run())


def test_turns_go_round_hosts_first_then_their_connections() -> None:
    """A stranger's many connections from one host get that host's turns, not one each."""
    async def run() -> None:
        turns = Turns(rest_factor=0.0)
        order: list[str] = []

        async def one(caller: str) -> None:
            await turns.acquire(caller)
            order.append(caller)
            await asyncio.sleep(0)
            turns.release()

        await turns.acquire("holder")
        tasks = []
        for caller in ["ipv4:10.0.0.1:1", "ipv4:10.0.0.1:2", "ipv4:10.0.0.1:3", "ipv4:10.0.0.1:1",
                       "ipv4:10.0.0.2:9", "ipv4:10.0.0.2:9", "alice"]:
            tasks.append(asyncio.get_running_loop().create_task(one(caller)))
            await asyncio.sleep(0)
        turns.release()
        await asyncio.gather(*tasks)
        assert order == ["ipv4:10.0.0.1:1", "ipv4:10.0.0.2:9", "alice", "ipv4:10.0.0.1:2", "ipv4:10.0.0.2:9",
                         "ipv4:10.0.0.1:3", "ipv4:10.0.0.1:1"]

    asyncio.run(run())


def test_the_next_turn_waits_rest_factor_times_the_last_one() -> None:
    async def run() -> None:
        turns = Turns(rest_factor=3.0)
        await turns.acquire("a")
        time.sleep(0.02)                 # a costly encode holds the loop
        released = time.monotonic()
        turns.release()
        await turns.acquire("b")
        assert time.monotonic() - released >= 0.06 * 0.99
        turns.release()

    asyncio.run(run())


def test_an_encode_stops_at_its_bound_of_work_and_a_small_one_does_not() -> None:
    enc = Encoder(make_ref=lambda obj: pb.Ref(id="r"), work_limit=1000)
    assert list(enc.encode(list(range(7999))).ints.values) == list(range(7999))   # packed ints: an eighth each
    assert len(enc.encode({i: [str(i)] for i in range(300)}).map.entries) == 300    # 600 items
    for costly in (list(range(8009)), ["s"] * 1001, [[0, 1.5]] * 600, {"k": [{"v": i} for i in range(999)]}):
        with pytest.raises(TooCostly):
            enc.encode(costly)


def test_a_caller_s_large_results_leave_the_loop_to_others_between_them(worker: WorkerProcess) -> None:
    """Twelve 3 MB results, asked for at once: a small call made after the first of them arrived is
    answered before most of the rest, where it used to wait for all of them."""
    import torch

    from bridge_server.client.client import BridgeClient, Target

    sizes = [2**40 + i for i in range(400_000)]          # ~15 ms of encoding each, past the bound
    with BridgeClient(worker.address) as client:
        dp = client.call(f"{FC}.DPMetadata", torch.tensor(7), torch.tensor([7]), sizes)
        get = client.request(Target.get(dp, "local_sizes"), (), None)[0].SerializeToString()
        before, done = small_call_after_the_first_of(worker.address, get, 12)
        assert before <= 4, f"{before} of 12 large results went before a small call made after the first"
        for raw in done:
            assert isinstance(raw, bytes) and list(pb.CallReply.FromString(raw).value.ints.values) == sizes
        client.release(dp)


def test_tensors_and_text_count_by_their_bytes() -> None:
    import torch
    enc = Encoder(make_ref=lambda obj: pb.Ref(id="r"), work_limit=1000)
    assert enc.encode(torch.zeros(100_000, dtype=torch.int8)).tensor.data == bytes(100_000)   # 782 items
    assert enc.encode({"k": ["x" * 60_000, "y" * 60_000]}).map.entries[0].value.list.items[1].str == "y" * 60_000
    for costly in (torch.zeros(130_000, dtype=torch.float32), "x" * 130_000, [b"y" * 70_000] * 2,
                   {"k": {"v": "x" * 130_000}}, [torch.zeros(1)] * 501):
        with pytest.raises(TooCostly):
            enc.encode(costly)


def test_a_result_too_large_for_one_turn_is_refused_and_the_worker_serves_on(worker: WorkerProcess) -> None:
    """3 million tensor views, asked for in 200 bytes, held the loop 26 s in one turn."""
    import torch

    from bridge_server.client.client import BridgeClient, CallError

    with BridgeClient(worker.address) as client:
        with pytest.raises(CallError) as err:
            client.call("vllm.distributed.split_tensor_along_last_dim", torch.zeros(1, 600_000, dtype=torch.int8),
                        600_000, timeout=60)
        assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and err.value.reason == "result too large"
        assert "split_tensor_along_last_dim" in err.value.details and "too large to send by value" in err.value.details
        parts = client.call("vllm.distributed.split_tensor_along_last_dim", torch.arange(8).reshape(1, 8), 4)
        assert [p.tolist() for p in parts] == [[[0, 1]], [[2, 3]], [[4, 5]], [[6, 7]]]


def test_turns_go_by_connection_not_by_the_session_a_caller_names(worker: WorkerProcess) -> None:
    """Turns went round sessions, which a caller names as it likes: a stranger's twelve large results
    under twelve session names came before another caller's one. They go round connections now."""
    import torch

    from bridge_server.client.client import BridgeClient, Target

    sizes = [2**40 + i for i in range(400_000)]
    with BridgeClient(worker.address) as client:
        dp = client.call(f"{FC}.DPMetadata", torch.tensor(7), torch.tensor([7]), sizes)
        get = client.request(Target.get(dp, "local_sizes"), (), None)[0].SerializeToString()
        # Each channel its own connection (gRPC would share one between channels of the same target).
        options = [("grpc.max_receive_message_length", 64 << 20), ("grpc.use_local_subchannel_pool", 1)]

        async def run() -> tuple[int, int]:
            async with grpc.aio.insecure_channel(worker.address, options=options) as stranger, \
                    grpc.aio.insecure_channel(worker.address, options=options) as other:
                done: list[int] = []

                async def heavy(channel: grpc.aio.Channel, session: str, tag: int) -> None:
                    await channel.unary_unary("/vllm_bridge.v1.Bridge/Call")(
                        get, timeout=60, metadata=(("x-bridge-session", session),))
                    done.append(tag)

                loop = asyncio.get_running_loop()
                tasks = [loop.create_task(heavy(stranger, f"s{i}", i)) for i in range(12)]
                while not done:
                    await asyncio.sleep(0.001)
                await heavy(other, "default", -1)
                before = done.index(-1)
                await asyncio.gather(*tasks)
                return before, len(done)

        before, total = asyncio.run(run())
        assert total == 13 and before <= 3, f"{before} of the stranger's 12 results went first"
        client.release(dp)


def test_large_requests_are_decoded_in_turns(worker: WorkerProcess) -> None:
    """Decoding a request costs the loop what encoding a result does: eight requests of a million
    strings held it 6.7 s, with every other call behind them. A small call made after the first of
    eight large ones is answered before most of them."""
    from bridge_server.client.client import BridgeClient

    with BridgeClient(worker.address) as client:
        big = client.request("vllm.distributed.divide", (["x"] * 300_000, 1), None)[0].SerializeToString()
    before, done = small_call_after_the_first_of(worker.address, big, 8)
    assert before <= 3, f"{before} of 8 large requests went before a small call made after the first"
    assert done == [grpc.StatusCode.INVALID_ARGUMENT] * 8       # divide takes numbers: refused once decoded


def test_results_cheap_to_encode_but_large_to_send_take_turns_too(worker: WorkerProcess) -> None:
    """Text is encoded by a copy, so a few strings of a megabyte passed the bound of items unseen;
    sending each byte costs the loop again: sixty such results held it 9 s."""
    from bridge_server.client.client import BridgeClient, Target

    layers = {f"k{i}": "a" * 999_000 for i in range(8)}            # 8 MB of text
    with BridgeClient(worker.address) as client:
        context = client.call(f"{FC}.ForwardContext", kwargs={"no_compile_layers": layers, "attn_metadata": {},
                                                             "virtual_engine": 0})
        get = client.request(Target.get(context, "no_compile_layers"), (), None)[0].SerializeToString()
        before, done = small_call_after_the_first_of(worker.address, get, 12)
        assert before <= 4, f"{before} of 12 large results went before a small call made after the first"
        last = done[-1]
        assert isinstance(last, bytes)
        got = pb.CallReply.FromString(last).value.map.entries
        assert {e.key.str: len(e.value.str) for e in got} == {k: 999_000 for k in layers}
        client.release(context)


def test_an_encode_stops_at_its_bound_of_time_too() -> None:
    """Items differ in cost (a tensor view ~30 times an int), so a count alone let one turn run 4 s."""
    import torch
    views = tuple(torch.arange(200_000).split(1))             # 200,000 one-element tensors
    counted = Encoder(make_ref=lambda obj: pb.Ref(id="r"), work_limit=10**9)
    started = time.perf_counter()
    counted.encode(views)
    whole = time.perf_counter() - started
    timed = Encoder(make_ref=lambda obj: pb.Ref(id="r"), work_limit=10**9, time_limit_s=whole / 10)
    with pytest.raises(TooCostly):
        timed.encode(views)
