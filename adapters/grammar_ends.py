"""Which of an engine's requests run under which client's grammar, so that a sequence the engine core
ends for its grammar's cost (`engine_core.py`) counts against that grammar and that client
(`GrammarChecks.ended`, in `grammar_check.py`).

Why here: the core ends such a sequence as an abort whose stop reason begins with `END_PREFIX`, and
only vLLM's front-end in the worker (its OutputProcessor) sees the core's outputs. The request the
worker checked is not yet the one the front-end tracks: vLLM gives it an internal id when it is
added, and splits one of `n > 1` into children, each with its own id. Each child shares the checked
request's `structured_outputs` object, so the front-end's `add_request` is watched for it and the
child's id is noted then; `process_outputs` looks at the core's outputs only while such ids are
noted, so requests without a grammar pay nothing per token.

When an end starts a client's cooldown, its other structured requests in the engine end with it
(finish reason `abort`, a stop reason saying why): they were admitted before the cooldown, and a
client holding many at once (16 connections) had each of them make its own costly step.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from adapters import grammar_check
from adapters.engine_core import END_PREFIX
from bridge_server.wire.protocol import host_of

__all__ = ["IN_FLIGHT_ENDED", "watch"]

# The stop reason of a request ended because another of its client's was ended for its grammar's cost.
IN_FLIGHT_ENDED = ("vllm-bridge: another sequence of this client's was ended for its grammar's cost, and its "
                   "structured requests then in the engine end with it (requests without one go on)")


@dataclass
class _Watch:
    """One engine front-end's requests under a checked grammar."""

    # id of a checked request's structured_outputs -> (a weak ref to it, grammar key, client); an entry
    # goes when its request reaches the front-end, or when the object goes (a call ended on the way)
    pending: dict[int, tuple[weakref.ref[Any], bytes, str]] = field(default_factory=dict)
    # vLLM's id of each (child) request the front-end tracks -> (grammar key, client)
    running: dict[str, tuple[bytes, str]] = field(default_factory=dict)


_watches: weakref.WeakKeyDictionary[Any, _Watch] = weakref.WeakKeyDictionary()


def watch(engine: Any, key: bytes, client: str, request: Any) -> None:
    """Notes that `request` (the EngineCoreRequest the worker checked, about to be added) runs under
    grammar `key` for `client`."""
    processor = getattr(engine, "output_processor", None)
    so = getattr(getattr(request, "sampling_params", None), "structured_outputs", None)
    if processor is None or so is None:
        return
    w = _watches.get(processor)
    if w is None:
        try:
            w = _watches[processor] = _Watch()
        except TypeError:       # not weakly referenceable: nothing to watch on
            return
        processor.add_request = _noting(w, processor.add_request)
        processor.process_outputs = _seeing_ends(w, weakref.ref(processor), processor.process_outputs)
    pending = w.pending
    at = id(so)
    try:
        ref = weakref.ref(so, lambda _: pending.pop(at, None))
    except TypeError:
        return
    pending[at] = (ref, key, client)


def _noting(w: _Watch, add_request: Callable[..., None]) -> Callable[..., None]:
    """The front-end's `add_request`, which notes the id of each (child) request of a checked one."""
    @functools.wraps(add_request)
    def add_and_note(request: Any, prompt: Any, parent_req: Any = None, request_index: int = 0,
                     queue: Any = None) -> None:
        add_request(request, prompt, parent_req, request_index, queue)
        if w.pending:
            so = getattr(getattr(request, "sampling_params", None), "structured_outputs", None)
            entry = w.pending.get(id(so)) if so is not None else None
            if entry is not None and entry[0]() is so:
                w.running[request.request_id] = (entry[1], entry[2])
                if parent_req is None or request_index >= parent_req.n - 1:     # the last child: no more
                    del w.pending[id(so)]
    return add_and_note


def _seeing_ends(w: _Watch, processor_ref: weakref.ref[Any], process_outputs: Callable[..., Any]) -> Callable[..., Any]:
    """The front-end's `process_outputs`, which first looks for the ends of watched requests, and
    after it ends the other requests of a client that has just begun a cooldown."""
    @functools.wraps(process_outputs)
    def see_ends_then_process(engine_core_outputs: Any, *args: Any, **kwargs: Any) -> Any:
        running = w.running
        struck: set[str] = set()
        if running:
            processor = processor_ref()
            states = processor.request_states if processor is not None else {}
            for out in engine_core_outputs:
                if out.finish_reason is None:
                    continue
                entry = running.pop(out.request_id, None)
                stop = out.stop_reason
                if entry is not None and isinstance(stop, str) and stop.startswith(END_PREFIX):
                    if grammar_check.checks().ended(entry[0], entry[1], stop[len(END_PREFIX):]):
                        struck.add(host_of(entry[1]))
            if len(running) > 2 * len(states) + 1024:    # requests aborted by the front-end end unseen
                for gone in [rid for rid in running if rid not in states]:
                    del running[gone]
        result = process_outputs(engine_core_outputs, *args, **kwargs)
        if struck:
            _end_in_flight(w, processor_ref(), struck, result)
        return result
    return see_ends_then_process


def _end_in_flight(w: _Watch, processor: Any, hosts: set[str], result: Any) -> None:
    """Ends the watched requests of `hosts` still in the engine, as vLLM's own abort does (a final
    output to each reader; the core told through the step's `reqs_to_abort`)."""
    ids = [rid for rid, (_, client) in w.running.items() if host_of(client) in hosts]
    for rid in ids:
        del w.running[rid]
    if processor is None or not ids:
        return
    queues = {id(q): q for rid in ids if (q := getattr(processor.request_states.get(rid), "queue", None))}
    result.reqs_to_abort.extend(processor.abort_requests(ids, internal=True))
    for queue in queues.values():
        output = getattr(queue, "output", None)
        for completion in getattr(output, "outputs", None) or ():
            if getattr(completion, "finish_reason", None) == "abort" and completion.stop_reason is None:
                completion.stop_reason = IN_FLIGHT_ENDED
