"""A LoRA id means one adapter on an engine, for every client, for the engine's life; and an adapter
is loaded before any request may use it.

Why: vLLM knows an adapter by `lora_int_id` alone. A request that names an id already loaded runs
with what is loaded, whatever path it gives; and once an adapter was evicted from the CPU cache
(`max_cpu_loras`), the next request under its id loads the path that request gives. On a published
engine every client shares the ids, so a stranger who added adapter B under the id a bystander used
for adapter A (at once, or after evicting A with adds of its own) made the bystander's requests run
with B's weights, with no error. So the first path seen under an id stays its path: a request or
`add_lora` that gives the id with another path is refused (ALREADY_EXISTS) before it reaches vLLM,
and only `remove_lora` (an operator's, on a published engine) frees the id.

And vLLM loads a request's adapter inside the engine core, where a failure is fatal: one `generate`
naming a folder with no adapter in it killed the published engine under every client's requests.
`add_lora` reports the same failure as an error and the core lives on. So a request that names an
id not yet seen on the engine loads its adapter with `add_lora` first, and is refused
(INVALID_ARGUMENT, naming `lora_request.lora_path`) if that fails; an id is bound only once its
adapter has loaded, so later loads (after an eviction) read a path that loaded before.

vLLM also tells adapters apart by `lora_name` alone (a LoRA request's equality and hash): two
requests of one name under two ids in one step counted as one adapter, the other id was never
activated, and the engine core died looking it up (every client of a published LoRA engine got
UNAVAILABLE for 17 s, at will). So a name is bound with its id: one name, one id, both ways, refused
otherwise (ALREADY_EXISTS, naming `lora_request.lora_name`).

What binding costs a client is bounded like the other shared state: a host (an identity, with
authentication) binds at most MAX_IDS_PER_HOST ids on an engine, and an engine at most MAX_IDS.
"""

from __future__ import annotations

import os
import weakref
from dataclasses import dataclass, field
from typing import Any

import grpc

from bridge_server.wire.errors import BridgeError, clip, quote
from bridge_server.wire.protocol import host_of

__all__ = ["MAX_IDS", "MAX_IDS_PER_HOST", "MAX_NAME_CHARS", "MAX_PATH_CHARS", "add", "admit", "check", "unbind"]

MAX_IDS = 65_536           # ids bound on one engine, every client's
MAX_IDS_PER_HOST = 1_024   # of those, one host's (an identity's)
MAX_NAME_CHARS = 256       # a bound name is kept for the engine's life: 1,022 names of ~1M characters had
MAX_PATH_CHARS = 4_096     # grown the engine's worker by 1 GB for good (a path: the system's own limit)
_VLLM_SAYS = "Call to add_lora method failed: "


@dataclass
class _Bound:
    paths: dict[int, tuple[str, str, str]] = field(default_factory=dict)    # id -> (real path, who bound it, name)
    ids: dict[str, int] = field(default_factory=dict)      # name -> id
    per_host: dict[str, int] = field(default_factory=dict)


_engines: weakref.WeakKeyDictionary[Any, _Bound] = weakref.WeakKeyDictionary()


def _fields(lora_request: Any) -> tuple[int, str, str] | None:
    lora_id = getattr(lora_request, "lora_int_id", None)
    path = getattr(lora_request, "lora_path", "") or ""
    name = getattr(lora_request, "lora_name", None)
    if type(lora_id) is not int or type(path) is not str or type(name) is not str:
        return None             # refused by the request's own checks
    return lora_id, path, name


def _real(path: str) -> str:
    return os.path.realpath(path) if path else path


def check(engine: Any, label: str, lora_request: Any, client: str, parameter: str = "lora_request") -> bool:
    """Refuses the request if its id means another adapter on `engine`, or if it is a new id and
    `client`'s host (or the engine) has bound its share; says whether the id is new there."""
    fields = _fields(lora_request) if lora_request is not None and engine is not None else None
    if fields is None:
        return False
    lora_id, path, name = fields
    for what, text, most in (("lora_name", name, MAX_NAME_CHARS), ("lora_path", path, MAX_PATH_CHARS)):
        if len(text) > most:
            raise BridgeError.validation(f"{label}: parameter {parameter}.{what}: at most {most:,} characters, got "
                                         f"{len(text):,}", target=label, parameter=f"{parameter}.{what}")
    if not 1 <= lora_id < 2**63:
        shown = lora_id if abs(lora_id) < 10**18 else f"an integer of {lora_id.bit_length()} bits"
        raise BridgeError.validation(f"{label}: parameter {parameter}.lora_int_id: expected an adapter's id, an "
                                     f"integer from 1 to 2**63 - 1, got {shown}", target=label,
                                     parameter=f"{parameter}.lora_int_id")
    bound = _engines.get(engine)
    known = bound.paths.get(lora_id) if bound is not None else None
    if known is not None:
        if known[0] != _real(path):
            raise BridgeError(grpc.StatusCode.ALREADY_EXISTS, "validation",
                              f"{label}: parameter {parameter}.lora_int_id: LoRA id {lora_id} is another "
                              f"adapter than {quote(path, 200)} on this engine (whose, this does not say): an id "
                              f"means one adapter for every client of the engine (use another id)",
                              target=label, parameter=f"{parameter}.lora_int_id", reason="lora id in use")
        if known[2] != name:
            raise _name_in_use(label, parameter, name, f"LoRA id {lora_id} is bound to another name on this "
                                                       f"engine (whose, this does not say)")
        return False
    other = bound.ids.get(name) if bound is not None else None
    if other is not None:
        raise _name_in_use(label, parameter, name, f"the name is bound to another LoRA id on this engine ({other})")
    held = bound.per_host.get(host_of(client), 0) if bound is not None else 0
    ids = len(bound.paths) if bound is not None else 0
    if held >= MAX_IDS_PER_HOST or ids >= MAX_IDS:
        whose = f"this client's host has bound {held:,} (at most {MAX_IDS_PER_HOST:,})" \
            if held >= MAX_IDS_PER_HOST else f"{ids:,} are bound (at most {MAX_IDS:,})"
        raise BridgeError(grpc.StatusCode.RESOURCE_EXHAUSTED, "validation",
                          f"{label}: parameter {parameter}.lora_int_id: a new LoRA id on this engine, and {whose}: "
                          f"use an id already bound to the adapter", target=label,
                          parameter=f"{parameter}.lora_int_id", reason="too many lora ids")
    return True


def _name_in_use(label: str, parameter: str, name: str, why: str) -> BridgeError:
    return BridgeError(grpc.StatusCode.ALREADY_EXISTS, "validation",
                       f"{label}: parameter {parameter}.lora_name: {quote(name, 200)}: {why}; vLLM tells adapters "
                       f"apart by name, so a name means one id for every client of the engine (use another name, "
                       f"or the id's own)", target=label, parameter=f"{parameter}.lora_name", reason="lora name in use")


def _bind(engine: Any, label: str, lora_request: Any, client: str, parameter: str) -> None:
    """Records the id's path once its adapter loaded; another request may have bound it meanwhile."""
    check(engine, label, lora_request, client, parameter)
    fields = _fields(lora_request)
    if fields is None or engine is None:
        return
    bound = _engines.get(engine)
    if bound is None:
        bound = _engines[engine] = _Bound()
    if fields[0] not in bound.paths:
        host = host_of(client)
        bound.paths[fields[0]] = (_real(fields[1]), host, fields[2])
        bound.ids[fields[2]] = fields[0]
        bound.per_host[host] = bound.per_host.get(host, 0) + 1


def _not_loaded(label: str, parameter: str, path: str, exc: Exception) -> BridgeError:
    said = str(exc)
    said = said[len(_VLLM_SAYS):] if said.startswith(_VLLM_SAYS) else said
    return BridgeError(grpc.StatusCode.INVALID_ARGUMENT, "validation",
                       f"{label}: parameter {parameter}.lora_path: vLLM could not load the adapter at "
                       f"{quote(path, 200)}: {clip(said, 400)}", target=label, parameter=f"{parameter}.lora_path",
                       reason="lora not loaded")


async def admit(engine: Any, label: str, lora_request: Any, client: str, parameter: str = "lora_request") -> None:
    """A request's adapter: checked, and loaded first if its id is new on the engine (see the doc)."""
    if check(engine, label, lora_request, client, parameter):
        await _load(engine, label, lora_request, client, parameter)


async def add(engine: Any, label: str, lora_request: Any, client: str) -> bool:
    """`add_lora` (checked by its guard): the id is bound once the adapter loaded."""
    if _fields(lora_request) is None:
        return bool(await engine.add_lora(lora_request))
    return await _load(engine, label, lora_request, client, "lora_request")


async def _load(engine: Any, label: str, lora_request: Any, client: str, parameter: str) -> bool:
    """Loads the adapter and binds its id to its path. vLLM keeps an id whose adapter it failed to
    activate (registered, then a tensor of the wrong shape): the next request under that id, with
    another path, was answered "already loaded" and ran the failed adapter's weights. So a failure
    removes the id again, and an id vLLM says is loaded that no path here is bound to is refused."""
    fields = _fields(lora_request)
    assert fields is not None
    lora_id, path, _ = fields
    try:
        added = bool(await engine.add_lora(lora_request))
    except Exception as exc:       # noqa: BLE001 - vLLM's failure to load, said as the client's
        await _unload_unbound(engine, lora_id)
        raise _not_loaded(label, parameter, path, exc) from None
    bound = _engines.get(engine)
    if not added and (bound is None or lora_id not in bound.paths):
        raise BridgeError(grpc.StatusCode.ALREADY_EXISTS, "validation",
                          f"{label}: parameter {parameter}.lora_int_id: LoRA id {lora_id} is loaded on this engine "
                          f"with an adapter this server did not load from {quote(path, 200)} (use another id)",
                          target=label, parameter=f"{parameter}.lora_int_id", reason="lora id in use")
    try:
        _bind(engine, label, lora_request, client, parameter)
    except BridgeError:      # bound meanwhile (its name, under another id): what this load added goes
        if added:
            await _unload_unbound(engine, lora_id)
        raise
    return added


async def _unload_unbound(engine: Any, lora_id: int) -> None:
    """Removes from the engine an id this server has not bound (what a failed load left there)."""
    bound = _engines.get(engine)
    if bound is None or lora_id not in bound.paths:
        try:
            await engine.remove_lora(lora_id)
        except Exception:      # noqa: BLE001 - nothing was left registered
            pass


def unbind(engine: Any, lora_id: object) -> None:
    """The id is free again (its adapter was removed from the engine)."""
    bound = _engines.get(engine)
    if bound is None or type(lora_id) is not int:
        return
    gone = bound.paths.pop(lora_id, None)
    if gone is not None:
        if bound.ids.get(gone[2]) == lora_id:
            del bound.ids[gone[2]]
        left = bound.per_host[gone[1]] - 1
        if left:
            bound.per_host[gone[1]] = left
        else:
            del bound.per_host[gone[1]]
