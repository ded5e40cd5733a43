"""The worker's trial compiles of structured outputs (`adapters/grammar_check.py`): a real child
process compiling with vLLM's own xgrammar backend for the tiny model, killed for real."""

from __future__ import annotations

import asyncio
import functools
import hashlib
import pickle
import random
import time
from collections.abc import Iterator
from typing import Any

import grpc
import numpy as np
import psutil
import pytest

from adapters import grammar_check
from adapters.grammar_check import GrammarChecks
from bridge_server.tools.tiny_model import ensure_tiny_model

# xgrammar's automaton for this regex doubles with each repeat: ~0.5 s at 12 on the tiny model's
# vocabulary, ~10 s at 14, hours at 20.
SLOW = "[ab]*a[ab]{20}"
# Compiles in milliseconds; its matcher's work per token grows with every token (~30 ms after 200).
AMBIGUOUS = 'root ::= e\ne ::= e e | "a" | "b"'


@pytest.fixture(scope="module")
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


@pytest.fixture(scope="module")
def config() -> tuple[str, bytes]:
    from vllm.engine.arg_utils import AsyncEngineArgs
    blob = pickle.dumps(AsyncEngineArgs(model=str(ensure_tiny_model())).create_engine_config())
    return hashlib.sha256(blob).hexdigest()[:16], blob


@pytest.fixture(scope="module")
def checks(loop: asyncio.AbstractEventLoop) -> Iterator[GrammarChecks]:
    c = GrammarChecks()
    yield c
    loop.run_until_complete(c.close())


def check(loop: asyncio.AbstractEventLoop, checks: GrammarChecks, config: tuple[str, bytes], kind: str, spec: str,
          client: str = "a", deadline_s: float = 2.0) -> Any:
    return loop.run_until_complete(checks.check(*config, "xgrammar", kind, spec, client, deadline_s))


def test_a_grammar_past_its_deadline_is_refused_and_its_compile_killed(
        loop: asyncio.AbstractEventLoop, checks: GrammarChecks, config: tuple[str, bytes]) -> None:
    assert check(loop, checks, config, "REGEX", "[0-9]{3}") is None
    compiling = checks.child_pid
    assert compiling is not None and psutil.pid_exists(compiling)
    refusal = check(loop, checks, config, "REGEX", SLOW, deadline_s=1.0)
    assert refusal.code == grpc.StatusCode.RESOURCE_EXHAUSTED and refusal.reason == "grammar too costly", refusal
    assert "did not compile and generate 512 tokens within 1 s" in refusal.why, refusal
    assert not psutil.pid_exists(compiling), "the compile was left running"
    spare = loop.run_until_complete(checks.spare_pid())      # started as the first was killed
    assert spare is not None and spare != compiling
    ran = checks.compiled
    assert check(loop, checks, config, "REGEX", SLOW, deadline_s=1.0) == refusal     # remembered: not compiled again
    assert checks.compiled == ran
    # The spare takes the next grammar (another spare starts behind it); what passed before is not tried again.
    assert check(loop, checks, config, "JSON", '{"type": "object", "properties": {"n": {"type": "integer"}}}') is None
    assert checks.child_pid == spare and loop.run_until_complete(checks.spare_pid()) not in (None, spare)
    assert check(loop, checks, config, "REGEX", "[0-9]{3}") is None and checks.compiled == ran + 1


def test_a_grammar_the_backend_cannot_compile_is_refused_and_the_child_goes_on(
        loop: asyncio.AbstractEventLoop, checks: GrammarChecks, config: tuple[str, bytes]) -> None:
    assert check(loop, checks, config, "REGEX", "[a-z]{2}") is None
    child = checks.child_pid
    refusal = check(loop, checks, config, "GRAMMAR", "root ::= (")
    assert refusal.code == grpc.StatusCode.INVALID_ARGUMENT and refusal.reason == "grammar does not compile", refusal
    assert "xgrammar backend cannot compile it" in refusal.why and "EBNF" in refusal.why, refusal
    assert checks.child_pid == child


def test_a_grammar_that_takes_too_much_memory_is_refused(
        loop: asyncio.AbstractEventLoop, checks: GrammarChecks, config: tuple[str, bytes]) -> None:
    """24 characters of nested repeats: 3.4 s and ~600 MB to compile, in the engine core as here."""
    assert check(loop, checks, config, "REGEX", "[0-9]{2}") is None
    refusal = check(loop, checks, config, "REGEX", "((c{1000}){1000}){1000}", deadline_s=60.0)
    assert refusal.code == grpc.StatusCode.RESOURCE_EXHAUSTED and refusal.reason == "grammar too costly", refusal
    assert "over this server's limit of 256 MiB" in refusal.why, refusal
    assert checks.child_pid is None


def test_a_grammar_whose_every_token_costs_more_and_more_is_refused(
        loop: asyncio.AbstractEventLoop, checks: GrammarChecks, config: tuple[str, bytes]) -> None:
    """An ambiguous grammar compiles at once, but the engine core works out each token's mask on the
    thread every request waits on, and that work grows with every token: the trial generates under it."""
    refusal = check(loop, checks, config, "GRAMMAR", AMBIGUOUS, deadline_s=60.0)
    assert refusal.code == grpc.StatusCode.RESOURCE_EXHAUSTED and refusal.reason == "grammar too costly", refusal
    assert "ms a token" in refusal.why and "over this server's limit of 2 ms" in refusal.why, refusal
    # The same shape without the ambiguity generates its 512 tokens at a few microseconds each.
    assert check(loop, checks, config, "GRAMMAR", 'root ::= e\ne ::= [ab] e | [ab]', deadline_s=60.0) is None


def test_clients_take_turns_and_one_grammar_is_compiled_once(
        loop: asyncio.AbstractEventLoop, checks: GrammarChecks, config: tuple[str, bytes]) -> None:
    """A client with a queue of slow grammars delays another client's new grammar by one compile,
    not by its whole queue; several requests with one new grammar wait for one compile."""
    order: list[str] = []

    async def one(client: str, spec: str, deadline_s: float) -> Any:
        outcome = await checks.check(*config, "xgrammar", "REGEX", spec, client, deadline_s)
        order.append(spec)
        return outcome

    async def scene() -> list[Any]:
        ran = checks.compiled
        slow = [one("stranger", f"[ab]*a[ab]{{{n}}}", 1.0) for n in (21, 22, 23)]
        waiting = asyncio.gather(*slow)
        await asyncio.sleep(0)
        same = [one(f"user-{i}", "ok[0-9]{4}", 10.0) for i in range(3)]
        outcomes = await asyncio.gather(waiting, *same)
        assert checks.compiled == ran + 4, "the users' one grammar was compiled more than once"
        return outcomes

    slow, *fast = loop.run_until_complete(scene())
    assert fast == [None, None, None]
    assert [r.reason for r in slow] == ["grammar too costly"] * 3
    assert order.index("ok[0-9]{4}") < order.index("[ab]*a[ab]{22}"), order


def test_the_engine_core_ends_a_request_whose_grammar_grows_too_costly(config: tuple[str, bytes]) -> None:
    """A trial follows one path through a grammar; the engine core times every grammar it runs
    (`adapters/engine_core.py`, loaded in the core): vLLM's own request, grammar and stop check."""
    from vllm.sampling_params import SamplingParams, StructuredOutputsParams
    from vllm.v1.core.sched.utils import check_stop
    from vllm.v1.request import Request, RequestStatus
    from vllm.v1.structured_output.backend_types import StructuredOutputOptions

    from adapters.engine_core import GRAMMAR_STEP_S, grammar_cost, stop_bounded, timed_grammar
    from adapters.grammar_check import _backend

    backend, vocab_size, stop_ids = _backend(pickle.loads(config[1]), "xgrammar")
    stop = stop_bounded(check_stop)

    def generate(grammar_text: str) -> Request:
        params = SamplingParams(max_tokens=400, min_tokens=400,
                                structured_outputs=StructuredOutputsParams(grammar=grammar_text))
        request = Request("r", [1, 2, 3], params, None, eos_token_id=min(stop_ids))
        grammar = backend.compile_grammar(StructuredOutputOptions.GRAMMAR, grammar_text)
        assert request.structured_output_request is not None
        request.structured_output_request.grammar = grammar
        fill, accept = timed_grammar(type(grammar).fill_bitmask), timed_grammar(type(grammar).accept_tokens)
        mask = backend.allocate_token_bitmask(1)
        pick = random.Random(0)
        while True:
            fill(grammar, mask, 0)
            allowed = [int(t) for t in np.flatnonzero(np.unpackbits(mask.numpy().view(np.uint8),
                                                                   bitorder="little")[:vocab_size])]
            token = pick.choice([t for t in allowed if t not in stop_ids] or allowed)
            request.append_output_token_ids(token)
            if stop(request, 2048):
                return request
            accept(grammar, "r", [token])

    # Judged from its first token: a grammar costly from there went unjudged for 8 tokens, and 16
    # sequences of 7 tokens made every step ~4 s. Counted in the thread's CPU time: a stall waiting
    # for a core (a wall-clock ~50 ms had ended a 3-token `[0-9]{3}`) is not the grammar's.
    first = backend.compile_grammar(StructuredOutputOptions.GRAMMAR, AMBIGUOUS)
    stalled = timed_grammar(lambda grammar, *args: time.sleep(0.05) or type(first).fill_bitmask(grammar, *args))
    stalled(first, backend.allocate_token_bitmask(1), 0)
    assert 0 < grammar_cost(first) == 2 * first.__dict__["_bridge_costs"][0] < GRAMMAR_STEP_S
    costly = generate(AMBIGUOUS)
    assert costly.status == RequestStatus.FINISHED_ABORTED and costly.num_output_tokens < 400, costly.status
    assert isinstance(costly.stop_reason, str) and f"over the limit of {GRAMMAR_STEP_S * 1000:g} ms" in \
        costly.stop_reason, costly.stop_reason
    plain = generate('root ::= e\ne ::= [ab] e | [ab]')
    assert plain.status == RequestStatus.FINISHED_LENGTH_CAPPED and plain.num_output_tokens == 400


def test_a_hosts_many_connections_take_one_turn(loop: asyncio.AbstractEventLoop, checks: GrammarChecks,
                                                config: tuple[str, bytes]) -> None:
    """A stranger's slow grammars from three connections of one address delay another host's new
    grammar by one trial, not three."""
    order: list[str] = []

    async def one(client: str, spec: str) -> Any:
        outcome = await checks.check(*config, "xgrammar", "REGEX", spec, client, 1.0)
        order.append(client)
        return outcome

    async def scene() -> list[Any]:
        strangers = [one(f"ipv4:10.0.0.1:{port}", f"[ab]*a[ab]{{{n}}}") for port, n in ((4001, 24), (4002, 25),
                                                                                    (4003, 26))]
        waiting = asyncio.gather(*strangers)
        await asyncio.sleep(0)
        return [await asyncio.gather(waiting, one("ipv4:10.0.0.2:5000", "host[0-9]{2}"))]

    loop.run_until_complete(scene())
    assert order.index("ipv4:10.0.0.2:5000") == 1, order


def test_what_the_engine_ended_is_refused_and_its_client_cools_down(
        loop: asyncio.AbstractEventLoop, config: tuple[str, bytes], monkeypatch: pytest.MonkeyPatch) -> None:
    """A grammar can pass its trial and still cost the engine core too much where a client steers it;
    the core then ends its sequences, after a step every request waited on. A repeat must cost
    nothing: for a while every structured output of that client's host is refused (a client could
    otherwise spend grammars accepted beforehand one by one), twice as long after each more end, and
    the grammar stays refused to it. Ends of requests admitted before the cooldown began do not
    count again. Another host may still use the grammar until it was ended for two hosts: one noisy
    step must not take an ordinary grammar from everyone."""
    monkeypatch.setattr(grammar_check, "COOLDOWN_S", 0.4)
    checks = GrammarChecks()
    key = functools.partial(grammar_check.grammar_key, config[0], "xgrammar", "REGEX")
    try:
        stranger, neighbour, other, third = ("ipv4:10.0.0.1:4001", "ipv4:10.0.0.1:4002", "ipv4:10.0.0.2:5000",
                                             "ipv4:10.0.0.3:6000")
        steered, known = "x[a-z]{0,40}", "[0-9]{4}"
        for spec in (steered, known, "[a-z]{8}"):
            assert check(loop, checks, config, "REGEX", spec, stranger) is None
        checks.ended(key(steered), stranger, "cost 15 ms a token")
        checks.ended(key(steered), neighbour, "cost 16 ms a token")     # admitted before: no second strike
        for client, spec in ((stranger, known), (neighbour, "[0-9]{5}"), (neighbour, steered)):
            refusal = check(loop, checks, config, "REGEX", spec, client)
            assert refusal.code == grpc.StatusCode.RESOURCE_EXHAUSTED and refusal.reason == "grammars ended for cost", \
                refusal
            assert "1 time(s)" in refusal.why and "requests without one are served" in refusal.why, refusal.why
        assert check(loop, checks, config, "REGEX", steered, other) is None     # ended for one host only
        loop.run_until_complete(asyncio.sleep(0.45))
        assert check(loop, checks, config, "REGEX", known, stranger) is None
        refusal = check(loop, checks, config, "REGEX", steered, stranger, deadline_s=0)
        assert refusal.reason == "grammar too costly" and "this client's sequences" in refusal.why, refusal
        checks.ended(key(steered), other, "cost 11 ms a token")                 # a second host: for everyone now
        refusal = check(loop, checks, config, "REGEX", steered, third)
        assert refusal.reason == "grammar too costly" and "2 clients'" in refusal.why, refusal
        # A second end of the first host's, after its cooldown: twice as long (0.8 s)
        checks.ended(key(known), neighbour, "cost 12 ms")
        loop.run_until_complete(asyncio.sleep(0.45))
        refusal = check(loop, checks, config, "REGEX", "[a-z]{8}", stranger, deadline_s=0)
        assert refusal.reason == "grammars ended for cost" and "2 time(s)" in refusal.why, refusal
        loop.run_until_complete(asyncio.sleep(0.45))
        assert check(loop, checks, config, "REGEX", "[a-z]{8}", stranger) is None
        assert check(loop, checks, config, "REGEX", known, other) is None
    finally:
        loop.run_until_complete(checks.close())
