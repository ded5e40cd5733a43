"""What each client has running or waiting on a shared engine (one the worker publishes, which
every client shares), by host: the bounds a host and a client live within there, and, on an engine
that schedules by priority, each request's priority. The engine adapter asks for every request it
starts there.

- Priority. On one that schedules by priority, a request's priority is the server's: the sequences
  its client has there, this request's included, plus a sixteenth of the rest of its host's. vLLM
  takes the lowest first, so a light client goes ahead of a heavy one's queue: four requests of
  n=256 from one stranger, taken in order of arrival, kept everyone else's waiting 24 s behind
  1,024 sequences. The host's part is there because a client is a connection when there is no
  identity, and a stranger opens thousands (2,500 requests of one sequence, each on a connection of
  its own, ranked like a bystander's and went ahead of it); a bystander on the stranger's own host
  cannot be told from the stranger's connections, one on another host can. A client's own priority,
  or an arrival_time (vLLM's tie-break), is refused there: the server ranks.
- Bounds, whatever the engine schedules by, in shares as the pool's queue keeps them, for the
  whole engine, of which a host takes at most three quarters of what the other hosts left, and a
  client the same of its host's (one connection filling its host's bound shut out a bystander on the
  same address): the live sequences (each holds memory in the engine core and the worker until it
  ends: 400 queued requests of n=256 took 416 MB of the core; a bound per host alone left the
  engine to as many hosts as a stranger has, and an IPv6 stranger has thousands of /64s); and the
  logprobs live requests may produce (made on the worker's loop: eight requests at the one-request
  bound held it 10 s); and what live requests add to every step of the engine core
  (`request_costs.step_cost_us`: each within its own bound, a few of them would still slow every
  request of the engine by as many times), and the items of their params the engine core holds, a
  copy per completion (`request_costs.request_items`).
"""

from __future__ import annotations

import operator
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import grpc

from adapters.engine_requests import clip_int
from adapters.request_costs import MAX_LOGPROB_ENTRIES, MAX_REQUEST_ITEMS, MAX_STEP_US
from bridge_server.wire.errors import BridgeError, quote
from bridge_server.wire.protocol import host_of

__all__ = ["HOST_PART", "MAX_ENGINE_ITEMS", "MAX_ENGINE_LOGPROB_ENTRIES", "MAX_ENGINE_STEP_US", "SHARE",
           "admit_to_shared"]

MAX_ENGINE_LOGPROB_ENTRIES = 2 * MAX_LOGPROB_ENTRIES
MAX_ENGINE_STEP_US = 2 * MAX_STEP_US
MAX_ENGINE_ITEMS = 2 * MAX_REQUEST_ITEMS
SHARE = 0.75            # of what the others left, a host's (or a host's client's) most
HOST_PART = 16          # a client's rank counts 1/HOST_PART of its host's other sequences
MAX_HOSTS_KEPT = 1024   # past this many hosts, those with nothing live are forgotten


@dataclass
class _Live:
    """A request a client started on a published engine, while vLLM holds it."""
    client: str
    request_id: str
    sequences: int
    logprobs: int
    step_us: float = 0.0
    items: int = 0


_ledger: weakref.WeakKeyDictionary[Any, dict[str, list[_Live]]] = weakref.WeakKeyDictionary()   # engine -> host
# engine -> its live requests that may produce logprobs or add to every step, whatever their host
# (few: most ask for neither)
_costly: weakref.WeakKeyDictionary[Any, list[tuple[str, _Live]]] = weakref.WeakKeyDictionary()


@dataclass(frozen=True)
class _Bound:
    """One engine-wide bound on what live requests cost together: the `_Live` field it sums, its limit,
    and how a refusal says it."""
    field: str
    limit: float
    doing: str           # what the live requests do with their amount
    unit: str
    reason: str


_LOGPROBS = _Bound("logprobs", MAX_ENGINE_LOGPROB_ENTRIES, "may produce", "logprobs", "too many logprobs")
_STEP = _Bound("step_us", MAX_ENGINE_STEP_US, "add to every step of its engine core", "µs",
               "too costly per step")
_ITEMS = _Bound("items", MAX_ENGINE_ITEMS, "have the engine core hold, a copy per completion,", "param items",
                "too many items")


def _room_for(bound: _Bound, engine: Any, label: str, host: str, client: str, amount: float, live: Any) -> None:
    """Refuses a request whose `amount` would pass its host's share of the engine's bound, or its
    client's share of its host's (three quarters of what the others leave, at each level)."""
    listed = [(h, r) for h, r in _costly.get(engine, ()) if live is None or r.request_id in live]
    _costly[engine] = listed
    of = operator.attrgetter(bound.field)
    everyone = sum(of(r) for _, r in listed)
    on_host = sum(of(r) for h, r in listed if h == host)
    own = sum(of(r) for h, r in listed if h == host and r.client == client)
    host_room = SHARE * (bound.limit - (everyone - on_host))
    if amount > SHARE * (host_room - (on_host - own)) - own:
        raise BridgeError(grpc.StatusCode.RESOURCE_EXHAUSTED, "validation",
                          f"{label}: this engine is shared, and its live requests {bound.doing} {everyone:,.0f} "
                          f"{bound.unit} ({on_host:,.0f} of them this host's, {own:,.0f} this client's); {amount:,.0f} "
                          f"more would pass this client's share of the limit of {bound.limit:,.0f} {bound.unit} for "
                          f"the engine: wait for some to end", target=label, reason=bound.reason)


def _fair_share(engine: Any) -> bool:
    config = getattr(getattr(engine, "vllm_config", None), "scheduler_config", None)
    return getattr(config, "policy", None) == "priority"


def _live_sequences(engine: Any, hosts: dict[str, list[_Live]], live: Any) -> int:
    """The sequences the engine holds, every client's: vLLM's own count (a request of n > 1 is n
    there), else the ledger's."""
    states = getattr(getattr(engine, "output_processor", None), "request_states", None)
    if isinstance(states, dict):
        return len(states)
    return sum(r.sequences for rs in hosts.values() for r in rs if live is None or r.request_id in live)


def admit_to_shared(engine: Any, label: str, args: Mapping[str, Any], params: Any, logprobs: int, client: str,
                    live: Any, max_sequences: int, step_us: float = 0.0, items: int = 0) -> int | None:
    """Notes the request against the engine's bounds and its host's and client's shares (refusing it
    past them) and, on an engine that schedules by priority, returns its priority (None: vLLM's own
    order). `live`: the external ids of the requests vLLM holds (None: unknown, every noted request
    counts); `max_sequences`: the engine's bound on live sequences (0: none); `step_us`: what the
    request adds to every step of the engine core; `items`: its params' items the core holds."""
    fair = _fair_share(engine)
    if fair:
        for key, default in (("priority", 0), ("arrival_time", None)):
            asked = args.get(key, default)
            if asked != default:
                raise BridgeError.validation(
                    f"{label}: parameter {key}: this engine is shared, and the server ranks its requests by the "
                    f"sequences each client runs there (fair share); expected {default}, got "
                    f"{clip_int(asked) if type(asked) is int else quote(asked)}", target=label, parameter=key)
    hosts = _ledger.setdefault(engine, {})
    host = host_of(client)
    held = [r for r in hosts.get(host, ()) if live is None or r.request_id in live]
    n = getattr(params, "n", 1)
    n = n if type(n) is int and n > 0 else 1
    sequences = sum(r.sequences for r in held)
    own = sum(r.sequences for r in held if r.client == client)
    if max_sequences > 0:
        everyone = max(_live_sequences(engine, hosts, live), sequences)
        host_room = SHARE * (max_sequences - (everyone - sequences))
        if n > int(SHARE * (host_room - (sequences - own))) - own:
            raise BridgeError(grpc.StatusCode.RESOURCE_EXHAUSTED, "validation",
                              f"{label}: this engine is shared; this client holds {own:,} sequences there, its host "
                              f"{sequences:,} and the engine {everyone:,} in all, and {n:,} more would pass this "
                              f"client's share of the engine's limit of {max_sequences:,} live sequences "
                              f"(max_live_sequences: a host takes three quarters of what the other hosts leave, a "
                              f"client three quarters of what its host's others leave): wait for some to end",
                              target=label, reason="too many sequences")
    if logprobs:
        _room_for(_LOGPROBS, engine, label, host, client, logprobs, live)
    if step_us:
        _room_for(_STEP, engine, label, host, client, step_us, live)
    if items:
        _room_for(_ITEMS, engine, label, host, client, items, live)
    live_request = _Live(client, args["request_id"], n, logprobs, step_us, items) \
        if isinstance(args.get("request_id"), str) else None
    if live_request is not None:
        held.append(live_request)
        if logprobs or step_us or items:
            _costly.setdefault(engine, []).append((host, live_request))
    hosts[host] = held
    if len(hosts) > MAX_HOSTS_KEPT:
        for gone in [h for h, rs in hosts.items() if not any(live is None or r.request_id in live for r in rs)]:
            del hosts[gone]
    return own + n + (sequences - own) // HOST_PART if fair else None
