"""Resolves a call's target to a `Plan`: what to run, where, with which checks, before anything of
the call is decoded or run (`invoke.py` runs it).

The surface is closed here, by construction. A catalog entry is reached by its name and kind; on a
receiver a client reaches the members the documents list for its class, the members an adapter
declares for an undocumented type that documented calls return (`Exposure`), and the context-manager
and iteration protocols; nothing else (PERMISSION_DENIED, naming the member and the type, the same
for a member that exists and one that does not).

Planning is on every call's path, so what a class alone decides (a method's entry, signature and
checks) is worked out once per (class, name) and only the receiver is bound per call.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import inspect
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import grpc
import msgspec
import pydantic

from bridge_server.wire.errors import BridgeError, clip, quote
from bridge_server.worker.binding import Checks, member_checks, member_signature, namespace_of
from bridge_server.worker.catalog import Catalog, Entry, Kind
from bridge_server.worker.refs import RefRegistry
from bridge_server.worker.results import CODE_TYPES
from bridge_server.worker.streams import iterable, lazily
from vllm_bridge.v1 import bridge_pb2 as pb

_PROTOCOL_METHODS = frozenset({"__enter__", "__exit__", "__aenter__", "__aexit__"})   # context managers
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
    published: bool = False               # the receiver is a published object (shared by every client)
    operator_only: bool = False           # it changes a published object for every client
    fill_exit_args: bool = False
    protocol: str = ""                    # the context-manager method it calls (`__enter__`, ...), if any


@dataclass(frozen=True)
class MethodShape:
    """What planning a call of a method learns from the receiver's class alone (the documented
    entry, the surface checks, the signature and the parameters' checks): the same for every
    instance, so it is worked out once per class and name; only the receiver is bound per call."""

    func: Callable[..., Any]              # the class's function: a bound method of it is what was planned
    label: str
    entry: Entry | None
    exclusive: bool
    is_async: bool
    streams: bool
    signature: inspect.Signature | None
    checks: Checks | None
    profile: str
    override: Callable[..., Any] | None   # called with the receiver first, in place of the method
    fill_exit_args: bool
    protocol: str

    def plan(self, obj: object, member: Any, exclusive: bool, published: bool) -> Plan:
        entry = self.entry
        fn = member if self.override is None else functools.partial(self.override, obj)
        return Plan(label=self.label, fn=fn, signature=self.signature, checks=self.checks, entry=entry,
                    exclusive=exclusive or self.exclusive, is_async=self.is_async, streams=self.streams,
                    profile=self.profile, receiver=obj, published=published,
                    operator_only=published and (entry is None or not entry.per_client),
                    fill_exit_args=self.fill_exit_args, protocol=self.protocol,
                    result_ref=entry.result_ref if entry else False)


def _declared(cls: type, name: str) -> tuple[Any, type]:
    """An attribute's declared type (an annotation, maybe a string) and the class that declares it."""
    for klass in cls.__mro__:
        annotations = klass.__dict__.get("__annotations__", {})
        if name in annotations:
            return annotations[name], klass
    return inspect.Parameter.empty, cls


MAX_METHOD_SHAPES = 4096    # (class, method) pairs planned once; past it, planned per call


# FUNCTION names any catalog entry (what the Python client sends for every name: a class is built, a
# module attribute read, as Python would); the other kinds say which they mean, and a name of another
# kind is refused rather than run: a MODULE_ATTR "read" of destroy_model_parallel destroyed the groups.
_ENTRY_KINDS = {pb.Target.MODULE_ATTR: Kind.MODULE_ATTR, pb.Target.CONSTRUCTOR: Kind.CONSTRUCTOR}
_WHAT = {Kind.FUNCTION: ("a function", "FUNCTION"), Kind.CLASSMETHOD: ("a classmethod", "FUNCTION"),
         Kind.CONSTRUCTOR: ("a class", "CONSTRUCTOR (or FUNCTION)"),
         Kind.MODULE_ATTR: ("a module attribute", "MODULE_ATTR (or FUNCTION)")}


def _kind_misfit(kind: int, entry: Entry) -> BridgeError:
    what, use = _WHAT.get(entry.kind, (entry.kind.name.lower(), "FUNCTION"))
    asked = "reads a module attribute, and never calls" if kind == pb.Target.MODULE_ATTR else "builds a class"
    return BridgeError.validation(f"{entry.name} is {what}, and target kind {pb.Target.Kind.Name(kind)} {asked}: "
                                  f"use target kind {use}", target=entry.name, parameter="target.kind")


@dataclass
class Planner:
    """Plans calls for one worker: its catalog, the refs clients hold and the objects it publishes."""

    catalog: Catalog
    refs: RefRegistry
    objects: dict[str, object]      # published by name at start (the worker's own dict, shared)
    _entry_plans: dict[str, Plan] = field(default_factory=dict)   # catalog targets carry no receiver: once
    _method_shapes: dict[tuple[type, str], MethodShape] = field(default_factory=dict)

    def publishes(self, obj: object) -> bool:
        """Whether obj is one of the objects this worker publishes (shared by every client)."""
        return any(obj is o for o in self.objects.values())

    def _receiver(self, target: pb.Target, identity: str) -> tuple[object, bool, bool]:
        """(receiver, exclusive, published)"""
        which = target.WhichOneof("receiver")
        if which == "ref":   # a ref may hold a published object too: what it is decides, not how it is named
            entry = self.refs.get(target.ref.id, identity)
            return entry.obj, entry.exclusive, self.publishes(entry.obj)
        if which == "object":
            if target.object not in self.objects:
                raise BridgeError.not_found(
                    f"no published object {quote(target.object)}; published: "
                    f"{', '.join(sorted(self.objects)) or 'none'}", target=quote(target.object),
                    suggestions=sorted(self.objects))
            return self.objects[target.object], False, True
        raise BridgeError.validation(f"{pb.Target.Kind.Name(target.kind)} {quote(target.name)} needs a receiver: "
                                     f"a ref or a published object name", parameter="target.receiver")

    def plan(self, target: pb.Target, identity: str = "") -> Plan:
        """The plan for a target, or the refusal that names what is wrong with it; a ref is looked up
        among `identity`'s own. Nothing of the target runs here."""
        kind = target.kind
        if kind in (pb.Target.FUNCTION, pb.Target.MODULE_ATTR, pb.Target.CONSTRUCTOR):
            given = target.WhichOneof("receiver")
            if given is not None:      # a receiver it would not use: the caller meant something else
                raise BridgeError.validation(
                    f"{clip(target.name, 80)}: target kind {pb.Target.Kind.Name(kind)} takes no receiver, got "
                    f"target.{given}; call a member of a ref or object with kind METHOD, GET_ATTR, SET_ATTR or "
                    f"ITERATE", parameter=f"target.{given}")
            plan = self._entry_plans.get(target.name)
            if plan is None:
                plan = self._entry_plans[target.name] = self.plan_entry(self.catalog.lookup(target.name))
            if kind != pb.Target.FUNCTION and plan.entry is not None and plan.entry.kind is not _ENTRY_KINDS[kind]:
                raise _kind_misfit(kind, plan.entry)
            return plan
        if kind in (pb.Target.METHOD, pb.Target.GET_ATTR, pb.Target.SET_ATTR, pb.Target.ITERATE):
            obj, exclusive, published = self._receiver(target, identity)
            return self._plan_member(target, obj, exclusive, published)
        raise BridgeError.validation(f"target kind {kind} is not one of FUNCTION, MODULE_ATTR, CONSTRUCTOR, "
                                     f"METHOD, GET_ATTR, SET_ATTR, ITERATE", parameter="target.kind")

    def plan_entry(self, e: Entry) -> Plan:
        """A catalog entry's plan: the same for every call (entries carry no receiver)."""
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
        what, kind = ("an attribute", "GET_ATTR") if e.kind is Kind.ATTRIBUTE else ("a method", "METHOD")
        raise BridgeError.validation(f"{e.name} is {what} of {e.class_name}: call it on a ref or a published object "
                                     f"(target kind {kind} with name {e.attr!r})", target=e.name,
                                     parameter="target.kind")

    def _denied(self, obj: object, name: str, why: str, allowed: Iterable[str] = ()) -> BridgeError:
        """PERMISSION_DENIED, the same for a member that exists and one that does not: a client
        learns what it may reach (the closest names), not what else is there."""
        label = f"{type(obj).__qualname__}.{clip(name, 80)}"
        close = difflib.get_close_matches(name, list(allowed), n=5, cutoff=0.6)
        hint = f"; did you mean {', '.join(close)}?" if close else ""
        return BridgeError(grpc.StatusCode.PERMISSION_DENIED, "validation",
                           f"{label}: {clip(name, 80)!r} is not part of the documented surface of "
                           f"{type(obj).__module__}.{type(obj).__qualname__} ({why}){hint}", target=label,
                           parameter="target.name", reason="not documented", suggestions=close)

    def _reachable(self, obj: object, name: str, kind: int) -> Entry | None:
        """The documented entry for the member, if any; PERMISSION_DENIED for a member a client may
        not reach (see the module docstring)."""
        entry = self.catalog.member(obj, name)
        if entry is not None:
            if kind == pb.Target.SET_ATTR and entry.kind is not Kind.ATTRIBUTE:
                raise self._denied(obj, name, "only its documented attributes can be set")
            return entry
        if name in _PROTOCOL_METHODS and kind == pb.Target.METHOD and hasattr(type(obj), name):
            return None
        exposure = self.catalog.exposure(obj)
        if exposure is None:
            members = [n for c in type(obj).__mro__ for n in self.catalog.methods.get(c, {})]
            raise self._denied(obj, name, "Describe lists its documented members" if members
                               else "no member of this type is", members)
        if kind == pb.Target.SET_ATTR:
            raise self._denied(obj, name, "its members are read only")
        cls: type = type(obj)
        allowed = exposure.methods if kind == pb.Target.METHOD else exposure.attributes | (
            _declared_fields(cls) if exposure.fields else frozenset())
        if name not in allowed:
            raise self._denied(obj, name, f"of it a client may {'call' if kind == pb.Target.METHOD else 'read'} "
                                          f"{', '.join(sorted(allowed)) or 'nothing'}", allowed)
        return None

    def _plan_member(self, target: pb.Target, obj: object, exclusive: bool, published: bool = False) -> Plan:
        name, kind = target.name, target.kind
        if kind == pb.Target.METHOD:
            shape = self._method_shapes.get((type(obj), name))
            if shape is not None:
                # the same class function as when it was planned (not one an instance or a patch put there)
                member = getattr(obj, name, None)
                if inspect.ismethod(member) and member.__func__ is shape.func:
                    return shape.plan(obj, member, exclusive, published)
        label = f"{type(obj).__qualname__}.{clip(name, 80)}" if name else type(obj).__qualname__
        if isinstance(obj, CODE_TYPES):
            raise BridgeError(grpc.StatusCode.PERMISSION_DENIED, "validation",
                              f"{label}: members of a {type(obj).__name__} cannot be reached through a ref",
                              target=label)
        if kind == pb.Target.ITERATE:     # Stream's only: as a Call it would hand out a ref to the receiver
            if not iterable(obj):         # said here, whichever RPC: each would send the caller to the other
                raise BridgeError.validation(
                    f"{label}: ITERATE streams the items of a list, tuple, set, tensor or iterator, and a "
                    f"{type(obj).__qualname__} is none of them (read it whole with a Call)", target=label,
                    parameter="target.kind")
            return Plan(label=label, fn=None, read=lambda: lazily(obj), exclusive=exclusive, receiver=obj,
                        streams=True, published=published)
        entry = self._reachable(obj, name, kind)
        if entry is not None:
            label = entry.name
            exclusive = exclusive or entry.exclusive
        profile = entry.profile if entry else "default"
        if kind == pb.Target.SET_ATTR:
            # the value is checked against the attribute's declared type, as a constructor's argument is
            annotation, owner = _declared(type(obj), name)
            value = inspect.Parameter(name, inspect.Parameter.POSITIONAL_ONLY, annotation=annotation)
            return Plan(label=label, fn=functools.partial(setattr, obj, name), exclusive=exclusive,
                        signature=inspect.Signature([value]), checks=Checks(namespace_of(owner)),
                        receiver=obj, published=published, operator_only=published)
        try:
            member = getattr(obj, name)
        except AttributeError:
            raise BridgeError.not_found(f"{label}: {type(obj).__qualname__} has no attribute {clip(name, 80)!r}",
                                        target=label) from None
        if kind == pb.Target.GET_ATTR:
            if entry is not None and entry.kind is Kind.METHOD:    # (a bound method is never sent as a value)
                raise BridgeError.validation(f"{label} is a method, not an attribute: use METHOD", target=label,
                                             parameter="target.kind")
            return Plan(label=label, fn=None, read=lambda: member, exclusive=exclusive, entry=entry, receiver=obj,
                        published=published)
        if not callable(member):
            raise BridgeError.validation(f"{label} is an attribute, not a method: use GET_ATTR", target=label,
                                         parameter="target.kind")
        if not inspect.isroutine(member) or entry is not None and entry.kind is Kind.ATTRIBUTE:
            # A callable object in an attribute (the engine's tokenizer) is not a method of its owner:
            # calling it ran its `__call__`, which nothing declares, with any options (padding to 10**7).
            raise BridgeError.validation(f"{label} is an attribute (a {type(member).__name__}), not a method: "
                                         f"read it with GET_ATTR, and call what is documented of it on its ref",
                                         target=label)
        is_async = inspect.iscoroutinefunction(member) or inspect.isasyncgenfunction(member)
        streams = inspect.isasyncgenfunction(member) or inspect.isgeneratorfunction(member)
        sig = member_signature(type(obj), name, member)
        documented = tuple((p.name, p.type) for p in entry.doc.params) if entry and entry.doc else ()
        cls: type = type(obj)
        checks = member_checks(cls, name, documented) if inspect.ismethod(member) else None
        override = None
        if entry is not None and entry.override is not None:   # the adapter's version, receiver first
            override, is_async = entry.override, True
        elif entry is None and (exposed := self.catalog.exposure(obj)) is not None and name in exposed.overrides:
            override = exposed.overrides[name]    # runs where the method would
        shape = MethodShape(getattr(member, "__func__", member), label, entry, entry.exclusive if entry else False,
                             is_async, streams, sig, checks, profile, override, name in _EXIT_METHODS,
                             name if name in _PROTOCOL_METHODS else "")
        if kind == pb.Target.METHOD and inspect.ismethod(member) and member.__func__ is getattr(cls, name, None) \
                and len(self._method_shapes) < MAX_METHOD_SHAPES:
            self._method_shapes[(cls, name)] = shape     # a class's own method: the same for every instance
        return shape.plan(obj, member, exclusive, published)


@functools.lru_cache(maxsize=256)
def _declared_fields(cls: type) -> frozenset[str]:
    """A record class's declared fields (dataclass, msgspec struct, pydantic model), public ones."""
    if dataclasses.is_dataclass(cls):
        names: Iterable[str] = (f.name for f in dataclasses.fields(cls))
    elif issubclass(cls, msgspec.Struct):
        names = cls.__struct_fields__
    elif issubclass(cls, pydantic.BaseModel):
        names = cls.model_fields
    else:
        names = ()
    return frozenset(n for n in names if not n.startswith("_"))
