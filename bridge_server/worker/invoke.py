"""Runs one call: resolve the target, decode and bind the arguments, run, encode the result.

Where work runs is decided here, once, for every kind of target:
- coroutines and async generators run on the event loop, so many AsyncLLM calls share one engine;
- blocking functions run in a thread pool, except the trivial pure helpers that run inline;
- calls that touch process-wide state (forward context, process groups) run in the exclusive lane,
  one at a time and in arrival order.
Deadlines are enforced here, not by the client: async work is cancelled for real (AsyncLLM aborts
the request); a blocking call that has not started is dropped from its queue; one that is already
running inside C code cannot be pre-empted, so it is abandoned and counted in `abandoned`.
"""

from __future__ import annotations

import asyncio
import difflib
import functools
import inspect
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import grpc

from bridge_server.wire.codec import Encoder
from bridge_server.wire.decoder import Decoder
from bridge_server.wire.errors import BridgeError
from bridge_server.wire.protocol import STREAM_PATCH_V1
from bridge_server.worker.binding import Checks, bind_arguments, member_checks, member_signature, namespace_of
from bridge_server.worker.catalog import Catalog, Entry, Kind
from bridge_server.worker.deadlines import Deadlines, with_deadline
from bridge_server.worker.refs import RefRegistry
from bridge_server.worker.streams import PutItem, Tee, item_writer, iterate
from vllm_bridge.v1 import bridge_pb2 as pb

_ALLOWED_DUNDERS = frozenset({"__enter__", "__exit__", "__aenter__", "__aexit__", "__len__", "__getitem__",
                              "__contains__"})
_EXIT_METHODS = frozenset({"__exit__", "__aexit__"})



@dataclass
class Plan:
    """What to run, as resolved from the target: the one place that knows what a target kind means."""

    label: str
    fn: Callable[..., Any] | None         # called with the bound arguments; None: a read
    read: Callable[[], Any] | None = None
    signature: inspect.Signature | None = None
    checks: Checks | None = None          # the parameters' type checks
    entry: Entry | None = None
    exclusive: bool = False
    inline: bool = False
    is_async: bool = False
    streams: bool = False                 # a generator: Stream's, never Call's
    result_ref: bool = False
    profile: str = "default"
    receiver: object = None
    fill_exit_args: bool = False


@dataclass
class Invoker:
    catalog: Catalog
    refs: RefRegistry
    objects: dict[str, object] = field(default_factory=dict)    # published by name at start
    tensor_max_bytes: int = 16 * 1024 * 1024
    shared_threads: int = 16
    distributed: bool = False   # a rank of a distributed pool: collective entries run only as Collectives
    abandoned: int = 0      # blocking calls still running after their caller gave up
    wedged: str = ""        # a call abandoned in the exclusive lane, still running: it blocks the lane
    # Called with what a result_ref entry (an engine's constructor) made, before the caller gets it.
    adopt: Callable[[object], Awaitable[None]] | None = None
    _activity: dict[int, float] = field(default_factory=dict)   # id(receiver) -> when it last yielded an item

    def __post_init__(self) -> None:
        self._exclusive_lane = ThreadPoolExecutor(1, thread_name_prefix="bridge-exclusive")
        self._shared_lane = ThreadPoolExecutor(self.shared_threads, thread_name_prefix="bridge-shared")
        self._exclusive_lock = asyncio.Lock()
        self._decoder = Decoder(resolve_ref=self._resolve_ref, resolve_type=self.catalog.resolve_type)
        self._entry_plans: dict[str, Plan] = {}   # catalog targets carry no receiver: plan them once

    def active_since(self, obj: object, since: float) -> bool:
        """Whether a stream on `obj` yielded an item after `since` (time.monotonic()): progress."""
        return self._activity.get(id(obj), 0.0) > since

    def close(self) -> None:
        self._shared_lane.shutdown(wait=False, cancel_futures=True)
        self._exclusive_lane.shutdown(wait=False, cancel_futures=True)

    # ----------------------------------------------------------------------------------- resolution
    def _resolve_ref(self, ref: pb.Ref) -> object:
        return self.refs.get(ref.id).obj

    def _receiver(self, target: pb.Target) -> tuple[object, bool]:
        which = target.WhichOneof("receiver")
        if which == "ref":
            entry = self.refs.get(target.ref.id)
            return entry.obj, entry.exclusive
        if which == "object":
            if target.object not in self.objects:
                raise BridgeError.not_found(
                    f"no published object {target.object!r}; published: {', '.join(sorted(self.objects)) or 'none'}",
                    target=target.object, suggestions=sorted(self.objects))
            return self.objects[target.object], False
        raise BridgeError.validation(f"{pb.Target.Kind.Name(target.kind)} {target.name!r} needs a receiver: "
                                     f"a ref or a published object name", parameter="target.receiver")

    def plan(self, target: pb.Target) -> Plan:
        kind = target.kind
        if kind in (pb.Target.FUNCTION, pb.Target.MODULE_ATTR, pb.Target.CONSTRUCTOR):
            plan = self._entry_plans.get(target.name)
            if plan is None:
                plan = self._entry_plans[target.name] = self._plan_entry(self.catalog.lookup(target.name))
            return plan
        if kind in (pb.Target.METHOD, pb.Target.GET_ATTR, pb.Target.SET_ATTR, pb.Target.ITERATE):
            obj, exclusive = self._receiver(target)
            return self._plan_member(target, obj, exclusive)
        raise BridgeError.validation(f"target kind {kind} is not one of FUNCTION, MODULE_ATTR, CONSTRUCTOR, "
                                     f"METHOD, GET_ATTR, SET_ATTR, ITERATE", parameter="target.kind")

    def _plan_entry(self, e: Entry) -> Plan:
        common = dict(label=e.name, entry=e, exclusive=e.exclusive, inline=e.inline, profile=e.profile,
                      is_async=e.is_async, streams=e.streams, result_ref=e.result_ref)
        if e.kind is Kind.MODULE_ATTR:
            return Plan(fn=None, read=e.resolve, **common)  # type: ignore[arg-type]
        documented = {p.name: p.type for p in e.doc.params} if e.doc else {}
        if e.kind is Kind.CONSTRUCTOR:
            fn = e.override or e.owner
            return Plan(fn=fn, signature=e.signature, checks=Checks(namespace_of(fn), documented),
                        **common)  # type: ignore[arg-type]
        if e.kind in (Kind.FUNCTION, Kind.CLASSMETHOD):
            fn = e.override or e.resolve()
            return Plan(fn=fn, signature=e.signature, checks=Checks(namespace_of(fn), documented),
                        **common)  # type: ignore[arg-type]
        raise BridgeError.validation(f"{e.name} is a {e.kind.name.lower()} of {e.class_name}: call it on a ref "
                                     f"(target kind METHOD or GET_ATTR with name {e.attr!r})", target=e.name)

    def _plan_member(self, target: pb.Target, obj: object, exclusive: bool) -> Plan:
        name, kind = target.name, target.kind
        label = f"{type(obj).__qualname__}.{name}" if name else type(obj).__qualname__
        if isinstance(obj, ModuleType):
            raise BridgeError(grpc.StatusCode.PERMISSION_DENIED, "validation",
                              f"{label}: members of a module cannot be reached through a ref", target=label)
        if kind == pb.Target.ITERATE:
            return Plan(label=label, fn=None, read=lambda: obj, exclusive=exclusive, receiver=obj)
        entry = self.catalog.member(obj, name)
        if entry is None and name.startswith("_") and name not in _ALLOWED_DUNDERS:
            raise BridgeError(grpc.StatusCode.PERMISSION_DENIED, "validation",
                              f"{label}: private member {name!r} is not part of the documented surface",
                              target=label, parameter="target.name")
        if entry is not None:
            label = entry.name
            exclusive = exclusive or entry.exclusive
        profile = entry.profile if entry else "default"
        if kind == pb.Target.SET_ATTR:
            return Plan(label=label, fn=functools.partial(setattr, obj, name), exclusive=exclusive,
                        signature=inspect.Signature([inspect.Parameter("value", inspect.Parameter.POSITIONAL_ONLY)]))
        try:
            member = getattr(obj, name)
        except AttributeError:
            public = [n for n in dir(obj) if not n.startswith("_")]
            raise BridgeError.not_found(f"{label}: {type(obj).__qualname__} has no attribute {name!r}", target=label,
                                        suggestions=difflib.get_close_matches(name, public, n=5)) from None
        if kind == pb.Target.GET_ATTR:
            return Plan(label=label, fn=None, read=lambda: member, exclusive=exclusive, entry=entry, receiver=obj)
        if not callable(member):
            raise BridgeError.validation(f"{label} is an attribute, not a method: use GET_ATTR", target=label)
        is_async = inspect.iscoroutinefunction(member) or inspect.isasyncgenfunction(member)
        streams = inspect.isasyncgenfunction(member) or inspect.isgeneratorfunction(member)
        sig = member_signature(type(obj), name, member)
        documented = tuple((p.name, p.type) for p in entry.doc.params) if entry and entry.doc else ()
        cls: type = type(obj)
        checks = member_checks(cls, name, documented) if inspect.ismethod(member) else None
        if entry is not None and entry.override is not None:   # the adapter's version, receiver first
            member, is_async = functools.partial(entry.override, obj), True
        return Plan(label=label, fn=member, signature=sig, checks=checks, entry=entry, exclusive=exclusive,
                    is_async=is_async,
                    streams=streams, profile=profile, receiver=obj, fill_exit_args=name in _EXIT_METHODS,
                    result_ref=entry.result_ref if entry else False)

    # -------------------------------------------------------------------------------------- binding
    def decode(self, request: pb.CallRequest) -> tuple[list[Any], dict[str, Any]]:
        args = [self._decoder.decode(v, f"args[{i}]") for i, v in enumerate(request.args)]
        kwargs = {k: self._decoder.decode(v, f"kwargs[{k!r}]") for k, v in request.kwargs.items()}
        return args, kwargs

    def bind(self, plan: Plan, args: list[Any], kwargs: dict[str, Any]) -> tuple[list[Any], dict[str, Any]]:
        """Checks the arguments against the signature (and builds maps into config classes)."""
        if plan.fn is None:
            if args or kwargs:
                raise BridgeError.validation(f"{plan.label} is an attribute and takes no arguments; got "
                                             f"{len(args)} positional and {len(kwargs)} keyword", target=plan.label)
            return args, kwargs
        if plan.fill_exit_args and not args and not kwargs:
            args = [None, None, None]
        if plan.signature is None:
            return args, kwargs
        return bind_arguments(plan.label, plan.signature, args, kwargs, self.catalog.short_types, plan.checks)

    # ------------------------------------------------------------------------------------ execution
    async def run(self, plan: Plan, args: list[Any], kwargs: dict[str, Any], deadline: float | None) -> Any:
        """Runs the plan once and returns the raw Python result (coroutines awaited)."""
        if plan.fn is None:
            assert plan.read is not None
            thunk: Callable[[], Any] = plan.read
        else:
            thunk = functools.partial(plan.fn, *args, **kwargs) if args or kwargs else plan.fn
        if plan.exclusive:
            await with_deadline(self._exclusive_lock.acquire(), deadline, plan.label, "waiting for the exclusive lane")
            try:
                return await self._run_unlocked(plan, thunk, deadline, self._exclusive_lane)
            finally:
                self._exclusive_lock.release()
        return await self._run_unlocked(plan, thunk, deadline, self._shared_lane)

    async def _run_unlocked(self, plan: Plan, thunk: Callable[[], Any], deadline: float | None,
                            lane: ThreadPoolExecutor) -> Any:
        if plan.is_async or plan.inline:
            result = thunk()
        else:
            result = await self._in_thread(lane, thunk, deadline, plan.label)
        if inspect.isawaitable(result):
            result = await with_deadline(result, deadline, plan.label)
        return result

    async def _in_thread(self, lane: ThreadPoolExecutor, thunk: Callable[[], Any], deadline: float | None,
                         label: str) -> Any:
        job = lane.submit(thunk)
        try:
            return await with_deadline(asyncio.wrap_future(job), deadline, label)
        except BaseException:
            if not job.done() and not job.cancel():   # already running: cannot be pre-empted
                loop = asyncio.get_running_loop()
                self.abandoned += 1
                exclusive = lane is self._exclusive_lane
                if exclusive:   # everything that touches process-wide state now waits behind it
                    self.wedged = f"{label} was abandoned at its deadline and still runs in the exclusive lane"
                job.add_done_callback(lambda _: loop.call_soon_threadsafe(self._settle_abandoned, exclusive))
            raise

    def _settle_abandoned(self, exclusive: bool) -> None:
        self.abandoned -= 1
        if exclusive:
            self.wedged = ""

    def encoder(self, session_id: str, exclusive: bool, stream: bool = False) -> Encoder:
        def make_ref(obj: object) -> pb.Ref:
            entry = self.refs.put(obj, session_id, exclusive=exclusive)
            return pb.Ref(id=entry.id, session_id=session_id, worker_id=self.refs.worker_id,
                          type_name=entry.type_name, repr=_short_repr(obj))
        return Encoder(make_ref=make_ref, tensor_max_bytes=self.tensor_max_bytes, records=self.catalog.records,
                       constant_fields=self.catalog.record_constants, memo={} if stream else None)

    def encode_result(self, plan: Plan, result: Any, session_id: str) -> pb.Value:
        enc = self.encoder(session_id, plan.exclusive)
        if plan.entry is not None and plan.entry.doc is not None:
            result = _as_documented(plan.entry.doc.returns, result)
        if plan.result_ref and result is not None:
            return pb.Value(ref=enc.make_ref(result))
        return enc.encode(result)

    async def prepare(self, plan: Plan, args: list[Any], kwargs: dict[str, Any]) -> tuple[list[Any], dict[str, Any]]:
        """Binds the arguments and runs the entry's guard: everything that can refuse a call before it runs."""
        args, kwargs = self.bind(plan, args, kwargs)
        if plan.entry is not None and plan.entry.guard is not None:
            await _maybe_await(plan.entry.guard(plan.receiver, _bound_map(plan, args, kwargs)))
        return args, kwargs

    async def run_checked(self, plan: Plan, args: list[Any], kwargs: dict[str, Any], deadline: float | None) -> Any:
        """run(), with failures of the called code turned into python_error statuses."""
        try:
            return await self.run(plan, args, kwargs, deadline)
        except BridgeError:
            raise
        except Exception as exc:
            raise BridgeError.from_exception(exc, plan.label) from exc

    def _admit(self, plan: Plan, collective: bool) -> None:
        """Refuses, before anything runs, a call that would block this rank's process group: in a
        distributed pool an entry that talks to every rank runs only as a Collective."""
        if self.distributed and not collective and plan.entry is not None and plan.entry.collective:
            raise BridgeError(grpc.StatusCode.FAILED_PRECONDITION, "validation",
                              f"{plan.label} talks to every rank of the pool's process group: run it with the "
                              f"Collective RPC (every rank at once); called on one rank it would wait forever",
                              target=plan.label, reason="use Collective")

    async def call(self, request: pb.CallRequest, session_id: str, deadlines: Deadlines,
                   plan: Plan | None = None, collective: bool = False) -> pb.Value:
        plan = plan or self.plan(request.target)
        self._admit(plan, collective)
        if plan.streams:
            raise BridgeError(grpc.StatusCode.FAILED_PRECONDITION, "validation",
                              f"{plan.label} yields its results one by one: call it with Stream (or a Multiplex "
                              f"start with stream set), not Call", target=plan.label, reason="use Stream")
        args, kwargs = await self.prepare(plan, *self.decode(request))
        result = await self.run_checked(plan, args, kwargs, deadlines.call)
        if request.target.kind == pb.Target.SET_ATTR:
            result = None
        elif plan.result_ref and result is not None and self.adopt is not None:
            await with_deadline(self.adopt(result), deadlines.call, plan.label, "warming up what it made")
        return self.encode_result(plan, result, session_id)

    @staticmethod
    def immediate(plan: Plan) -> bool:
        """Whether a call of this plan can finish without the event loop: a trivial pure helper
        (inline), with no exclusive lane to wait for and no guard to await."""
        return plan.inline and not plan.is_async and not plan.exclusive and plan.fn is not None and (
            plan.entry is None or plan.entry.guard is None)

    def call_now(self, request: pb.CallRequest, session_id: str, plan: Plan) -> pb.Value:
        """`call` for an `immediate` plan, synchronously: a Multiplex or lane request for a trivial
        helper is answered where it is read, with no task and no loop turn, which would cost more
        than the helper. Deadlines do not apply: an inline helper is never pre-empted anyway."""
        args, kwargs = self.bind(plan, *self.decode(request))
        assert plan.fn is not None
        try:
            result = plan.fn(*args, **kwargs)
        except BridgeError:
            raise
        except Exception as exc:
            raise BridgeError.from_exception(exc, plan.label) from exc
        if inspect.isawaitable(result):
            if inspect.iscoroutine(result):
                result.close()
            raise BridgeError(grpc.StatusCode.INTERNAL, "python", f"{plan.label} is declared inline (a trivial "
                              f"pure helper) but returned an awaitable", target=plan.label)
        return self.encode_result(plan, result, session_id)

    async def call_python(self, target: str, args: list[Any], kwargs: dict[str, Any]) -> Any:
        """Runs a catalog entry for the worker itself (start-up work), with Python values in and out."""
        plan = self._plan_entry(self.catalog.lookup(target))
        args, kwargs = await self.prepare(plan, args, kwargs)
        return await self.run_checked(plan, args, kwargs, None)

    async def create_object(self, name: str, target: str, args: list[Any], kwargs: dict[str, Any]) -> object:
        """Builds an object from config at start and publishes it under `name`."""
        self.objects[name] = obj = await self.call_python(target, args, kwargs)
        return obj

    async def stream(self, request: pb.CallRequest, session_id: str, deadlines: Deadlines,
                     interval_s: float | None = None, plan: Plan | None = None, collective: bool = False,
                     encoding: str | None = None, tee: bool = False) -> AsyncIterator[tuple[Any, PutItem]]:
        """Yields each item with the function that puts it into the message that carries it (a
        `StreamItem` or a `MuxEvent`), in the stream's encoding: the caller puts it in place.
        `tee` (with PATCH_V1): each item comes twice, to be sent as a patch and then whole."""
        plan = plan or self.plan(request.target)
        self._admit(plan, collective)
        args, kwargs = await self.prepare(plan, *self.decode(request))
        source = await self.run_checked(plan, args, kwargs, deadlines.call)
        put = self.item_writer(session_id, plan.exclusive, encoding)
        lane = self._exclusive_lane if plan.exclusive else self._shared_lane
        items = iterate(source, plan.label, deadlines, lambda step: self._in_thread(lane, step, None, plan.label),
                        interval_s)
        activity, receiver = self._activity, id(plan.receiver)
        if tee and encoding == STREAM_PATCH_V1:
            both = Tee(put, self.item_writer(session_id, plan.exclusive, None))
            async for item in items:
                activity[receiver] = time.monotonic()
                yield item, both.first
                yield item, both.second
            return
        async for item in items:
            activity[receiver] = time.monotonic()
            yield item, put

    def item_writer(self, session_id: str, exclusive: bool, encoding: str | None) -> PutItem:
        return item_writer(lambda stream: self.encoder(session_id, exclusive, stream), encoding)


def _as_documented(returns: str, result: Any) -> Any:
    """Gives a result the shape its document promises where vLLM's own type drifts (results that
    cross vLLM's engine IPC come back as lists even when the API returns a tuple or a set)."""
    if isinstance(result, list):
        if returns.startswith("{") and returns.endswith("}"):
            return tuple(result)
        if returns.startswith("MapSet"):
            return set(result)
    return result


def _bound_map(plan: Plan, args: list[Any], kwargs: dict[str, Any]) -> Mapping[str, Any]:
    if plan.signature is None:
        return {**{str(i): a for i, a in enumerate(args)}, **kwargs}
    bound = plan.signature.bind_partial(*args, **kwargs)
    bound.apply_defaults()
    return bound.arguments


async def _maybe_await(value: Any) -> None:
    if inspect.isawaitable(value):
        await value


def _short_repr(obj: object) -> str:
    try:
        text = repr(obj)
    except Exception:
        text = f"<{type(obj).__qualname__}>"
    return text if len(text) <= 200 else text[:197] + "..."
