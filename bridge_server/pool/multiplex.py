"""The pool server's side of `Bridge/Multiplex`.

Each call of a client's Multiplex stream is routed on its own, as a plain call would be (its pool,
session, affinity and refs, read from the RPC's metadata overlaid with the call's), holds a worker
slot until it ends, and runs on that worker's lane (`lane.py`) like a plain Call or Stream: the
client's call ids map to lane calls, and its cancels and credits follow them. Requests are read as
views (the call stays bytes), events are re-addressed to the client's ids as bytes, and whatever
arrives during one loop turn leaves as one reply.

Flow control: a stream the client gave a window keeps it, on the lane, with the client's credits; a
stream without one gets the router's window, credited as its replies are written to the client. So
a slow client holds at most a window of items per stream in the router, and holds up nobody else on
the worker's lane. Unary results have no window: once a stream's unwritten replies pass
MAX_UNWRITTEN_BYTES, or MAX_UNANSWERED of them wait to be written, the router starts none of its calls
until the client reads. Beyond each stream: every result counts in the pool server's backlog
(`backlog.py`) until written; one that does not fit ends its call, and a stream left unread may be
ended to free the others. A write the client leaves unread is bounded by `reader_stall_s`, as a
Stream's is. A worker that dies ends its calls with "worker crashed", as for plain calls, and the
client's other calls go on.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import grpc

from bridge_server.pool.backlog import Backlog, Holding
from bridge_server.pool.lane import STREAM_WINDOW, LaneCall, LaneClosed
from bridge_server.pool.poolstate import Backend, Flight, Plan, PoolRouter
from bridge_server.pool.router import Route, Router, client_of, read_route, routed_request, time_left
from bridge_server.wire.errors import BridgeError
from bridge_server.wire.eventloop import never_ran
from bridge_server.wire.options import time_left_s
from bridge_server.wire.protocol import (
    LARGE_REQUEST_BYTES,
    MAX_MESSAGE_BYTES,
    MUX_BATCH_SLICE,
    batch_within_limit,
    in_slices,
    large_batch_within_limit,
    mux_calls_named,
    mux_refusal,
    parse_request,
    start_options_within_limit,
    stop_reading,
)
from bridge_server.wire.stall import Waiting
from bridge_server.wire.turns import Turns
from vllm_bridge.v1 import bridge_pb2 as pb

__all__ = ["forward_multiplex"]

log = logging.getLogger("vllm_bridge.router")

Failure = Callable[[Backend, Flight, str], Awaitable[BridgeError]]
Metadata = tuple[tuple[str, str | bytes], ...]

# What one stream may have the router hold for a client that does not read. Past either bound the
# stream starts no more calls (the rest of a batch, and later requests, wait) until the client
# reads: a client that starts calls and never reads their results (a few MB each) would have the
# router hold all of them. Unary calls count from their start, as a result arrives after its start
# is read (a batch of a hundred starts is read whole before any answer); streams have windows. A
# window a client gives that is larger than the router's is the router's to keep (credited as items
# are written): the router would hold whatever the worker sent ahead.
MAX_UNWRITTEN_BYTES = 16 * 1024 * 1024
MAX_UNANSWERED = 16            # unary calls started whose answers the client has not been written
PARSED_BYTES_PER_REQUEST = 400   # what one request of a batch holds parsed, past its bytes (a small start: ~370)
MUX_TURN_BYTES = 16 << 10        # a message this large is parsed in its caller's turn
REFUSALS_BEFORE_TURNS = MUX_BATCH_SLICE   # past this many refusals, all of a stream's requests go in turns


@dataclass(eq=False)
class _Running:
    """One client call placed on a worker."""

    client_id: int
    pool: PoolRouter
    backend: Backend
    flight: Flight
    own_window: bool              # the router's window, credited as replies are written
    client: str = ""              # whose slot it holds (`PoolRouter.holding`)
    lc: LaneCall | None = None
    ended: bool = False
    large: _Large | None = None   # the large request it came in, if it did


@dataclass(eq=False)
class _Large:
    """A request of LARGE_REQUEST_BYTES or more (one large start, or a batch), counted in the pool
    server's backlog for as long as a call it started lives: gRPC has read it whole, and each start
    holds it (its call's bytes) while it waits for a slot and for its turn in the worker's lane, as a
    large Call does (`forward.py`). Uncounted, one stream's large starts waiting for a slot held their
    bytes in the pool server without bound."""

    holding: Holding
    calls: int = 1                # the calls it started that live, and the reader while it reads them


class _FlightHook:
    """What `Backend.fail_flights` cancels when the worker dies: the call reports it."""

    __slots__ = ("on_fail",)

    def __init__(self, on_fail: Callable[[], None]) -> None:
        self.on_fail = on_fail

    def cancel(self) -> None:
        self.on_fail()


def _within_limit(batch: Any) -> list[bytes]:
    """A batch of events from several workers, as messages within gRPC's limit (each worker keeps
    every single event within it)."""
    data: bytes = batch.SerializeToString()
    if len(data) <= MAX_MESSAGE_BYTES:
        return [data]
    frames, current, size = [], pb.MuxReplyView(), 0
    for event in batch.events:
        n = event.ByteSize() + 16
        if current.events and size + n > MAX_MESSAGE_BYTES:
            frames.append(current.SerializeToString())
            current, size = pb.MuxReplyView(), 0
        current.events.append(event)
        size += n
    frames.append(current.SerializeToString())
    return frames


async def forward_multiplex(router: Router, requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext,
                            failure: Failure, write: Callable[[bytes], Awaitable[object]], identity: str = "",
                            limit: int = MAX_MESSAGE_BYTES, backlog: Backlog | None = None,
                            turns: Turns | None = None, writer: Waiting | None = None) -> None:
    """Serves one client Multiplex stream, writing its replies with `write`, until it half-closes and
    every call ends. `failure` says what a call whose worker's lane closed must report, as for plain
    calls. What waits to be written counts in `backlog`, which may end the stream (raises its error).
    `writer` notes since when `write` has waited on the client: while calls wait for a slot, the
    pool ends the stream's streaming calls once it has waited long (`Backend.stalled`), as it ends a
    Stream's. A client that credits its calls without reading keeps their windows open, so they
    never fill, and its calls went on holding their slots."""
    loop = asyncio.get_running_loop()
    task = asyncio.current_task()
    shed: list[BridgeError] = []

    def end_stream(err: BridgeError) -> None:
        shed.append(err)
        if task is not None:
            task.cancel()
    backlog = backlog or Backlog(0)
    turns = turns or Turns()
    caller = client_of(identity, context)      # as the backlog knows callers: all its streams together
    holding = backlog.open(caller, "Multiplex", end_stream)
    context.add_done_callback(lambda _: backlog.close(holding))   # what gRPC holds is gone with the RPC
    # Headers first: a status can follow a write the caller leaves unread only once they have gone
    # (gRPC sends them with the first write, and counts them sent only when that write is done).
    await context.send_initial_metadata(())
    defaults = tuple((k, v) for k, v in context.invocation_metadata() or () if k.startswith("x-bridge-"))
    client = client_of(identity, context, multiplex=True)      # every call of the stream is this client's
    # `identity` is the caller's: what the client names in its own options is not (the lane drops it).
    out: asyncio.Queue[tuple[bytes, list[tuple[_Running, int]], int, int] | None] = asyncio.Queue()
    batch = pb.MuxReplyView()
    said: set[tuple[int, str]] = set()         # refusals in `batch`, by id and message
    credit: dict[_Running, int] = {}           # items in `batch` of streams on the router's window
    flushing = False
    unwritten = 0                              # bytes in `out`
    counted = 0                                # of the results in `batch`, as the backlog counts them
    unanswered: set[int] = set()               # unary calls started, answer not yet in `batch`
    answers = 0                                # answers in `batch` (of calls that were in `unanswered`)
    outstanding = 0                            # unary calls started, answer not yet written
    room = asyncio.Event()                     # set while this stream may start calls (both bounds)
    room.set()

    def check_room() -> None:
        if unwritten <= MAX_UNWRITTEN_BYTES and outstanding < MAX_UNANSWERED:
            room.set()
        else:
            room.clear()
    running: dict[int, _Running] = {}          # by client call id
    queued: dict[int, asyncio.Task[None]] = {} # calls waiting for a worker slot
    idle = asyncio.Event()
    idle.set()
    tasks: set[asyncio.Task[None]] = set()
    larges: set[_Large] = set()                # large requests some call of which lives
    refused_starts = 0                         # refusals this stream has had
    in_hand: _Large | None = None              # the large request whose starts are being handled
    queued_large: dict[int, _Large] = {}       # the large requests of calls waiting for a slot

    def let_go(large: _Large | None) -> None:
        """One call (or the reader) is done with a large request: with the last, it no longer counts."""
        if large is not None:
            large.calls -= 1
            if not large.calls:
                larges.discard(large)
                backlog.close(large.holding)

    def flush() -> None:
        nonlocal batch, credit, flushing, unwritten, answers, counted
        flushing = False
        if batch.events:
            frames = _within_limit(batch)
            for frame in frames[:-1]:
                out.put_nowait((frame, [], 0, 0))
            out.put_nowait((frames[-1], list(credit.items()), answers, counted))
            batch, credit = pb.MuxReplyView(), {}
            said.clear()
            unwritten += sum(len(frame) for frame in frames)
            answers = counted = 0
            check_room()

    def add_event(client_id: int) -> Any:
        nonlocal flushing, answers
        if not flushing:
            flushing = True
            loop.call_soon(flush)
        if client_id in unanswered:          # a unary call's only event: its answer
            unanswered.discard(client_id)
            answers += 1
        return batch.events.add(id=client_id)

    def refuse(client_id: int, err: BridgeError) -> None:
        """An error event for the call, counted in the backlog as results are; the same refusal of
        the same id is said once per reply (a batch of 65,536 empty requests, or of 65,536 starts
        with one id, got as many)."""
        nonlocal refused_starts
        refused_starts += 1
        if (client_id, err.message) in said:
            return
        said.add((client_id, err.message))
        add_error(client_id, err.to_mux_error())

    def add_error(client_id: int, error: Any) -> None:
        """An error event, counted in the backlog (it waits for its reader as a result does)."""
        nonlocal counted
        event = add_event(client_id).error
        event.CopyFrom(error)
        size = event.ByteSize()
        backlog.add(holding, size)
        counted += size

    def end(run: _Running) -> None:
        if run.ended:
            return
        run.ended = True
        if running.get(run.client_id) is run:
            del running[run.client_id]
        run.backend.flights.discard(run.flight)
        run.pool.release(run.backend, run.client)
        let_go(run.large)
        if not running and not queued:
            idle.set()

    def on_event(run: _Running, event: Any) -> None:
        nonlocal counted
        if run.ended:
            return
        kind = event.WhichOneof("kind")
        if kind == "value" or kind == "patch":
            data = event.value if kind == "value" else event.patch
            refused = backlog.take(holding, len(data), f"Multiplex: call {run.client_id}")
            if refused is not None:      # it does not fit: the call ends (a stream's, too)
                if run.lc is not None:
                    run.lc.cancel()
                refuse(run.client_id, refused)
                end(run)
                return
            counted += len(data)
            ev = add_event(run.client_id)
            if kind == "value":
                ev.value = data
            else:
                ev.patch = data               # a stream's item as a patch: bytes, as values are
            if run.lc is not None and not run.lc.stream:
                end(run)
            elif run.own_window:
                credit[run] = credit.get(run, 0) + 1
        elif kind == "end":
            add_event(run.client_id).end.SetInParent()
            end(run)
        else:
            add_error(run.client_id, event.error)
            end(run)

    def on_lost(run: _Running, reason: str) -> None:
        """The worker's lane closed (or the worker died) under the call."""
        if run.ended:
            return
        if run.lc is not None:
            run.lc.cancel()
        task = loop.create_task(report_lost(run, reason))
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    def stalled(run: _Running, err: BridgeError) -> None:
        """The pool ends the stream: its window has been unread for too long while others wait."""
        if run.ended:
            return
        if run.lc is not None:
            run.lc.cancel()               # the worker cancels it: vLLM aborts the request
        refuse(run.client_id, err)
        end(run)

    async def report_lost(run: _Running, reason: str) -> None:
        err = await failure(run.backend, run.flight, reason)
        if not run.ended:
            refuse(run.client_id, err)
            end(run)

    def launch(client_id: int, start: Any, md: Metadata, route: Route, plan: Plan, backend: Backend,
               large: _Large | None) -> None:
        router.placed(plan, backend, route.client)
        own_window = start.stream and not 0 < start.window <= STREAM_WINDOW
        run = _Running(client_id, plan.pool, backend, Flight(writer=writer if start.stream else None),
                       own_window=own_window, client=route.client, large=large)
        running[client_id] = run
        run.flight.call = _FlightHook(functools.partial(on_lost, run, "the worker died"))
        backend.flights.add(run.flight)
        try:
            window = (STREAM_WINDOW if own_window else start.window) if start.stream else 0
            run.lc = backend.lane.start(start.call, md, stream=start.stream, window=window,
                                        timeout_s=time_left(route), identity=identity, client=caller,
                                        on_event=functools.partial(on_event, run),
                                        on_lost=functools.partial(on_lost, run))
            run.lc.on_stalled = functools.partial(stalled, run)
            if start.stream:
                run.flight.lane_call, run.flight.on_stalled = run.lc, run.lc.on_stalled
        except BridgeError as err:       # its deadline passed while it waited for a slot
            refuse(client_id, err)
            end(run)
        except LaneClosed as exc:
            on_lost(run, str(exc))

    async def wait_and_launch(client_id: int, start: Any, md: Metadata, route: Route, plan: Plan) -> None:
        def unqueue() -> None:
            queued.pop(client_id, None)
            let_go(queued_large.pop(client_id, None))
            if not running and not queued:
                idle.set()

        try:
            backend = await plan.pool.wait(plan, route.deadline, route.client)
        except BridgeError as err:
            refuse(client_id, err)
            unqueue()
            return
        except asyncio.CancelledError:
            refuse(client_id, BridgeError(grpc.StatusCode.CANCELLED, "cancelled", "cancelled by the client",
                                          reason="cancelled"))
            unqueue()
            raise
        queued.pop(client_id, None)
        launch(client_id, start, md, route, plan, backend, queued_large.pop(client_id, None))   # in `running` now

    def handle_start(start: Any) -> None:
        nonlocal outstanding
        client_id = start.id
        if client_id == 0:
            refuse(0, BridgeError.validation(
                "Multiplex: call id 0 is reserved (for errors about requests that name no call); ids start at 1",
                parameter="start.id"))
            return
        if client_id in running or client_id in queued:   # under id 0: under its id it would end the running call
            refuse(0, BridgeError.validation(
                f"Multiplex: call id {client_id} is still running; ids must be unique among running calls "
                f"(this start was refused, the running call goes on)", parameter="start.id"))
            return
        try:
            start_options_within_limit(len(start.metadata), client_id)
            md = (*defaults, *start.metadata.items())     # the RPC's options, overlaid with the call's
            backlog.admit(caller, f"Multiplex: call {client_id}")
            call = routed_request(start.call, f"Multiplex: call {client_id}", limit, router)
            limits = [t for t in (context.time_remaining(), time_left_s(start.time_left_ms)) if t is not None]
            route = read_route(md, min(limits) if limits else None, call, identity, client)
            plan = router.plan(route)
            backend = plan.pool.take(plan, route.client)
        except BridgeError as err:
            refuse(client_id, err)
            return
        except Exception as exc:      # a fault of ours fails this call, not every call of the stream
            log.error("Multiplex: call %d could not be routed", client_id, exc_info=exc)
            refuse(client_id, BridgeError(grpc.StatusCode.INTERNAL, "pool", f"Multiplex: call {client_id}: router "
                                          f"failure: {type(exc).__name__}: {exc}", reason="router failure"))
            return
        idle.clear()
        if not start.stream:
            unanswered.add(client_id)
            outstanding += 1
            check_room()
        if in_hand is not None:
            in_hand.calls += 1
        if backend is not None:
            launch(client_id, start, md, route, plan, backend, in_hand)
        else:
            if in_hand is not None:
                queued_large[client_id] = in_hand
            queued[client_id] = loop.create_task(wait_and_launch(client_id, start, md, route, plan))

    def handle(request: Any, nested: bool = False) -> None:
        """One start, cancel or credit (a batch's requests come here one by one, `nested`)."""
        kind = request.WhichOneof("kind")
        if kind == "batch" and nested:
            refuse(0, mux_refusal("nested"))
        elif kind == "start":
            handle_start(request.start)
        elif kind == "cancel":
            run = running.get(request.cancel)
            if run is not None and run.lc is not None:
                run.lc.ask_to_cancel()      # the worker's CANCELLED event ends it
            elif (waiting := queued.get(request.cancel)) is not None:
                if never_ran(waiting):       # its own refusal and unqueuing would never run
                    queued.pop(request.cancel, None)
                    let_go(queued_large.pop(request.cancel, None))
                    refuse(request.cancel, BridgeError(grpc.StatusCode.CANCELLED, "cancelled",
                                                       "cancelled by the client", reason="cancelled"))
                    if not running and not queued:
                        idle.set()
                waiting.cancel()
        elif kind == "credit":
            run = running.get(request.credit.id)
            if run is not None and run.lc is not None and not run.own_window:
                run.lc.credit(request.credit.events)
        else:
            refuse(0, mux_refusal("kind"))

    def take_large(size: int) -> _Large | BridgeError:
        """A large request counts in the backlog before any of its starts is handled; or, if it does
        not fit, the RESOURCE_EXHAUSTED (reason "large requests") each start it carries fails with."""
        large = _Large(backlog.open(caller, "Multiplex"))
        refused = backlog.take(large.holding, size, "Multiplex: a request", request=True)
        if refused is None:
            larges.add(large)
            return large
        backlog.close(large.holding)
        return refused

    async def handle_batch(requests: Any, in_turns: bool) -> None:
        """A batch's requests, a slice at a time, each once the stream has room. A batch of more than
        a slice, or any of a stream that has had many refusals, takes its slices in its caller's turns
        (the pool server's turns for costly work: one at a time, then the loop left to everything
        else three times as long): a stranger's 64 streams of 65,536 refused starts each had every
        slice, and no other client was answered for 45 s, health checks included; 32 streams of
        64-start batches, refused, held bystanders' calls up to 5 s."""
        if len(requests) <= MUX_BATCH_SLICE and not in_turns:
            await in_slices(requests, functools.partial(handle, nested=True), room)
            return
        i, n = 0, len(requests)
        while i < n:
            await room.wait()
            await turns.acquire(caller)
            try:
                end = min(i + MUX_BATCH_SLICE, n)
                while i < end and room.is_set():
                    handle(requests[i], nested=True)
                    i += 1
            finally:
                turns.release()

    def refuse_all(requests: Any, err: BridgeError) -> None:
        """A large request that does not fit: each start it carries fails (each id once), its cancels
        and credits are taken."""
        refused: set[int] = set()
        for each in requests:
            kind = each.WhichOneof("kind")
            if kind != "start":
                if kind != "batch":
                    handle(each, nested=True)
            elif (i := each.start.id) not in refused and i not in running and i not in queued:
                refused.add(i)
                refuse(i, err)

    async def read_one(raw: bytes) -> None:
        """One request of the stream. What it holds goes with this call, not kept while the next one
        is awaited: a batch of 65,536 small starts holds 24 MB parsed, and 128 idle streams that had
        each sent one held 3.4 GB."""
        nonlocal in_hand
        large = len(raw) >= LARGE_REQUEST_BYTES
        # Parsed in the connection's turn (`wire/turns.py`): a message of many small requests costs its
        # parse ~40 times its bytes (a batch under 256 KiB held 10 MB parsed); and everything of a
        # stream that has had many refusals (cheap to send, not to refuse) is handled in turns.
        in_turns = len(raw) >= MUX_TURN_BYTES or refused_starts > REFUSALS_BEFORE_TURNS
        if in_turns:
            await turns.acquire(caller)
        try:
            if large:
                large_batch_within_limit(raw)    # counted before any parse; over the limit ends the stream
            try:
                request = parse_request(pb.MuxRequestView, raw, "Multiplex", limit + 64 * 1024)
            except BridgeError as err:     # each call it names fails (id 0, which no call uses: none)
                for call_id in mux_calls_named(raw):
                    if call_id not in running and call_id not in queued:
                        refuse(call_id, err)
                return
            batch = request.WhichOneof("kind") == "batch"
            count = len(request.batch.requests) if batch else 1
            if large or count > MUX_BATCH_SLICE:     # what it holds parsed, past its bytes (~370 a start)
                taken = take_large(len(raw) + PARSED_BYTES_PER_REQUEST * count)
                if isinstance(taken, BridgeError):   # refused here, in the turn, and dropped at once
                    refuse_all(request.batch.requests if batch else [request], taken)
                    return
                in_hand = taken
        finally:
            if in_turns:
                turns.release()
        try:
            if batch:
                batch_within_limit(count)
                await handle_batch(request.batch.requests, refused_starts > REFUSALS_BEFORE_TURNS)
            elif refused_starts > REFUSALS_BEFORE_TURNS:
                await handle_batch([request], True)
            else:
                handle(request)
        finally:
            let_go(in_hand)   # the reader is done with it: it counts on while a call it started lives
            in_hand = None

    async def read() -> None:
        async for raw in requests:
            await room.wait()
            await read_one(raw)
            del raw
        await idle.wait()         # half-closed: every call runs to its end

    failed: list[BaseException] = []

    async def reader() -> None:
        try:
            await read()
        except asyncio.CancelledError:
            raise
        except BaseException as exc:   # a malformed request: the stream ends with its error
            # without its traceback, whose frames hold what was read (a batch of 20 million views:
            # 900 MB kept for as long as anything held the error), and without gRPC's reader's last message
            failed.append(exc.with_traceback(None))
            del exc
            await stop_reading(requests)
        flush()
        out.put_nowait(None)

    reading = loop.create_task(reader())
    try:
        try:
            while (item := await out.get()) is not None:
                raw, credits, answered, results = item
                backlog.writing(holding, results)
                await write(raw)
                backlog.written(holding, results)
                unwritten -= len(raw)
                outstanding -= answered
                check_room()
                for run, n in credits:         # written to the client: the worker may send that many more
                    if not run.ended and run.lc is not None:
                        run.lc.credit(n)
        except asyncio.CancelledError:
            if shed and task is not None and task.uncancel() == 0:
                raise shed[0] from None
            raise
        if failed:
            raise failed[0]
    finally:
        backlog.unwind(holding)
        reading.cancel()
        for waiting in list(queued.values()):
            waiting.cancel()
        for task in list(tasks):
            task.cancel()
        try:
            await asyncio.gather(reading, *queued.values(), *tasks, return_exceptions=True)
        finally:
            # Even when this wait is cancelled: gRPC cancels the handler once its RPC is over (a
            # client that went away, whose write failed), and the stream's calls then kept their
            # slots, counted in flight, until their workers gave up waiting for credit (reader_stall_s,
            # 60 s after the client left), every bystander queued behind them.
            for run in list(running.values()):
                if run.lc is not None:
                    run.lc.cancel()           # the client is gone: so are its calls
                end(run)
            for large in list(larges):        # (starts cancelled before they ran never let theirs go)
                backlog.close(large.holding)
