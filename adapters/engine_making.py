"""What a client may make an engine from (`AsyncLLM`'s constructors, `from_engine_args`): the engine
arguments a client may set and their ceilings, the paths a model, a tokenizer or a LoRA adapter may be
read from, and what vLLM's own checks of a configuration say, as refusals of the argument they are
about. vLLM judges a configuration only as it builds it, in the engine's constructor and its core
process, with errors that name no argument (or dump every input), and with no idea of what a remote
caller may be trusted with: code to run, files to read, addresses to reach, memory to take.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import dataclasses
import functools
import os
import re
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import grpc

from adapters.distributed import output_for_children
from adapters.engine_core import CORE_REPORTS_ENV
from adapters.engine_life import PREFIX
from adapters.engine_requests import I64_MAX, clip_int
from adapters.spec import CallContext, Policy
from bridge_server.wire.errors import BridgeError, clip, quote

__all__ = ["ENGINE_ARG_CEILINGS", "SAFE_ENGINE_ARGS", "core_reports", "core_start_named", "creation_guard",
           "engine_args_guard", "engine_args_rule", "lora_rule", "made_by", "new_engine"]


def creation_guard(receiver: Any, args: Mapping[str, Any], ctx: CallContext) -> None:
    """What a remote caller could hand an engine to call back, or where to connect, is not its to
    give: factories, classes, registries and addresses keep their defaults (`args` has the
    defaults applied: vLLM's own registry is the default, not something given)."""
    from vllm.multimodal import MULTIMODAL_REGISTRY
    for name in ("executor_class", "stat_loggers", "mm_registry", "client_addresses"):
        value = args.get(name)
        if value and not (name == "mm_registry" and value is MULTIMODAL_REGISTRY):
            raise BridgeError(grpc.StatusCode.PERMISSION_DENIED, "validation",
                              f"{PREFIX}: parameter {name}: not settable by a client (it names code to run, or "
                              f"addresses to connect to)", target=PREFIX, parameter=name, reason="not allowed")
    config = args.get("vllm_config")
    if config is not None and getattr(config, "model_config", None) is None:
        # vLLM's own failure comes later, as an AttributeError on None
        raise BridgeError.validation(f"{PREFIX}: parameter vllm_config: a configuration without a model "
                                     f"(model_config is None): make the engine with from_engine_args, or give "
                                     f"the configuration a model", target=PREFIX, parameter="vllm_config.model_config")


def _within(path: str, dirs: tuple[str, ...]) -> bool:
    real = os.path.realpath(path)
    return any(real == (d := os.path.realpath(root)) or real.startswith(d.rstrip(os.sep) + os.sep) for root in dirs)


def _path_rule(label: str, key: str, dirs: tuple[str, ...], config_key: str, path: object) -> None:
    if isinstance(path, str) and "\0" in path:      # no file has such a name (and realpath raises on it)
        raise BridgeError.validation(f"{label}: field {key}: expected a path, got text holding a NUL character "
                                     f"(at {path.index(chr(0))})", target=label, parameter=key)
    if isinstance(path, str) and not os.path.isabs(path):
        # vLLM reads other forms its own way: `~` as a home folder, a relative name as a model hub's
        # id (downloaded where the hub is reachable), so the path checked is not the path read.
        raise BridgeError(grpc.StatusCode.PERMISSION_DENIED, "validation",
                          f"{label}: field {key}: expected an absolute path on the server, under a directory this "
                          f"server allows ({', '.join(dirs) or 'none'}; pool config key {config_key}), got "
                          f"{quote(path)}", target=label, parameter=key, reason="path not allowed")
    if not isinstance(path, str) or not _within(path, dirs):
        raise BridgeError(grpc.StatusCode.PERMISSION_DENIED, "validation",
                          f"{label}: field {key}: {quote(path)} is not under a directory this server allows "
                          f"({', '.join(dirs) or 'none'}; pool config key {config_key})", target=label,
                          parameter=key, reason="path not allowed")


# Engine arguments a client may set: sizes, dtypes, scheduling and LoRA switches. Left out: whatever
# runs code (trust_remote_code, worker_cls, logits_processors, plugins, hf_overrides), reads files or
# the network the operator did not choose (download_dir, load_format, generation_config, media
# paths, tracing endpoints), or spawns processes elsewhere (executor backends, addresses, ports).
# Not here, besides what runs code, reads files or reaches the network: what sizes an engine's KV
# cache past the operator's budget (VLLM_CPU_KVCACHE_SPACE, gpu_memory_utilization) -- a
# num_gpu_blocks_override of 100,000 took 21 GB and the kernel's OOM killer chose a process -- and
# cpu_offload_gb, host memory for as much of the weights as asked.
CPU_BLOCK_ALIGNMENT = 16       # vLLM's CPU attention kernels take blocks of multiples of this, else abort
SAFE_ENGINE_ARGS = frozenset({
    "model", "served_model_name", "tokenizer", "runner", "convert", "skip_tokenizer_init", "tokenizer_mode",
    "dtype", "kv_cache_dtype", "seed", "max_model_len", "block_size", "enable_prefix_caching",
    "prefix_caching_hash_algo", "disable_sliding_window", "disable_cascade_attn", "gpu_memory_utilization",
    "max_num_batched_tokens", "max_num_partial_prefills",
    "max_long_partial_prefills", "long_prefill_token_threshold", "max_num_seqs", "max_logprobs", "logprobs_mode",
    "disable_log_stats", "enforce_eager", "enable_lora", "max_loras", "max_lora_rank", "max_cpu_loras", "lora_dtype",
    "fully_sharded_loras", "enable_chunked_prefill", "scheduling_policy",
    "override_generation_config", "enable_log_requests", "async_scheduling", "stream_interval", "quantization",
    "enable_prompt_embeds", "enable_sleep_mode", "calculate_kv_scales", "tokens_only", "aggregate_engine_logging",
})


# The largest value a client may give for the safe arguments that size what an engine allocates when
# it starts, whatever the KV cache's budget: vLLM's profiling run samples max_num_seqs rows of the
# whole vocabulary (a 128k vocabulary at 100,000 sequences is 51 GB) and runs the model over
# max_num_batched_tokens tokens; each of max_loras slots holds adapter weights of max_lora_rank for
# every layer; max_logprobs (-1: the vocabulary) bounds what one token's output may carry. vLLM's
# defaults are within these, and an operator lifts one by naming it in engine_args_allowed.
ENGINE_ARG_CEILINGS: Mapping[str, int | float] = {
    "max_num_seqs": 1024, "max_num_batched_tokens": 65536, "max_num_partial_prefills": 64,
    "max_long_partial_prefills": 64, "max_loras": 16, "max_lora_rank": 64, "max_cpu_loras": 64,
    "max_logprobs": 20, "gpu_memory_utilization": 0.9,
}


def engine_args_rule(fields: Mapping[str, Any], policy: Policy) -> None:
    label = "vllm.AsyncEngineArgs"
    allowed = SAFE_ENGINE_ARGS | policy.engine_args_allowed
    for key in fields:
        if key not in allowed:
            raise BridgeError(grpc.StatusCode.PERMISSION_DENIED, "validation",
                              f"{label}: field {key}: not settable by a client (it can run code, read files, reach "
                              f"the network or size memory past the operator's budget); an operator may allow it "
                              f"with the pool config key engine_args_allowed",
                              target=label, parameter=key, reason="not allowed")
    for key, ceiling in ENGINE_ARG_CEILINGS.items():
        value = fields.get(key)
        if key in policy.engine_args_allowed or value is None or isinstance(value, bool) \
                or not isinstance(value, (int, float)):
            continue        # unset, lifted by the operator, or a wrong type, which the type check names
        if not 0 <= value <= ceiling:
            raise BridgeError(grpc.StatusCode.RESOURCE_EXHAUSTED, "validation",
                              f"{label}: field {key}: {clip(repr(value), 40)} is over what a client may give (at most "
                              f"{ceiling:g}, and not negative): it sizes what the engine allocates as it starts; an "
                              f"operator may lift it with the pool config key engine_args_allowed",
                              target=label, parameter=key, reason="over the client limit")
    if fields.get("enable_chunked_prefill") is False and "max_num_batched_tokens" not in policy.engine_args_allowed:
        # Without chunking vLLM batches a whole prompt at once: max_num_batched_tokens becomes
        # max_model_len (the model's own when not given), past its ceiling.
        most = ENGINE_ARG_CEILINGS["max_num_batched_tokens"]
        length = fields.get("max_model_len")
        if not isinstance(length, int) or isinstance(length, bool) or length > most:
            raise BridgeError(grpc.StatusCode.RESOURCE_EXHAUSTED, "validation",
                              f"{label}: field enable_chunked_prefill: false makes max_num_batched_tokens the "
                              f"max_model_len, which must then be given and at most {most:g} (given: "
                              f"{clip(repr(length), 40)}); an operator may lift it with the pool config key "
                              f"engine_args_allowed (max_num_batched_tokens)",
                              target=label, parameter="max_model_len", reason="over the client limit")
    seed = fields.get("seed")
    if isinstance(seed, int) and not isinstance(seed, bool) and not 0 <= seed < 2**32:
        raise BridgeError.validation(f"{label}: field seed: {clip(repr(seed), 40)} is not from 0 to 2**32 - 1 (the "
                                     f"range the engine's random generators take; past it the engine core fails "
                                     f"to start)", target=label, parameter="seed")
    block = fields.get("block_size")
    if isinstance(block, int) and not isinstance(block, bool) and block % CPU_BLOCK_ALIGNMENT:
        from vllm.platforms import current_platform
        if current_platform.is_cpu():
            raise BridgeError.validation(f"{label}: field block_size: expected a multiple of {CPU_BLOCK_ALIGNMENT} on "
                                         f"this CPU server (its attention kernels' alignment), got {block}; past the "
                                         f"configuration's checks, the engine core aborts at its first step",
                                         target=label, parameter="block_size")
    for key in ("model", "tokenizer"):
        if key in fields and fields[key] is not None:
            _path_rule(label, key, policy.model_dirs, "model_dirs", fields[key])


def lora_rule(fields: Mapping[str, Any], policy: Policy) -> None:
    label = "vllm.lora.request.LoRARequest"
    if fields.get("tensorizer_config_dict"):
        raise BridgeError(grpc.StatusCode.PERMISSION_DENIED, "validation",
                          f"{label}: field tensorizer_config_dict: not settable by a client (it deserializes what "
                          f"it loads)", target=label, parameter="tensorizer_config_dict", reason="not allowed")
    lora_id = fields.get("lora_int_id")
    if type(lora_id) is int and not 1 <= lora_id <= I64_MAX:    # vLLM's own ValueError names no field
        raise BridgeError.validation(f"{label}: field lora_int_id: expected an adapter's id, an integer from 1 to "
                                     f"2**63 - 1, got {clip_int(lora_id)}", target=label, parameter="lora_int_id")
    if "lora_path" in fields:
        _path_rule(label, "lora_path", policy.lora_dirs + policy.model_dirs, "lora_dirs", fields["lora_path"])


def new_engine(vllm_config: Any, executor_class: Any = None, log_stats: bool = False, **kwargs: Any) -> Any:
    """AsyncLLM(...) for a remote caller, who cannot pass a Python class: the executor defaults to
    the one vLLM would pick for the config."""
    from vllm.v1.engine.async_llm import AsyncLLM
    from vllm.v1.executor.abstract import Executor
    with core_start_named(PREFIX, "vllm_config", vllm_config):
        return AsyncLLM(vllm_config, executor_class or Executor.get_class(vllm_config), log_stats, **kwargs)


def made_by(name: str, argument: str) -> Callable[..., Any]:
    """AsyncLLM's constructor `name` (`from_engine_args`, `from_vllm_config`) as it is, but for an
    engine core that does not start, which is said by name (`core_start_named`)."""
    from vllm.v1.engine.async_llm import AsyncLLM
    make = getattr(AsyncLLM, name)

    @functools.wraps(make)      # (its signature, and its module's names for the signature's types)
    def made(*args: Any, **kwargs: Any) -> Any:
        given = args[0] if args else kwargs.get(argument)
        with core_start_named(f"{PREFIX}.{name}", argument, given):
            return make(*args, **kwargs)
    return made


# ------------------------------------------------------------------------------ a core that does not start
_START_FAILED = "Engine core initialization failed"


def core_reports() -> str:
    """The folder where the engine cores this process starts write why they failed to start
    (`engine_core._StartFailure`), named to them in the environment they inherit. A core makes it
    when it has something to say, and the reader removes it: a worker ends with `os._exit`, so a
    folder made for every worker stayed behind, one for each worker a pool ever started."""
    where = os.path.join(tempfile.gettempdir(), f"vllm-bridge-cores-{os.getpid()}")
    os.environ[CORE_REPORTS_ENV] = where
    return where


@contextlib.contextmanager
def core_start_named(label: str, argument: str, given: Any) -> Iterator[None]:
    """An engine made inside, whose core failed to start, refused as FAILED_PRECONDITION about the
    arguments it was made from, with the core's own reason where it wrote one. The configuration's
    checks had passed (`engine_args_guard`), so what failed is what only loading the model or
    starting its workers shows: a quantization the checkpoint lacks, a package the method needs."""
    where = core_reports()
    since = time.time()
    # what the client set, before vLLM fills in the rest in place (a configuration's parts are all set)
    fields = sorted(_given(given) - {"model"}) if argument == "engine_args" else []
    try:
        with output_for_children():     # the core logs to the worker's output for its life
            yield
    except RuntimeError as exc:
        if not str(exc).startswith(_START_FAILED):
            raise
        reason = _start_failure(where, since)
        parameter = argument
        if reason is not None:
            named = [f for f in fields if re.search(rf"\b{re.escape(f)}\b", reason) or
                     isinstance(v := getattr(given, f, None), str) and len(v) >= 4 and v in reason]
            if len(named) == 1:
                parameter = f"{argument}.{named[0]}"
        settings = f" (set besides the model: {', '.join(fields[:12])})" if fields else ""
        raise BridgeError(grpc.StatusCode.FAILED_PRECONDITION, "validation",
                          f"{label}: parameter {parameter}: vLLM's engine core did not start with these "
                          f"{argument}{settings}, which its configuration's checks had passed: "
                          f"{clip(reason, 600) if reason else 'its reason is in the server log'}",
                          target=label, parameter=parameter, reason="engine did not start") from None


def _start_failure(where: str, since: float) -> str | None:
    """What a core of this process wrote since `since` of why it did not start; None unless exactly
    one did (two engines failing at once cannot be told apart here). Every report is read once, and
    the folder goes with the last."""
    mine = f"{os.getpid()}-"
    found: list[tuple[str, float]] = []
    with contextlib.suppress(OSError):
        for entry in os.scandir(where):
            if entry.name.startswith(mine) and not entry.name.endswith(".part"):
                found.append((entry.path, entry.stat(follow_symlinks=False).st_mtime))
    fresh = [path for path, at in found if at >= since - 1.0]
    text = None
    if len(fresh) == 1:
        with contextlib.suppress(OSError), open(fresh[0], encoding="utf-8", errors="replace") as f:
            text = f.read()
    for path, _ in found:
        with contextlib.suppress(OSError):
            os.unlink(path)
    with contextlib.suppress(OSError):
        os.rmdir(where)          # unless another core's report is still in it
    return text



async def engine_args_guard(receiver: Any, args: Mapping[str, Any], ctx: CallContext) -> None:
    """`from_engine_args`'s arguments as vLLM's config checks judge them, said as refusals of them.
    Those checks raise pydantic's ValidationError, whose text dumps every input (and names a field the
    client may never have sent), or a bare RuntimeError ("... is not compatible with FP8 KV cache":
    status UNKNOWN), naming no argument. So the configuration is built first, off the loop, and what
    it raises is INVALID_ARGUMENT, about `engine_args` (and the field, where vLLM names one the client
    gave). The engine then builds it again (a fraction of a second, against ~12 s to start)."""
    creation_guard(receiver, args, ctx)
    engine_args: Any = args.get("engine_args")
    if isinstance(engine_args, type) or not callable(getattr(engine_args, "create_engine_config", None)):
        return
    given = _given(engine_args)
    trial: Any = copy.copy(engine_args)
    label = f"{PREFIX}.from_engine_args"
    try:       # on a copy: vLLM fills in the defaults it derives, in place
        config = await asyncio.to_thread(trial.create_engine_config)
    except (ValueError, RuntimeError, AssertionError, NotImplementedError, TypeError) as exc:
        raise _config_refusal(label, given, exc) from None
    await _tokenizer_trial(label, config.model_config, given)


async def _tokenizer_trial(label: str, model_config: Any, given: set[str]) -> None:
    """The engine loads its tokenizer as it starts, and one that does not load (a tokenizer_mode the
    model has no files for, a tokenizer path holding no tokenizer) failed the engine's construction
    with a bare ValueError naming no argument. So it is loaded first, off the loop, and a failure is
    a refusal of the argument that chose it. vLLM keeps what it loaded (`cached_get_tokenizer`): the
    engine's own load then costs nothing."""
    if model_config.skip_tokenizer_init:
        return
    from vllm.tokenizers import cached_tokenizer_from_config
    try:
        await asyncio.to_thread(cached_tokenizer_from_config, model_config)
    except (ValueError, OSError, KeyError, TypeError, AttributeError, ImportError, RuntimeError) as exc:
        where = next((f"engine_args.{k}" for k in ("tokenizer", "tokenizer_mode", "tokenizer_revision") if k in given),
                     "engine_args.model")
        raise BridgeError.validation(f"{label}: parameter {where}: vLLM could not load the engine's tokenizer: "
                                     f"{type(exc).__name__}: {clip(str(exc), 300)}", target=label,
                                     parameter=where) from None


def _config_refusal(label: str, given: set[str], exc: BaseException) -> BridgeError:
    """A refusal of the configuration, by the field vLLM names where the client gave it (`given`),
    in vLLM's words without the inputs pydantic lists."""
    where, text = "engine_args", f"{type(exc).__name__}: {exc}"
    listed = getattr(exc, "errors", None)
    errors = listed() if type(exc).__name__ == "ValidationError" and callable(listed) else None
    if errors:
        named = [e for e in errors if e.get("loc") and str(e["loc"][0]) in given]
        first = (named or errors)[0]
        if named:
            where = f"engine_args.{first['loc'][0]}"
            text = f"{first['loc'][0]}: {first.get('msg', '')}, got {clip(repr(first.get('input')), 60)}"
        else:
            text = str(first.get("msg", "")) or type(exc).__name__
        if len(errors) > 1:
            text += f" (and {len(errors) - 1} more)"
    if where == "engine_args":      # a check of the whole config: the one field it names by name, if any
        named_in_text = [g for g in given if "_" in g and re.search(rf"\b{g}\b", text)]
        if len(named_in_text) == 1:
            where = f"engine_args.{named_in_text[0]}"
    return BridgeError.validation(f"{label}: parameter {where}: vLLM refused the configuration: {clip(text, 400)}",
                                  target=label, parameter=where)


def _given(engine_args: Any) -> set[str]:
    """The fields of the client's engine args set to other than their defaults."""
    if not dataclasses.is_dataclass(engine_args):
        return set()
    out = set()
    for f in dataclasses.fields(engine_args):
        default = f.default if f.default is not dataclasses.MISSING else \
            f.default_factory() if f.default_factory is not dataclasses.MISSING else dataclasses.MISSING
        if getattr(engine_args, f.name, default) != default:
            out.add(f.name)
    return out


def _advertise_new_signature() -> None:
    """Describe shows AsyncLLM's own parameters, with the two a remote caller cannot give defaulted."""
    import inspect

    from vllm.v1.engine.async_llm import AsyncLLM
    params = list(inspect.signature(AsyncLLM.__init__).parameters.values())[1:]
    defaults = {"executor_class": None, "log_stats": False}
    new_engine.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
        [p.replace(default=defaults[p.name]) if p.name in defaults else p for p in params])


_advertise_new_signature()
