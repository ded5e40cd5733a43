"""`AsyncLLM` (exported as `vllm.AsyncLLMEngine`): engines held by the worker, driven by reference.

Engine methods are coroutines and async generators, so they run on the worker's event loop and many
requests share one engine, which is what lets vLLM batch them. What this adapter adds is what a
remote caller cannot do for itself:
- refuse calls that would kill the engine core (a pooling task the model lacks, token ids outside
  the model's vocabulary) or block the worker (completions by the million), and prompts that cannot
  fit the model, before they reach it (`engine_requests.py`), and what a request would cost the
  engine past its bounds (`request_costs.py`); build long and costly requests off the event loop
  (`request_building.py`), so one call's prompt never stalls the others;
- know when an engine can no longer serve (its core process exited, or it stops answering: its input
  thread dies on a request it cannot decode, its output path dies), and then fail its calls at once
  with the cause (`engine_life.py`: the worker probes every engine and replaces a published one);
- warm an engine up before anyone's first request pays for kernel compilation (`engine_life.py`);
- shut an engine down when its last ref goes away;
- keep a client's engines to what it may make them from: arguments, paths, sizes (`engine_making.py`).
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import hashlib
import logging
import math
import time
import weakref
from collections.abc import AsyncGenerator, Mapping
from typing import Any

import grpc

from adapters import engine_life, lora_ids, request_building, tokenizer_calls
from adapters.engine_life import PREFIX
from adapters.engine_making import creation_guard, engine_args_guard, engine_args_rule, lora_rule, made_by, new_engine
from adapters.engine_requests import (I64_MAX, I64_MIN, check_engine_types, check_prompt, check_prompt_form,
                                     check_request_options, check_sampling_params, check_token_ids, check_tokenization,
                                     clip_int, pooling_rule, sampling_rule, text_of)
from adapters.fair_share import admit_to_shared
from adapters.request_costs import (check_logprobs, check_request_items, check_step_cost, logprob_entries,
                                    prompt_tokens_at_most, request_items, step_cost_us)
from adapters.spec import (AdapterSpec, CallContext, Constructor, Exposure, Finalizer, Growing, Lifecycle, RecordRule,
                           RecordType)
from bridge_server.wire.errors import BridgeError, quote
from bridge_server.wire.options import connection_of

log = logging.getLogger("vllm_bridge.engine")


# ------------------------------------------------------------------------------------------ requests
# Who started each request id on an engine (vLLM lets several requests share an external id, and an
# abort ends all of them): a client aborts only its own. Ids of requests that ended are dropped when
# the table has grown past what the engine holds.
_owners: weakref.WeakKeyDictionary[Any, dict[str, set[str]]] = weakref.WeakKeyDictionary()


def _live_ids(engine: Any) -> Any:
    processor = getattr(engine, "output_processor", None)
    return getattr(processor, "external_req_ids", None)


def _owner(ctx: CallContext) -> str:
    """Whose a request is: its client's identity; where the server does not authenticate (every
    identity is ""), the connection it came over, so that one stranger cannot end another's
    requests by guessing their ids. (A client's Multiplex streams and calls share its connection.)"""
    return ctx.identity or connection_of(ctx.client)


def _own(engine: Any, request_id: Any, identity: str) -> None:
    if not isinstance(request_id, str):
        return
    try:
        owners = _owners.setdefault(engine, {})
    except TypeError:   # not weakly referenceable: nothing to track ownership on
        return
    live = _live_ids(engine)
    if live is not None and len(owners) > 2 * len(live) + 1024:
        for rid in [r for r in owners if r not in live]:
            del owners[rid]
    owners.setdefault(request_id, set()).add(identity)


def _request_guard(method: str, params_name: str) -> Any:
    """For each entry that starts a request (`generate`, `encode`, `add_request`): the engine is
    alive, the prompt within limits and able to fit, a pooling task one the engine supports (its
    core dies on another), the request id noted as the caller's, and on a published engine that
    schedules by priority, the request's priority set (`fair_share.py`)."""
    async def guard(engine: Any, args: Mapping[str, Any], ctx: CallContext) -> Mapping[str, int] | None:
        engine_life.alive(engine, args)
        await engine_life.serving(engine, method)
        params = args.get(params_name)
        label = f"{PREFIX}.{method}"
        check_tokenization(engine, label, args.get("tokenization_kwargs"))
        check_prompt(engine, label, args.get("prompt"), params, args.get("tokenization_kwargs"), ctx.policy)
        check_prompt_form(engine, label, args.get("prompt"))
        check_token_ids(engine, label, args.get("prompt"))
        check_request_options(engine, label, args)
        check_sampling_params(engine, label, params_name, params)
        check_engine_types(label, "lora_request", args.get("lora_request"))
        lora_ids.check(engine, label, args.get("lora_request"), ctx.client)
        _check_arrival(label, args.get("arrival_time"))
        priority = args.get("priority")
        if type(priority) is int and not I64_MIN <= priority <= I64_MAX:
            raise BridgeError.validation(f"{label}: parameter priority: {clip_int(priority)} does not fit in 64 bits",
                                         target=label, parameter="priority")
        if params is not None:
            await _check_task(engine, method, params_name, params)
        vocab, max_len = engine.model_config.get_vocab_size(), engine.model_config.max_model_len
        logprobs = logprob_entries(params, prompt_tokens_at_most(args.get("prompt"), max_len), vocab, max_len)
        check_logprobs(label, params_name, params, logprobs)
        step_us = step_cost_us(params)
        check_step_cost(label, params_name, params, step_us)
        items = request_items(params)
        check_request_items(label, params_name, params, items)
        await lora_ids.admit(engine, label, args.get("lora_request"), ctx.client)
        rank = admit_to_shared(engine, label, args, params, logprobs, ctx.client, _live_ids(engine),
                               ctx.policy.max_live_sequences, step_us, items) if ctx.published else None
        _own(engine, args.get("request_id"), _owner(ctx))
        request_building.asker.set((ctx.client, ctx.policy.grammar_compile_s))
        settings: dict[str, Any] = {} if rank is None else {"priority": rank}
        salted = _salted(args.get("prompt"), ctx.identity) if ctx.published and ctx.identity else None
        if salted is not None:
            settings["prompt"] = salted
        return settings or None
    return guard


def _salted(prompt: Any, identity: str) -> Any:
    """The prompt with its identity's salt for the prefix cache. A published engine's prefix cache is
    every client's: how many of a prompt's tokens came from the cache (`num_cached_tokens`) told one
    identity whether another had sent the same prefix (0 before, 128 after). vLLM keeps prompts of
    different salts apart; a client's own salt goes after ours. None: a prompt form without a salt."""
    ours = _salt_of(identity)
    if isinstance(prompt, str):
        return {"prompt": prompt, "cache_salt": ours}
    if isinstance(prompt, Mapping) and "encoder_prompt" not in prompt and "decoder_prompt" not in prompt:
        given = prompt.get("cache_salt")
        return {**prompt, "cache_salt": ours if given is None else f"{ours}:{given}"}
    return None


@functools.lru_cache(maxsize=1024)
def _salt_of(identity: str) -> str:
    return "bridge-" + hashlib.sha256(identity.encode()).hexdigest()[:32]


# How far a request's arrival_time may be from the worker's clock: vLLM measures the request's
# latencies from it, into the statistics every client's requests share (NaN, or 1e308, made them
# NaN or absurd).
ARRIVAL_PAST_S = 86_400.0
ARRIVAL_FUTURE_S = 60.0


def _check_arrival(label: str, arrival: Any) -> None:
    if not isinstance(arrival, (int, float)) or isinstance(arrival, bool):
        return
    now = time.time()
    if not (math.isfinite(arrival) and now - ARRIVAL_PAST_S <= arrival <= now + ARRIVAL_FUTURE_S):
        raise BridgeError.validation(f"{label}: parameter arrival_time: expected a time.time() within a day before "
                                     f"now and a minute after it, got {arrival!r}", target=label,
                                     parameter="arrival_time")


# Each engine's supported tasks, asked once: they are fixed when its core starts, and asking is a
# round trip to the core that every request would otherwise wait on.
_tasks: weakref.WeakKeyDictionary[Any, tuple[str, ...]] = weakref.WeakKeyDictionary()


async def _supported_tasks(engine: Any) -> tuple[str, ...]:
    tasks = _tasks.get(engine)
    if tasks is None:
        tasks = _tasks[engine] = tuple(await engine.get_supported_tasks())
    return tasks


async def _check_task(engine: Any, method: str, params_name: str, params: Any) -> None:
    """vLLM's engine core dies on a task the model does not support: a pooling task it lacks, or
    sampling on an engine that only pools (`runner: "pooling"`: an AssertionError in its model
    runner, the engine dead for good). So the request's task is checked before it is sent."""
    task = getattr(params, "task", None) if type(params).__name__ == "PoolingParams" else "generate"
    supported = await _supported_tasks(engine)
    if task is None or task not in supported:
        raise BridgeError(grpc.StatusCode.FAILED_PRECONDITION, "validation",
                          f"{PREFIX}.{method}: parameter {params_name}: task {task!r} is not supported by this "
                          f"engine; supported tasks: {', '.join(supported) or 'none'}",
                          target=f"{PREFIX}.{method}", parameter=params_name, reason="unsupported task")


def _abort_guard(engine: Any, args: Mapping[str, Any], ctx: CallContext) -> Mapping[str, Any] | None:
    """A client ends its own requests only. vLLM's internal ids are its own business. An id under
    which another client has a live request is left alone as an unknown id is, without a word, even
    where the caller used the id too (aborting it would end both): any refusal told a stranger which
    ids were live, and one that first started a request under its guess could still ask. A client
    whose own request shares an id with another's ends it by closing its stream."""
    engine_life.alive(engine, args)
    label = f"{PREFIX}.abort"
    if args.get("internal"):
        raise BridgeError(grpc.StatusCode.PERMISSION_DENIED, "validation",
                          f"{label}: parameter internal: vLLM's internal request ids are not a client's to abort; "
                          f"give the request ids the requests were started with", target=label,
                          parameter="internal", reason="not allowed")
    ids = args.get("request_id")
    listed = [ids] if isinstance(ids, str) else list(ids or ())
    for i, rid in enumerate(listed):
        if not isinstance(rid, str):    # vLLM compares them with its own ids: anything else aborts nothing
            where = "request_id" if rid is ids else f"request_id[{i}]"
            raise BridgeError.validation(f"{label}: parameter {where}: expected a request id (str), got "
                                         f"{type(rid).__name__} {quote(rid, 40)}", target=label, parameter=where)
    owners, live, owner = _owners.get(engine, {}), _live_ids(engine), _owner(ctx)
    kept = [rid for rid in listed if not owners.get(rid, set()) - {owner} or live is not None and rid not in live]
    return None if len(kept) == len(listed) else {"request_id": kept}


async def _generate(engine: Any, prompt: Any, sampling_params: Any, request_id: str,
                    **kwargs: Any) -> AsyncGenerator[Any, None]:
    """`generate`, with a long prompt tokenized off the event loop first. Returns vLLM's own
    generator (awaited once, then iterated as is: nothing of ours runs per token)."""
    prepared = await request_building.prepared(engine, prompt, sampling_params, request_id, kwargs, "generate")
    if prepared is not prompt:
        kwargs = {"prompt_text": text_of(prompt), "data_parallel_rank": kwargs.get("data_parallel_rank")}
    result: AsyncGenerator[Any, None] = engine.generate(prepared, sampling_params, request_id, **kwargs)
    return result


async def _encode(engine: Any, prompt: Any, pooling_params: Any, request_id: str, lora_request: Any = None,
                  trace_headers: Any = None, priority: int = 0, truncate_prompt_tokens: Any = None,
                  tokenization_kwargs: Any = None) -> AsyncGenerator[Any, None]:
    """`encode`, with the same care for long prompts as `generate` (the guard has run already)."""
    options = dict(lora_request=lora_request, trace_headers=trace_headers, priority=priority,
                   tokenization_kwargs=tokenization_kwargs)
    prepared = await request_building.prepared(engine, prompt, pooling_params, request_id, options, "encode")
    result: AsyncGenerator[Any, None] = engine.encode(prepared, pooling_params, request_id,
                                                      truncate_prompt_tokens=truncate_prompt_tokens, **options)
    return result


async def _add_request(engine: Any, request_id: str, prompt: Any, params: Any, arrival_time: float | None = None,
                       lora_request: Any = None, tokenization_kwargs: Any = None, trace_headers: Any = None,
                       priority: int = 0, data_parallel_rank: int | None = None, prompt_text: str | None = None) -> Any:
    """`add_request`, with the same care for long prompts as `generate` (vLLM's own tokenizes on
    the event loop)."""
    options = dict(arrival_time=arrival_time, lora_request=lora_request, tokenization_kwargs=tokenization_kwargs,
                   trace_headers=trace_headers, priority=priority, data_parallel_rank=data_parallel_rank)
    prepared = await request_building.prepared(engine, prompt, params, request_id, options, "add_request")
    if prepared is not prompt:
        collector = await engine.add_request(request_id, prepared, params, data_parallel_rank=data_parallel_rank,
                                             prompt_text=text_of(prompt))
    else:
        collector = await engine.add_request(request_id, prompt, params, prompt_text=prompt_text, **options)
    _collected[collector] = weakref.ref(engine)
    return collector


# The engine of each collector `add_request` handed out: when the collector's last ref goes, nobody
# can read its request any more, and the request ends (30 requests of n=256 whose refs were released
# kept an engine busy for 5 minutes, every other request waiting behind them).
_collected: weakref.WeakKeyDictionary[Any, weakref.ref[Any]] = weakref.WeakKeyDictionary()
_aborting: set[asyncio.Task[None]] = set()


def _abort_collected(collector: Any) -> None:
    """Last ref to a collector released: its request (and, for n > 1, its children) is aborted by the
    internal id vLLM gave it, which no other request shares."""
    engine_ref = _collected.pop(collector, None)
    engine = engine_ref() if engine_ref is not None else None
    request_id = getattr(collector, "request_id", None)
    if engine is None or not isinstance(request_id, str) or engine_life.dead(engine) is not None:
        return
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        return
    task = loop.create_task(engine.abort(request_id, internal=True))
    _aborting.add(task)
    task.add_done_callback(_aborted)


def _aborted(task: asyncio.Task[None]) -> None:
    _aborting.discard(task)
    if not task.cancelled() and task.exception() is not None:
        log.warning("%s: aborting a released request failed: %s", PREFIX, task.exception())


def _collective_rpc_guard(engine: Any, args: Mapping[str, Any], ctx: CallContext) -> None:
    """vLLM unpickles a `method` given as bytes inside its workers, and runs a callable: a client
    may only name a worker method the operator allowed."""
    engine_life.alive(engine, args)
    method, label = args.get("method"), f"{PREFIX}.collective_rpc"
    allowed = ctx.policy.collective_rpc_methods
    if not isinstance(method, str):
        raise BridgeError(grpc.StatusCode.PERMISSION_DENIED, "validation",
                          f"{label}: parameter method: expected the name of a worker method (a str), got "
                          f"{type(method).__name__}; nothing a client sends is unpickled or run",
                          target=label, parameter="method", reason="not allowed")
    if method not in allowed:
        raise BridgeError(grpc.StatusCode.PERMISSION_DENIED, "validation",
                          f"{label}: worker method {quote(method)} is not one this server allows; allowed: "
                          f"{', '.join(sorted(allowed)) or 'none'} (pool config key collective_rpc_methods)",
                          target=label, parameter="method", reason="not allowed")


def _lora_guard(method: str) -> Any:
    """LoRA methods on an engine made without LoRA fail inside its core with a bare `Exception`
    ("Call to add_lora method failed"), which says neither that the call can never work here nor why.
    An id added means its adapter for every client; one removed is free again (`lora_ids.py`)."""
    def guard(engine: Any, args: Mapping[str, Any], ctx: CallContext) -> None:
        engine_life.alive(engine, args)
        label = f"{PREFIX}.{method}"
        if getattr(getattr(engine, "vllm_config", None), "lora_config", ...) is None:
            raise BridgeError(grpc.StatusCode.FAILED_PRECONDITION, "engine",
                              f"{label}: LoRA is not enabled on this engine (it was made without the engine "
                              f"argument enable_lora)", target=label, reason="lora disabled")
        if method == "add_lora":
            lora_ids.check(engine, label, args.get("lora_request"), ctx.client)
            _lora_adder.set(ctx.client)
        if method in ("remove_lora", "pin_lora"):
            lora_id = args.get("lora_id")
            if type(lora_id) is not int or not 1 <= lora_id <= I64_MAX:
                shown = clip_int(lora_id) if type(lora_id) is int else type(lora_id).__name__
                raise BridgeError.validation(f"{label}: parameter lora_id: expected an adapter's id, an integer from "
                                             f"1 to 2**63 - 1, got {shown}", target=label, parameter="lora_id")
        if method == "remove_lora":
            lora_ids.unbind(engine, args.get("lora_id"))
    return guard


# Whose `add_lora` the call is, as its guard found it (the guard and the call run in one context).
_lora_adder: contextvars.ContextVar[str] = contextvars.ContextVar("lora_adder", default="")


async def _add_lora(engine: Any, lora_request: Any) -> bool:
    """`add_lora`: vLLM's failure to load is the client's path's, said by it; the id is bound to its
    adapter once loaded (`lora_ids.py`)."""
    return await lora_ids.add(engine, f"{PREFIX}.add_lora", lora_request, _lora_adder.get())


def _shutdown_guard(engine: Any, args: Mapping[str, Any], ctx: CallContext) -> None:
    """A published engine belongs to the server and serves every client: no client stops it."""
    if ctx.published:
        raise BridgeError(grpc.StatusCode.PERMISSION_DENIED, "validation",
                          f"{PREFIX}.shutdown: this engine is published by the server and shared by every client; "
                          f"only engines a client made itself can be shut down (or released)",
                          target=f"{PREFIX}.shutdown", reason="published")


def _drain_guard(engine: Any, args: Mapping[str, Any], ctx: CallContext) -> None:
    """vLLM's drain looks at the engine only while its timeout lasts: with 0 or less it raised its
    TimeoutError at once, idle or not, which read as the call's own deadline."""
    engine_life.alive(engine, args, ctx)
    timeout = args.get("drain_timeout")
    if type(timeout) is int and timeout < 1:
        label = f"{PREFIX}.wait_for_requests_to_drain"
        raise BridgeError.validation(f"{label}: parameter drain_timeout: expected 1 or more seconds (how long to "
                                     f"wait for the engine to go idle), got {clip_int(timeout)}", target=label,
                                     parameter="drain_timeout")


ASYNC_LLM = AdapterSpec(
    surface="async_llm",
    module="vllm",
    cls="AsyncLLMEngine",
    public_name=PREFIX,
    result_refs=frozenset({"new", "from_engine_args", "from_vllm_config"}),
    profiles={"new": "ml_inference", "from_engine_args": "ml_inference", "from_vllm_config": "ml_inference",
              "generate": "streaming", "encode": "streaming", "wait_for_requests_to_drain": "ml_inference",
              "add_lora": "ml_inference"},
    guards={"*": engine_life.alive, "generate": _request_guard("generate", "sampling_params"),
            "encode": _request_guard("encode", "pooling_params"), "add_request": _request_guard("add_request", "params"),
            "abort": _abort_guard, "collective_rpc": _collective_rpc_guard, "shutdown": _shutdown_guard,
            "wait_for_requests_to_drain": _drain_guard,
            "new": creation_guard, "from_engine_args": engine_args_guard, "from_vllm_config": creation_guard,
            **{m: _lora_guard(m) for m in ("add_lora", "list_loras", "pin_lora", "remove_lora")}},
    overrides={"new": new_engine, "from_engine_args": made_by("from_engine_args", "engine_args"),
               "from_vllm_config": made_by("from_vllm_config", "vllm_config"), "generate": _generate, "encode": _encode, "add_request": _add_request,
               "add_lora": _add_lora,
               "sleep": engine_life.sleep, "wake_up": engine_life.wake_up},
    # Requests of the caller's own, and reads. Not here (operators only, on a published engine):
    # pause/resume, sleep/wake_up, cache resets, pin/remove LoRA, profiling, scaling, collective_rpc,
    # shutdown, logging (do_log_stats, wait_for_requests_to_drain), and vLLM's private entries.
    per_client=frozenset({"generate", "encode", "add_request", "abort", "add_lora", "list_loras", "check_health",
                          "get_supported_tasks", "get_tokenizer", "is_paused", "is_sleeping", "is_tracing_enabled",
                          "from_engine_args", "from_vllm_config"}),
    finalizer=engine_life.shutdown,
    finalizers=(Finalizer("vllm.v1.engine.output_processor", "RequestOutputCollector", _abort_collected,
                          expires=True),),
    lifecycle=Lifecycle(dead=engine_life.dead, answers=engine_life.answers, kill=engine_life.kill,
                        warmup=engine_life.warmup, started=engine_life.started, busy=engine_life.busy,
                        stopped=engine_life.stopped),
    record_rules=(
        RecordRule("vllm", "AsyncEngineArgs", check=engine_args_rule),
        RecordRule("vllm.lora.request", "LoRARequest", check=lora_rule),
        RecordRule("vllm", "SamplingParams", check=sampling_rule),
        RecordRule("vllm", "PoolingParams", check=pooling_rule),
    ),
    exposures=(
        Exposure("transformers.tokenization_utils_base", "PreTrainedTokenizerBase", methods=frozenset({"encode", "decode"}),
                 attributes=frozenset({"eos_token_id", "bos_token_id", "pad_token_id", "vocab_size",
                                       "model_max_length"}),
                 overrides={"decode": tokenizer_calls.decode, "encode": tokenizer_calls.encode}),
    ),
    constructors=(
        Constructor("vllm.AsyncEngineArgs", "vllm", "AsyncEngineArgs"),
        Constructor("vllm.SamplingParams", "vllm", "SamplingParams"),
        Constructor("vllm.PoolingParams", "vllm", "PoolingParams"),
        Constructor("vllm.lora.request.LoRARequest", "vllm.lora.request", "LoRARequest"),
    ),
    records=(
        RecordType("vllm.outputs", "RequestOutput", (
            "request_id", "prompt", "prompt_token_ids", "prompt_logprobs", "outputs", "finished", "metrics",
            "lora_request", "encoder_prompt", "encoder_prompt_token_ids", "num_cached_tokens",
            "kv_transfer_params"),
            constant=("request_id", "prompt", "prompt_token_ids", "prompt_logprobs", "encoder_prompt",
                      "encoder_prompt_token_ids")),
        RecordType("vllm.outputs", "PoolingRequestOutput",
                   ("request_id", "outputs", "prompt_token_ids", "num_cached_tokens", "finished")),
        RecordType("vllm.outputs", "EmbeddingRequestOutput",
                   ("request_id", "outputs", "prompt_token_ids", "num_cached_tokens", "finished")),
    ),
    # A CUMULATIVE generation's output holds the detokenizer's token id list and the logprobs
    # processor's list (or its FlatLogprobs), the same objects from item to item, appended to.
    growing=(
        Growing("vllm.outputs", "CompletionOutput", ("token_ids", "logprobs")),
        Growing("vllm.logprobs", "FlatLogprobs",
                ("start_indices", "end_indices", "token_ids", "logprobs", "ranks", "decoded_tokens")),
    ),
)
