"""`AsyncLLM` (exported as `vllm.AsyncLLMEngine`): engines held by the worker, driven by reference.

Engine methods are coroutines and async generators, so they run on the worker's event loop and many
requests share one engine, which is what lets vLLM batch them. What this adapter adds is what a
remote caller cannot do for itself: refuse calls that would kill the engine core, fail fast on an
engine that is already dead, and shut an engine down when its last ref goes away.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from typing import Any

import grpc

from adapters.spec import AdapterSpec, Constructor, RecordType
from bridge_server.wire.errors import BridgeError

log = logging.getLogger("vllm_bridge.engine")
PREFIX = "vllm.AsyncLLMEngine"


def _alive(engine: Any, args: Mapping[str, Any]) -> None:
    """Every call on a dead engine fails at once with the reason, instead of vLLM's own error later."""
    if engine is not None and getattr(engine, "errored", False):
        raise BridgeError(grpc.StatusCode.UNAVAILABLE, "engine",
                          f"{PREFIX}: engine dead: {getattr(engine, 'dead_error', 'the engine core exited')}",
                          target=PREFIX, reason="engine dead")


async def _encode_guard(engine: Any, args: Mapping[str, Any]) -> None:
    """vLLM's engine core dies on a pooling task the model does not support: check before sending."""
    _alive(engine, args)
    params = args.get("pooling_params")
    task = getattr(params, "task", None)
    supported = tuple(await engine.get_supported_tasks())
    if task is None or task not in supported:
        raise BridgeError(grpc.StatusCode.FAILED_PRECONDITION, "validation",
                          f"{PREFIX}.encode: parameter pooling_params: task {task!r} is not supported by this "
                          f"engine; supported tasks: {', '.join(supported) or 'none'}",
                          target=f"{PREFIX}.encode", parameter="pooling_params", reason="unsupported task")


def _new(vllm_config: Any, executor_class: Any = None, log_stats: bool = False, **kwargs: Any) -> Any:
    """AsyncLLM(...) for a remote caller, who cannot pass a Python class: the executor defaults to
    the one vLLM would pick for the config."""
    from vllm.v1.engine.async_llm import AsyncLLM
    from vllm.v1.executor.abstract import Executor
    return AsyncLLM(vllm_config, executor_class or Executor.get_class(vllm_config), log_stats, **kwargs)



def _advertise_new_signature() -> None:
    """Describe shows AsyncLLM's own parameters, with the two a remote caller cannot give defaulted."""
    import inspect

    from vllm.v1.engine.async_llm import AsyncLLM
    params = list(inspect.signature(AsyncLLM.__init__).parameters.values())[1:]
    defaults = {"executor_class": None, "log_stats": False}
    _new.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
        [p.replace(default=defaults[p.name]) if p.name in defaults else p for p in params])


_advertise_new_signature()


def _shutdown(engine: Any) -> None:
    """Last ref released: stop the engine core process. Off the event loop, as shutdown blocks."""
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        engine.shutdown()
        return
    loop.run_in_executor(None, engine.shutdown)


ASYNC_LLM = AdapterSpec(
    surface="async_llm",
    module="vllm",
    cls="AsyncLLMEngine",
    public_name=PREFIX,
    result_refs=frozenset({"new", "from_engine_args", "from_vllm_config"}),
    profiles={"new": "ml_inference", "from_engine_args": "ml_inference", "from_vllm_config": "ml_inference",
              "generate": "streaming", "encode": "streaming", "wait_for_requests_to_drain": "ml_inference",
              "add_lora": "ml_inference"},
    guards={"*": _alive, "encode": _encode_guard},
    overrides={"new": _new},
    finalizer=_shutdown,
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
)
