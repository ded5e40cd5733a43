"""Which requests the engine core ended for their grammar's cost (`adapters/grammar_ends.py`), on
vLLM's own front-end (its OutputProcessor, fed the outputs its engine core sends). The whole path, a
real engine core ending real sequences, is `tests/pool/test_security.py`'s."""

from __future__ import annotations

import copy
import gc
import time
from types import SimpleNamespace
from typing import Any

import pytest
from vllm import SamplingParams
from vllm.sampling_params import StructuredOutputsParams
from vllm.v1.engine import EngineCoreOutput, EngineCoreRequest, FinishReason
from vllm.v1.engine.output_processor import OutputProcessor, RequestOutputCollector
from vllm.v1.engine.parallel_sampling import ParentRequest

from adapters import grammar_check, grammar_ends
from adapters.engine_core import END_PREFIX


@pytest.fixture()
def ended(monkeypatch: pytest.MonkeyPatch) -> list[tuple[bytes, str, str]]:
    seen: list[tuple[bytes, str, str]] = []
    checks = grammar_check.GrammarChecks()
    monkeypatch.setattr(checks, "ended", lambda key, client, why: seen.append((key, client, why)) or True)
    monkeypatch.setattr(grammar_check, "_checks", checks)
    return seen


def request(rid: str, n: int = 1, grammar: bool = True) -> EngineCoreRequest:
    so = StructuredOutputsParams(regex="[a-z]+") if grammar else None
    params = SamplingParams(n=n, max_tokens=8, structured_outputs=so)
    return EngineCoreRequest(rid, [1, 2, 3], None, params, None, 2, time.time(), None, None, None,
                             external_req_id=rid.rsplit("-", 1)[0])


def add(processor: OutputProcessor, req: EngineCoreRequest) -> list[str]:
    """What AsyncLLM.add_request does with a checked request: one state, or one per child."""
    queue = RequestOutputCollector(req.sampling_params.output_kind, req.request_id)
    if req.sampling_params.n == 1:
        processor.add_request(req, None, None, 0, queue)
        return [req.request_id]
    parent, ids = ParentRequest(req), []
    for index in range(req.sampling_params.n):
        child_id, child_params = parent.get_child_info(index)
        child = req if index == req.sampling_params.n - 1 else copy.copy(req)
        child.request_id, child.sampling_params = child_id, child_params
        processor.add_request(child, None, parent, index, queue)
        ids.append(child_id)
    return ids


def end(rid: str, why: Any = None) -> EngineCoreOutput:
    reason = FinishReason.ABORT if isinstance(why, str) else FinishReason.LENGTH
    return EngineCoreOutput(rid, [7], finish_reason=reason, stop_reason=why)


def test_an_end_for_cost_counts_against_its_grammar_and_client_and_ends_the_clients_others(ended: list[Any]) -> None:
    processor = OutputProcessor(None, log_stats=False)
    engine = SimpleNamespace(output_processor=processor)
    costly, sibling, fine = request("costly-1a2b3c4d"), request("sibling-1a2b3c4d"), request("fine-5e6f7a8b")
    wide = request("wide-9c0d1e2f", n=3)
    for req, key, client in ((costly, b"k1", "ipv4:10.0.0.1:1"), (sibling, b"k5", "ipv4:10.0.0.1:2"),
                             (fine, b"k2", "ipv4:10.0.0.2:1"), (wide, b"k3", "alice")):
        grammar_ends.watch(engine, key, client, req)
    plain = request("plain-00000000", grammar=False)
    grammar_ends.watch(engine, b"k4", "ipv4:10.0.0.1:3", plain)       # no grammar: nothing to watch
    queues = {}
    ids = []
    for req in (costly, sibling, fine, wide, plain):
        for rid in add(processor, req):
            ids.append(rid)
            queues[rid] = processor.request_states[rid].queue
    assert len(ids) == 7
    costly_id, sibling_id, fine_id, wide_ids, plain_id = ids[0], ids[1], ids[2], ids[3:6], ids[6]
    why = f"{END_PREFIX}its structured output's grammar cost the engine 14.6 ms a token"
    processor.process_outputs([EngineCoreOutput(rid, [5]) for rid in ids])       # a step: nothing ends
    assert ended == []
    result = processor.process_outputs([end(costly_id, why), end(wide_ids[0], why), end(wide_ids[1], "a stop string")])
    assert ended == [(b"k1", "ipv4:10.0.0.1:1", why[len(END_PREFIX):]), (b"k3", "alice", why[len(END_PREFIX):])]
    # The struck clients' other structured requests end now, saying why; the core is told to drop them
    assert sorted(result.reqs_to_abort) == sorted([sibling_id, wide_ids[2]])
    for rid in (sibling_id, wide_ids[2]):
        assert rid not in processor.request_states
        last = queues[rid].get_nowait()
        stops = [(c.finish_reason, c.stop_reason) for c in last.outputs if c.finish_reason is not None]
        assert ("abort", grammar_ends.IN_FLIGHT_ENDED) in stops, stops
    assert set(processor.request_states) == {fine_id, plain_id}     # another host's, and a plain one, go on
    watch = grammar_ends._watches[processor]
    assert watch.pending == {} and set(watch.running) == {fine_id}
    processor.process_outputs([end(fine_id), end(plain_id)])
    assert len(ended) == 2 and watch.running == {}


def test_a_checked_request_that_never_reaches_the_engine_is_forgotten(ended: list[Any]) -> None:
    processor = OutputProcessor(None, log_stats=False)
    engine = SimpleNamespace(output_processor=processor)
    for i in range(100):     # calls cancelled between the check and the engine
        grammar_ends.watch(engine, b"k", "c", request(f"gone{i}-00000000"))
    gc.collect()
    assert grammar_ends._watches[processor].pending == {}
