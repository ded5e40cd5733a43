"""Runs one call: the target resolved (`planner.py`), the arguments decoded and bound, the guard
asked, the work run; the result is encoded by `results.py`.

Where work runs is decided here, once, for every kind of target:
- coroutines and async generators run on the event loop, so many AsyncLLM calls share one engine;
- blocking functions run in a thread pool, except the trivial pure helpers that run inline;
- calls that touch process-wide state (forward context, process groups) run in the exclusive lane,
  one at a time and in arrival order.
Deadlines are enforced here, not by the client: async work is cancelled for real (AsyncLLM aborts
the request); a blocking call that has not started is dropped from its queue; one that is already
running inside C code cannot be pre-empted, so it is abandoned and counted in `abandoned`. A client
holds at most its share of the shared lane's threads, running or abandoned (`threadshares.py`); one
whose abandoned calls hold its whole share is refused more work in threads until they end, and a
worker whose threads all run abandoned calls says so in health (`blocked`), as one whose exclusive
lane does.

The surface is closed by construction: a client reaches only what `planner.py` plans; no ref to a
module, class, function or builtin that is not itself a catalog entry leaves the worker, at any
depth of a result (`results.py`), and no such ref is taken as an argument. Each call is made for a
`Caller`: the identity that owns the refs it creates (and may use only its own), its session, and
whether it is a rank's share of a Collective.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import inspect
import time
from collections.abc import AsyncGenerator, Awaitable, Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import grpc

from adapters.spec import CallContext, Policy, calling_client
from bridge_server.wire.decoder import Decoder
from bridge_server.wire.errors import STILL_RUNNING, BridgeError, clip, quote
from bridge_server.wire.options import DEFAULT_SESSION, STREAM_PATCHES, connection_of
from bridge_server.wire.protocol import LARGE_REQUEST_BYTES, LargeRequest, host_of
from bridge_server.wire.stall import READER_STALL_S, StallGuard
from bridge_server.wire.turns import Turns
from bridge_server.worker.binding import Building, bind_checked, check_record
from bridge_server.worker.catalog import Catalog, Kind
from bridge_server.worker.contexts import EnteredContexts, generator_manager
from bridge_server.worker.deadlines import Deadlines, with_deadline
from bridge_server.worker.openfiles import open_files, room_for_files
from bridge_server.worker.planner import Plan, Planner
from bridge_server.worker.refs import RefRegistry, payer_of
from bridge_server.worker.results import CODE_TYPES, Results, take_turn
from bridge_server.worker.streams import Pace, PutItem, Tee, iterate
from bridge_server.worker.threadshares import ThreadShares
from vllm_bridge.v1 import bridge_pb2 as pb

# What must wait for the end of the blocking work a call starts, when its caller gives up first: a
# call abandoned at its deadline runs on in its thread, and whatever it holds (an engine being
# made counts against its client's limit) is held until then.
_ON_END: contextvars.ContextVar[list[Callable[[], None]] | None] = contextvars.ContextVar("on_end", default=None)


@dataclass(frozen=True)
class Caller:
    """Who a call is for: the client identity that owns what the call creates (and may use only what
    it owns; "" when the server has no authentication), the session its refs join, and whether it is
    one rank's share of a Collective (set by the pool server)."""

    identity: str = ""
    session: str = DEFAULT_SESSION
    collective: bool = False
    # Whom fairness between callers goes by: the identity, else the caller's connection (a session
    # is the caller's to name, and a stranger could name a thousand).
    client: str = ""
    # A Collective's share to be checked and described only (`agreement`), not run.
    check_only: bool = False


@dataclass(frozen=True)
class Limits:
    """What one client identity may make a worker hold, beyond its refs (RefRegistry's limits)."""

    max_engines_per_client: int = 2      # objects with a lifecycle (engines) a client makes, published aside
    reader_stall_s: float | None = READER_STALL_S   # a stream whose caller reads nothing this long ends


def _exit_args(label: str, args: list[Any], kwargs: dict[str, Any]) -> list[Any]:
    """An exit is told how its block ended: three Nones, or an exception's class, the exception and
    its traceback. A client has no exception to give (none decodes from the wire), so it may give
    three Nones or nothing, the same. Anything else went into the manager as is, where a generator's
    `throw` failed on it as a bare TypeError after the manager had let go of its state (vLLM's
    `suppress_stdout` left the worker's stdout on /dev/null)."""
    given = [*args, *kwargs.values()]
    if given and (len(given) != 3 or any(value is not None for value in given)):
        names = [*(_EXIT_PARAMETERS[i] if i < 3 else f"args[{i}]" for i in range(len(args))), *kwargs]
        wrong = next((n for n, v in zip(names, given) if v is not None), names[-1] if len(given) > 3 else "")
        shown = ", ".join(type(value).__name__ for value in given[:5]) + (", ..." if len(given) > 5 else "")
        raise BridgeError.validation(f"{label}: expected no arguments or three Nones (exc_type, exc_value, traceback: "
                                     f"a client has no exception to pass), got {len(given)} argument(s): {shown}",
                                     target=label, parameter=clip(str(wrong), 80))
    return [None, None, None]


_EXIT_PARAMETERS = ("exc_type", "exc_value", "traceback")


@dataclass
class Invoker:
    catalog: Catalog
    refs: RefRegistry
    objects: dict[str, object] = field(default_factory=dict)    # published by name at start
    tensor_max_bytes: int = 16 * 1024 * 1024
    shared_threads: int = 16
    distributed: bool = False   # a rank of a distributed pool: collective entries run only as Collectives
    world_size: int = 1         # the ranks of its pool's process group (1: not distributed)
    policy: Policy = field(default_factory=Policy)
    limits: Limits = field(default_factory=Limits)
    abandoned: int = 0      # blocking calls still running after their caller gave up
    wedged: str = ""        # a call abandoned in the exclusive lane, still running: it blocks the lane
    # Called with what a result_ref entry (an engine's constructor) made, before the caller gets it.
    adopt: Callable[[object], Awaitable[None]] | None = None
    _activity: dict[int, float] = field(default_factory=dict)   # id(receiver) -> when it last yielded an item
    _making: dict[tuple[str, str | None], int] = field(default_factory=dict)   # engines being made, by payer

    def __post_init__(self) -> None:
        self._contexts = EnteredContexts(self.refs.holds)     # generators' context managers, entered by refs
        self._exclusive_lane = ThreadPoolExecutor(1, thread_name_prefix="bridge-exclusive")
        self._shared_lane = ThreadPoolExecutor(self.shared_threads, thread_name_prefix="bridge-shared")
        self._exclusive_lock = asyncio.Lock()
        self.planner = Planner(self.catalog, self.refs, self.objects)
        self.shares = ThreadShares(self.shared_threads)     # each client's share of the shared lane
        self._decoders: dict[str, Decoder] = {}   # by identity
        self._building = Building(self.catalog.short_types, self.catalog.rule, self.policy)
        self.stall = StallGuard(self.limits.reader_stall_s)   # bounds every wait on a stream's caller
        self.turns = Turns()      # costly results and large requests take turns on the loop
        self.results = Results(self.refs, self.catalog, self.turns, self.tensor_max_bytes,
                               self.policy.unread_request_s)

    def active_since(self, obj: object, since: float) -> bool:
        """Whether a stream on `obj` yielded an item after `since` (time.monotonic()): progress."""
        return self._activity.get(id(obj), 0.0) > since

    def close(self) -> None:
        self._shared_lane.shutdown(wait=False, cancel_futures=True)
        self._exclusive_lane.shutdown(wait=False, cancel_futures=True)

    # ----------------------------------------------------------------------------------- planning
    def plan(self, target: pb.Target, caller: Caller = Caller()) -> Plan:
        """What the target names, for this caller (a ref is looked up among its own)."""
        return self.planner.plan(target, caller.identity)

    def publishes(self, obj: object) -> bool:
        """Whether obj is one of the objects this worker publishes (shared by every client)."""
        return self.planner.publishes(obj)

    # -------------------------------------------------------------------------------------- binding
    def _decoder(self, identity: str) -> Decoder:
        decoder = self._decoders.get(identity)
        if decoder is None:
            decoder = self._decoders[identity] = Decoder(resolve_ref=functools.partial(self._argument_ref, identity),
                                                         resolve_type=self.catalog.resolve_type,
                                                         check_record=self._record_fields,
                                                         max_str_chars=self.policy.max_prompt_chars)
        return decoder

    def _record_fields(self, cls: type, fields: dict[str, object], path: str) -> dict[str, object]:
        """A Record value's fields pass the checks a map given for its class passes (`RecordRule`,
        field types, the operator's policy) before the class is built from them."""
        try:
            return check_record(f"a record of {cls.__name__}", path, cls, fields, self._building)
        except BridgeError as exc:
            exc.target = ""     # `decode` names the call
            raise

    def _argument_ref(self, identity: str, ref: pb.Ref) -> object:
        obj = self.refs.get(ref.id, identity).obj
        if isinstance(obj, CODE_TYPES):
            raise BridgeError(grpc.StatusCode.PERMISSION_DENIED, "validation",
                              f"ref {quote(ref.id)} is a {type(obj).__name__}: code can be named (a catalog entry), "
                              f"never passed as an argument", reason="code")
        return obj

    async def decode_in_turn(self, request: pb.CallRequest | LargeRequest, caller: Caller, plan: Plan,
                             deadline: float | None) -> tuple[list[Any], dict[str, Any]]:
        """decode, for a request of LARGE_REQUEST_BYTES or more in the caller's turn: decoding costs
        the loop what encoding does (eight 5 MB requests of a million strings held it 6.7 s). A
        `LargeRequest` is parsed in the same turn, and its parsed tree is gone when the turn ends."""
        if not isinstance(request, LargeRequest) and request.ByteSize() < LARGE_REQUEST_BYTES:
            return self.decode(request, caller, plan.label)
        await take_turn(self.turns, caller, deadline, plan.label, "decode a large request")
        try:
            return self.decode(request.parse() if isinstance(request, LargeRequest) else request, caller, plan.label)
        finally:
            self.turns.release()

    def decode(self, request: pb.CallRequest, caller: Caller = Caller(),
               label: str = "") -> tuple[list[Any], dict[str, Any]]:
        decoder = self._decoder(caller.identity)
        decoder.begin()
        try:
            args = [decoder.decode(v, f"args[{i}]") for i, v in enumerate(request.args)]
            kwargs = {k: decoder.decode(v, f"kwargs[{clip(k, 40)!r}]") for k, v in request.kwargs.items()}
        except BridgeError as exc:   # a refusal while decoding names the value; say whose call it was
            if label and not exc.target:
                exc.message, exc.target = f"{label}: {exc.message}", label
                exc.args = (exc.message,)
            raise
        return args, kwargs

    def bind(self, plan: Plan, args: list[Any], kwargs: dict[str, Any]) -> tuple[list[Any], dict[str, Any]]:
        """Checks the arguments against the signature (and builds maps into config classes)."""
        args, kwargs, _ = self._bind(plan, args, kwargs)
        return args, kwargs

    def _bind(self, plan: Plan, args: list[Any],
              kwargs: dict[str, Any]) -> tuple[list[Any], dict[str, Any], inspect.BoundArguments | None]:
        """bind, and the bound arguments (None where there is no signature to bind them to)."""
        if plan.fn is None:
            if args or kwargs:
                raise BridgeError.validation(f"{plan.label} is an attribute and takes no arguments; got "
                                             f"{len(args)} positional and {len(kwargs)} keyword", target=plan.label)
            return args, kwargs, None
        if plan.fill_exit_args:
            args = _exit_args(plan.label, args, kwargs)
            kwargs = {}
        if plan.signature is None:
            return args, kwargs, None
        entry = plan.entry
        constructs = entry.owner if entry is not None and entry.kind is Kind.CONSTRUCTOR else None
        bound = bind_checked(plan.label, plan.signature, args, kwargs, self._building, plan.checks, constructs)
        return list(bound.args), dict(bound.kwargs), bound

    # ------------------------------------------------------------------------------------ execution
    async def run(self, plan: Plan, args: list[Any], kwargs: dict[str, Any], deadline: float | None,
                  client: str = "") -> Any:
        """Runs the plan once and returns the raw Python result (coroutines awaited); `client`: whom
        a blocking call abandoned in its thread counts against ("": the worker's own work)."""
        if plan.fn is None:
            assert plan.read is not None
            thunk: Callable[[], Any] = plan.read
        else:
            thunk = functools.partial(plan.fn, *args, **kwargs) if args or kwargs else plan.fn
        if plan.exclusive:
            await with_deadline(self._exclusive_lock.acquire(), deadline, plan.label, "waiting for the exclusive lane")
            try:
                return await self._run_unlocked(plan, thunk, deadline, self._exclusive_lane, client)
            finally:
                self._exclusive_lock.release()
        return await self._run_unlocked(plan, thunk, deadline, self._shared_lane, client)

    async def _run_unlocked(self, plan: Plan, thunk: Callable[[], Any], deadline: float | None,
                            lane: ThreadPoolExecutor, client: str) -> Any:
        if plan.is_async or plan.inline:
            result = thunk()
        else:
            result = await self._in_thread(lane, thunk, deadline, plan.label, client)
        if inspect.isawaitable(result):
            result = await with_deadline(result, deadline, plan.label)
        return result

    async def _in_thread(self, lane: ThreadPoolExecutor, thunk: Callable[[], Any], deadline: float | None,
                         label: str, client: str = "") -> Any:
        if (refused := self.shares.refusal(client, label)) is not None:
            raise refused
        shared = lane is self._shared_lane and client != ""
        if shared:
            await self.shares.take(client, deadline, label)
        try:
            job = lane.submit(contextvars.copy_context().run, thunk)    # what the call's guards set, with it
        except BaseException:
            if shared:
                self.shares.give_back(client)
            raise
        if shared:
            loop = asyncio.get_running_loop()
            job.add_done_callback(lambda _: loop.call_soon_threadsafe(self.shares.give_back, client))
        try:
            return await with_deadline(asyncio.wrap_future(job), deadline, label)
        except BaseException as exc:
            if not job.done() and not job.cancel():   # already running: cannot be pre-empted
                loop = asyncio.get_running_loop()
                self.abandoned += 1
                exclusive = lane is self._exclusive_lane
                if isinstance(exc, BridgeError) and exc.code == grpc.StatusCode.DEADLINE_EXCEEDED:
                    exc.reason = STILL_RUNNING      # (a collective's rank: its pool restarts the group)
                self.shares.give_up(client, not exclusive)
                if exclusive:   # everything that touches process-wide state now waits behind it
                    self.wedged = f"{label} was abandoned at its deadline and still runs in the exclusive lane"
                job.add_done_callback(lambda _: loop.call_soon_threadsafe(self._settle_abandoned, exclusive, client))
                if (on_end := _ON_END.get()) is not None:     # taken over: they run when the work ends
                    hooks = list(on_end)
                    on_end.clear()
                    job.add_done_callback(lambda _: loop.call_soon_threadsafe(lambda: [h() for h in hooks]))
            raise

    def _settle_abandoned(self, exclusive: bool, client: str) -> None:
        self.abandoned -= 1
        self.shares.given_up_ended(client, not exclusive)
        if exclusive:
            self.wedged = ""

    def check_release(self, ref_ids: list[str], who: str) -> None:
        """Refuses releasing, for `who`, a ref to a context manager another client holds entered."""
        for ref_id in ref_ids:
            obj = self.refs.object_of(ref_id)
            if obj is not None:
                self._contexts.check_release(obj, who)

    def settle_contexts(self) -> None:
        """Exits, now, the entered context managers whose refs are all gone (`EnteredContexts.settle`)."""
        self._contexts.settle()

    def blocked(self) -> str:
        """Why calls that need a thread cannot run now ("" when they can): the exclusive lane runs a
        call abandoned at its deadline, or every thread of the shared lane does."""
        reasons = [self.wedged] if self.wedged else []
        if self.shares.all_given_up():
            reasons.append(f"all {self.shared_threads} threads of the shared lane run calls abandoned at their "
                           f"deadline")
        return "; ".join(reasons)

    def _context(self, plan: Plan, caller: Caller) -> CallContext:
        return CallContext(self.policy, caller.identity, plan.published, self.catalog.names, self.world_size,
                           caller.client, self._contexts.holder)

    async def prepare(self, plan: Plan, args: list[Any], kwargs: dict[str, Any],
                      caller: Caller = Caller()) -> tuple[list[Any], dict[str, Any]]:
        """Binds the arguments and runs the entry's guard: everything that can refuse a call before it runs."""
        if plan.operator_only and not self.policy.operator(caller.identity):
            raise _not_operator(plan)
        args, kwargs, bound = self._bind(plan, args, kwargs)
        if plan.entry is not None and plan.entry.guard is not None:
            try:
                result = plan.entry.guard(plan.receiver, _bound_map(plan, args, kwargs, bound),
                                          self._context(plan, caller))
                settings = await result if inspect.isawaitable(result) else result
            except BridgeError as exc:
                raise _naming(exc, plan.label)
            if settings:
                args, kwargs = _setting(plan, args, kwargs, settings)
        return args, kwargs

    async def run_checked(self, plan: Plan, args: list[Any], kwargs: dict[str, Any], deadline: float | None,
                          caller: Caller = Caller()) -> Any:
        """run(), with failures of the called code turned into python_error statuses."""
        managed = plan.protocol and generator_manager(plan.receiver)
        if managed:
            self._contexts.check(plan.label, plan.protocol, plan.receiver, caller.client or caller.identity)
        called_for = calling_client.set(caller.client or caller.identity)
        try:
            return await self.run(plan, args, kwargs, deadline, _payer(caller))
        except BridgeError:
            raise
        except Exception as exc:
            err = BridgeError.from_exception(exc, plan.label, pure=plan.inline)
            if not err.parameter and err.code == grpc.StatusCode.INVALID_ARGUMENT:
                err.parameter = _named_first(str(exc), plan.signature, kwargs)
            raise err from exc
        finally:
            calling_client.reset(called_for)
            if managed:
                self._contexts.moved(plan.receiver)

    def _admit(self, plan: Plan, caller: Caller) -> bool:
        """Refuses, before anything runs, a call that would block this rank's process group (in a
        distributed pool an entry that talks to every rank runs only as a Collective), and one that
        may make or enter something while the worker holds its share of open files (`openfiles`).
        Says whether the call may make something (what it opens is then counted: `call`)."""
        if self.distributed and not caller.collective and plan.entry is not None and plan.entry.collective:
            raise BridgeError(grpc.StatusCode.FAILED_PRECONDITION, "validation",
                              f"{plan.label} talks to every rank of the pool's process group: run it with the "
                              f"Collective RPC (every rank at once); called on one rank it would wait forever",
                              target=plan.label, reason="use Collective")
        frees = plan.fill_exit_args or (plan.entry is not None and plan.entry.frees)
        makes = plan.fn is not None and not (plan.published or plan.inline or frees)
        if makes:
            room_for_files(plan.label)
        return makes

    def _makes_engines(self, plan: Plan) -> bool:
        entry = plan.entry
        return entry is not None and entry.result_ref and isinstance(entry.owner, type) and \
            entry.owner in self.catalog.lifecycles

    async def _made(self, plan: Plan, caller: Caller, args: list[Any], kwargs: dict[str, Any],
                    deadline: float | None, then: Callable[[Any], Awaitable[pb.Value]]) -> pb.Value:
        """Runs a plan that makes an engine, within the caller's limit of engines (each costs GBs):
        an identity's own, or, without one, its connection's share of what clients hold together
        (`refs.Tally`: one that made two and left kept every other client from making any). The
        engine counts as being made until `then` (its warm-up and delivery) has made its ref, which
        counts it from there: an engine warming up had counted nowhere, and creates sent meanwhile
        passed (four engines against a limit of two)."""
        limit = self.limits.max_engines_per_client
        payer = payer_of(caller.identity, connection_of(caller.client))
        held = self.refs.tally(lambda obj: self.catalog.lifecycle(obj) is not None, self._making)
        why = held.refusal(*payer, 1, limit, "engines")
        if why:
            raise BridgeError(grpc.StatusCode.RESOURCE_EXHAUSTED, "validation",
                              f"{plan.label}: no new engine on this worker: {why} (max_engines_per_client): release "
                              f"one first", target=plan.label, reason="max_engines_per_client")
        self._making[payer] = self._making.get(payer, 0) + 1
        # Counted until the build really ends: one its caller gave up on still starts an engine core.
        on_end: list[Callable[[], None]] = [functools.partial(self._made_one, payer)]
        token = _ON_END.set(on_end)
        try:
            return await then(await self.run_checked(plan, args, kwargs, deadline, caller))
        finally:
            _ON_END.reset(token)
            for hook in on_end:
                hook()

    def _made_one(self, payer: tuple[str, str | None]) -> None:
        left = self._making.pop(payer) - 1
        if left:
            self._making[payer] = left

    async def call(self, request: pb.CallRequest | LargeRequest, caller: Caller, deadlines: Deadlines,
                   plan: Plan | None = None, out: pb.Value | None = None) -> pb.Value:
        """Runs a call; its result is encoded into `out` (a reply's value) if given."""
        plan = plan or self.plan(request.target, caller)
        makes = self._admit(plan, caller)
        if plan.streams:
            said = "a Collective runs calls that return one result, on every rank" if caller.collective else \
                "call it with Stream (or a Multiplex start with stream set), not Call"
            raise BridgeError(grpc.StatusCode.FAILED_PRECONDITION, "validation",
                              f"{plan.label} yields its results one by one: {said}", target=plan.label,
                              reason="use Stream")
        args, kwargs = await self.prepare(plan, *await self.decode_in_turn(request, caller, plan, deadlines.call),
                                          caller)
        if caller.check_only:
            return _agreement(plan, args, kwargs, out)
        setting = request.target.kind == pb.Target.SET_ATTR
        if setting:        # what the value brings counts against the bytes refs may hold
            self.refs.room_to_set(plan.receiver, args[0], caller.identity, connection_of(caller.client))
        before = open_files() if makes else None
        finish = functools.partial(self._finish, plan, caller, deadlines, out, before, setting)
        if self._makes_engines(plan):
            return await self._made(plan, caller, args, kwargs, deadlines.call, finish)
        return await finish(await self.run_checked(plan, args, kwargs, deadlines.call, caller))

    async def _finish(self, plan: Plan, caller: Caller, deadlines: Deadlines, out: pb.Value | None,
                      before: int | None, setting: bool, result: Any) -> pb.Value:
        """A call's result, warmed up if it is a new engine, delivered (encoded, or a ref made)."""
        # what its object took counts against its maker's share (`refs.py`)
        opened = (open_files() or 0) - before if before is not None else 0
        if setting:
            self.refs.recount(plan.receiver, caller.identity, connection_of(caller.client))
            result = None
        elif plan.result_ref and result is not None and self.adopt is not None:
            await with_deadline(self.adopt(result), deadlines.call, plan.label, "warming up what it made")
        try:
            return await self.results.deliver(plan, result, caller, deadlines.call, out, opened)
        except BridgeError as err:
            if err.reason == "too many open files":
                # refused for the files it holds: they close with it now, not when the error's frames go
                result = None
                raise err.with_traceback(None) from None
            raise

    @staticmethod
    def immediate(plan: Plan) -> bool:
        """Whether a call of this plan can finish without the event loop: a trivial pure helper
        (inline), with no exclusive lane to wait for and no guard to await (a plain function's runs
        where the call is read)."""
        return plan.inline and not plan.is_async and not plan.exclusive and plan.fn is not None and \
            not plan.operator_only and (
            plan.entry is None or plan.entry.guard is None or not inspect.iscoroutinefunction(plan.entry.guard))

    def call_now(self, request: pb.CallRequest, caller: Caller, plan: Plan) -> pb.Value:
        """`call` for an `immediate` plan, synchronously: a Multiplex or lane request for a trivial
        helper is answered where it is read, with no task and no loop turn, which would cost more
        than the helper. Deadlines do not apply: an inline helper is never pre-empted anyway."""
        args, kwargs, bound = self._bind(plan, *self.decode(request, caller, plan.label))
        assert plan.fn is not None
        if plan.entry is not None and plan.entry.guard is not None:     # a plain function (see `immediate`)
            try:
                refused = plan.entry.guard(plan.receiver, _bound_map(plan, args, kwargs, bound),
                                           self._context(plan, caller))
            except BridgeError as exc:
                raise _naming(exc, plan.label)
            if inspect.iscoroutine(refused):     # a plain function that returned a coroutine after all
                refused.close()
                raise BridgeError(grpc.StatusCode.INTERNAL, "python", f"{plan.label}: its guard is not a plain "
                                  f"function, and an inline call cannot await it", target=plan.label)
        try:
            result = plan.fn(*args, **kwargs)
        except BridgeError:
            raise
        except Exception as exc:
            raise BridgeError.from_exception(exc, plan.label, pure=True) from exc
        if inspect.isawaitable(result):
            if inspect.iscoroutine(result):
                result.close()
            raise BridgeError(grpc.StatusCode.INTERNAL, "python", f"{plan.label} is declared inline (a trivial "
                              f"pure helper) but returned an awaitable", target=plan.label)
        return self.results.encode(plan, result, caller)

    async def call_python(self, target: str, args: list[Any], kwargs: dict[str, Any]) -> Any:
        """Runs a catalog entry for the worker itself (start-up work), with Python values in and out."""
        plan = self.planner.plan_entry(self.catalog.lookup(target))
        args, kwargs = await self.prepare(plan, args, kwargs)
        return await self.run_checked(plan, args, kwargs, None)

    async def create_object(self, name: str, target: str, args: list[Any], kwargs: dict[str, Any]) -> object:
        """Builds an object from config at start and publishes it under `name`."""
        self.objects[name] = obj = await self.call_python(target, args, kwargs)
        return obj

    async def stream(self, request: pb.CallRequest | LargeRequest, caller: Caller, deadlines: Deadlines,
                     interval_s: float | None = None, plan: Plan | None = None,
                     encoding: str | None = None, tee: bool = False) -> AsyncGenerator[tuple[Any, PutItem], None]:
        """Yields each item with the function that puts it into the message that carries it (a
        `StreamItem` or a `MuxEvent`), in the stream's encoding: the caller puts it in place.
        `tee` (with a PATCH encoding): each item comes twice, to be sent as a patch and then whole.
        The caller closes it (`contextlib.aclosing`) however it stops: closing is what ends the
        source (vLLM aborts its request), and garbage collection may come much later."""
        plan = plan or self.plan(request.target, caller)
        if plan.result_ref:         # one object, as a ref: found out only after it was made (an engine: 17 s)
            raise BridgeError.validation(f"{plan.label} returns one object, as a ref, which is not iterable: use "
                                         f"Call instead of Stream", target=plan.label)
        self._admit(plan, caller)
        args, kwargs = await self.prepare(plan, *await self.decode_in_turn(request, caller, plan, deadlines.call),
                                          caller)
        source = await self.run_checked(plan, args, kwargs, deadlines.call, caller)
        pace = Pace()
        put = pace.timed(self.results.item_writer(caller, plan.exclusive, encoding))
        lane, payer = (self._exclusive_lane if plan.exclusive else self._shared_lane), _payer(caller)
        items = iterate(source, plan.label, deadlines,
                        lambda step: self._in_thread(lane, step, None, plan.label, payer), interval_s, pace)
        activity, receiver = self._activity, id(plan.receiver)
        async with contextlib.aclosing(items):
            if tee and encoding in STREAM_PATCHES:
                both = Tee(put, pace.timed(self.results.item_writer(caller, plan.exclusive, None)))
                async for item in items:
                    activity[receiver] = time.monotonic()
                    yield item, both.first
                    yield item, both.second
                return
            async for item in items:
                activity[receiver] = time.monotonic()
                yield item, put


def _named_first(said: str, signature: inspect.Signature | None, kwargs: Mapping[str, Any]) -> str:
    """The parameter a refusal of the arguments is about, where its text opens with one of the
    call's parameter names ("presence_penalty must be in [-2, 2], got inf."): vLLM's own checks say
    which in words only. "" where it names none."""
    head = said.split(" ", 1)[0].rstrip(":,.")
    if not head.isidentifier():
        return ""
    names = set(kwargs) | (set(signature.parameters) if signature is not None else set())
    return head if head in names else ""


def _payer(caller: Caller) -> str:
    """Whom a call's abandoned thread counts against: its identity, else its host (a stranger's many
    connections are one client)."""
    return caller.identity or host_of(connection_of(caller.client))


def _not_operator(plan: Plan) -> BridgeError:
    return BridgeError(grpc.StatusCode.PERMISSION_DENIED, "validation",
                       f"{plan.label}: this {type(plan.receiver).__qualname__} is published by the server and shared by "
                       f"every client, and this changes it for all of them, which only an operator may do (pool "
                       f"config key operators); a client may make one of its own and do anything documented with it",
                       target=plan.label, reason="published")


def _setting(plan: Plan, args: list[Any], kwargs: dict[str, Any],
             settings: Mapping[str, Any]) -> tuple[list[Any], dict[str, Any]]:
    """The arguments with the values a guard sets in place of the caller's, wherever the caller
    put them (by position or by name)."""
    if plan.signature is None:
        return args, {**kwargs, **settings}
    bound = plan.signature.bind_partial(*args, **kwargs)
    bound.arguments.update(settings)
    return list(bound.args), dict(bound.kwargs)


def _bound_map(plan: Plan, args: list[Any], kwargs: dict[str, Any],
               bound: inspect.BoundArguments | None = None) -> Mapping[str, Any]:
    """The arguments by name, defaults filled in, as a guard reads them; `bound`: them bound already
    (args and kwargs were taken from it, so filling in its defaults changes neither)."""
    if plan.signature is None:
        return {**{str(i): a for i, a in enumerate(args)}, **kwargs}
    if bound is None:
        bound = plan.signature.bind_partial(*args, **kwargs)
    bound.apply_defaults()
    return bound.arguments



def _agreement(plan: Plan, args: list[Any], kwargs: dict[str, Any], out: pb.Value | None) -> pb.Value:
    """What of a Collective's share every rank must agree on, as text: each tensor argument's name,
    dtype and shape (a tensor's, or each of a list's), and the rank it sends from or gathers to.
    Ranks that give a reducing or gathering collective tensors of other dtypes or sizes abort the
    process group in C++ (gloo: rank 0 killed by SIGABRT, the group restarted, every client's refs
    on it lost) or wait for bytes that never come. An entry that only its source rank gives tensors
    to (`broadcast_tensor_dict`) says only its source."""
    import torch
    value = out if out is not None else pb.Value()
    source_only = plan.entry is not None and plan.entry.attr in _SOURCE_ONLY
    said = []
    for name, arg in _bound_map(plan, args, kwargs).items():
        if name in _ROOTS and type(arg) is int:    # the rank that sends or receives: one for all
            said.append(f"{name}: {arg}")
            continue
        if source_only:
            continue
        items = arg if isinstance(arg, (list, tuple)) and len(arg) <= 64 else (arg,)
        for k, item in enumerate(items):
            if isinstance(item, torch.Tensor):
                where = name if items is not arg else f"{name}[{k}]"
                said.append(f"{where}: {str(item.dtype).removeprefix('torch.')} {list(item.shape)}")
    value.str = "; ".join(said)
    return value


# Collectives whose tensors only the source rank gives (the others receive what it sends).
_SOURCE_ONLY = frozenset({"broadcast_tensor_dict"})
# Arguments naming the rank a collective sends from or gathers to: ranks that name two wait for each
# other for ever.
_ROOTS = frozenset({"src", "dst"})


def _naming(exc: BridgeError, label: str) -> BridgeError:
    """A guard's refusal, naming the call it refused (a guard may serve several entries)."""
    if not exc.target:
        exc.target = label
        if not exc.message.startswith(label):
            exc.message = f"{label}: {exc.message}"
            exc.args = (exc.message,)
    return exc
