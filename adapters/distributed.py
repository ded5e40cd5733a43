"""`vllm.distributed`: the process group state and the collectives.

torch.distributed keeps its groups in process-wide state and a collective must be issued in the same
order on every rank, so everything that touches a group runs in the worker's exclusive lane. The
arithmetic helpers are pure; the cheapest of them run inline on the event loop.
"""

import contextlib
import gc
import logging
import math
import os
import sys
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any, cast

import grpc

from adapters.process_groups import (MAX_PP_SIZE, SETS_UP, SETTINGS, SWAPS, TEARS_DOWN, a_port, a_rendezvous,
                                     end_coordinator, group_guard, layout_sizes, short, world_split)
from adapters.spec import AdapterSpec, CallContext, Exposure, Finalizer
from bridge_server.wire.errors import BridgeError, quote
from bridge_server.wire.protocol import host_of


def _catalog_names_only(receiver: object, args: Mapping[str, object], ctx: CallContext) -> None:
    """resolve_obj_by_qualname would import any module by name: a client may name only what the
    catalog serves (which it can call by name anyway)."""
    qualname = args.get("qualname")
    if not isinstance(qualname, str) or qualname not in ctx.catalog_names:
        raise BridgeError(grpc.StatusCode.PERMISSION_DENIED, "validation",
                          f"vllm.distributed.resolve_obj_by_qualname: parameter qualname: {quote(qualname)} is not a "
                          f"name in the catalog; only those can be resolved", target="vllm.distributed.resolve_obj_by_qualname",
                          parameter="qualname", reason="not allowed")


MAX_LAYERS = 1 << 20        # hidden layers it spreads over them
MAX_VERSION_CHARS = 256     # a version string is_torch_equal_or_newer parses


def _plain_numbers(receiver: object, args: Mapping[str, object], ctx: CallContext) -> None:
    """divide and ensure_divisibility run `numerator % denominator` on the event loop, and on text
    `%` is formatting: divide("%1000000000d", 1) built a 1 GB string there, 0.6 s for 49 bytes.
    The helpers are arithmetic, so they take numbers (ints, floats) only."""
    for key in ("numerator", "denominator"):
        value = args.get(key)
        if type(value) not in (int, float):
            raise BridgeError(grpc.StatusCode.INVALID_ARGUMENT, "validation",
                              f"parameter {key}: expected a number (int or float), got "
                              f"{type(value).__name__}", parameter=key, reason="type")


def _bounded_stages(receiver: object, args: Mapping[str, object], ctx: CallContext) -> None:
    """get_pp_indices makes a list of one entry per pipeline stage on the event loop, and when the
    layers do not divide evenly logs all of them in one line: pp_size 2**62 in 58 bytes held the
    worker until its supervisor killed it, and a layer count of 4,300 digits made each of 65,536
    entries 4,300 digits long (17 s and 281 MB of log per call). So every argument is an int, and
    in range: layers at most MAX_LAYERS, stages at most MAX_PP_SIZE, pp_rank one of them."""
    for key, low, high in (("num_hidden_layers", 0, MAX_LAYERS), ("pp_size", 1, MAX_PP_SIZE)):
        value = args.get(key)
        if type(value) is not int or not low <= value <= high:
            raise BridgeError(grpc.StatusCode.INVALID_ARGUMENT, "validation",
                              f"parameter {key}: expected an int from {low:,} to {high:,}, got {short(value)}",
                              parameter=key, reason="out of range")
    size, rank = args["pp_size"], args.get("pp_rank")
    assert isinstance(size, int)
    if type(rank) is not int or not 0 <= rank < size:
        raise BridgeError(grpc.StatusCode.INVALID_ARGUMENT, "validation",
                          f"parameter pp_rank: expected a stage of {size:,} (0 to {size - 1:,}), got {short(rank)}",
                          parameter="pp_rank", reason="out of range")


def _short_version(receiver: object, args: Mapping[str, object], ctx: CallContext) -> None:
    """is_torch_equal_or_newer parses its version string on the event loop: a megabyte of it took
    0.3 s a call. A version is a few dozen characters."""
    target = args.get("target")
    if isinstance(target, str) and len(target) > MAX_VERSION_CHARS:
        raise BridgeError(grpc.StatusCode.INVALID_ARGUMENT, "validation",
                          f"parameter target: a version string of {len(target):,} characters, expected at most "
                          f"{MAX_VERSION_CHARS}", parameter="target", reason="too long")
    if isinstance(target, str):
        from packaging.version import InvalidVersion, Version
        try:
            Version(target)
        except InvalidVersion:      # (packaging's own error named no parameter)
            raise BridgeError.validation(f"parameter target: expected a version (PEP 440, such as '2.4.0'), got "
                                         f"{quote(target, 60)}", parameter="target") from None


MAX_LOGGER_NAME = 200        # characters of a logger's name a client may give
MAX_LOGGERS = 10_000         # loggers in the worker's process, past which no client adds one
MAX_CLIENT_LOGGERS = 1_250   # ... of which one client (an identity, else a host) adds at most this many
_loggers_added: dict[str, int] = {}     # by identity, else host


def bounded_logger(receiver: object, args: Mapping[str, object], ctx: CallContext) -> None:
    """init_logger registers a logger under the given name in the process's logging manager, which
    keeps every one for the process's life, and a dotted name makes one placeholder per prefix: a
    name of k parts costs O(k^2) memory and time under logging's lock. So a name is short, and
    clients add loggers only while the process holds fewer than MAX_LOGGERS (existing ones they may
    always get), each client at most MAX_CLIENT_LOGGERS of them: one stranger's 10,000 names left
    every other client unable to name a new logger for the worker's life. vLLM's `init_logger` is in
    both documented modules: this guards it in both."""

    name = args.get("name")
    if isinstance(name, str) and len(name) > MAX_LOGGER_NAME:
        raise BridgeError.validation(f"parameter name: {len(name):,} characters is over the limit of "
                                     f"{MAX_LOGGER_NAME}", parameter="name")
    known = logging.Logger.manager.loggerDict
    if not isinstance(name, str) or name in known:
        return
    parts = name.split(".")
    new = sum(".".join(parts[:i]) not in known for i in range(1, len(parts) + 1))    # with its placeholders
    if len(known) + new > MAX_LOGGERS:
        raise BridgeError(grpc.StatusCode.RESOURCE_EXHAUSTED, "validation",
                          f"parameter name: this worker holds {len(known):,} loggers, which it keeps for good; no "
                          f"new one is made past {MAX_LOGGERS:,}", parameter="name", reason="too many loggers")
    who = ctx.identity or host_of(ctx.client)
    added = _loggers_added.get(who, 0)
    if added + new > MAX_CLIENT_LOGGERS:
        raise BridgeError(grpc.StatusCode.RESOURCE_EXHAUSTED, "validation",
                          f"parameter name: this client has added {added:,} loggers to this worker, which keeps "
                          f"them for good; one client adds at most {MAX_CLIENT_LOGGERS:,} (of {MAX_LOGGERS:,} in "
                          f"all)", parameter="name", reason="too many loggers")
    _loggers_added[who] = added + new


def _split_evenly(receiver: object, args: Mapping[str, object], ctx: CallContext) -> None:
    """split_tensor_along_last_dim: torch's refusals of a bad count are bare RuntimeErrors and vLLM's of
    an uneven split a bare assertion; said here, by name."""
    label = "vllm.distributed.split_tensor_along_last_dim"
    parts, tensor = args.get("num_partitions"), args.get("tensor")
    if type(parts) is int and parts < 1:
        raise BridgeError.validation(f"{label}: parameter num_partitions: expected 1 or more, got {parts}",
                                     target=label, parameter="num_partitions")
    shape = getattr(tensor, "shape", None)
    if shape is not None and type(parts) is int:
        if len(shape) == 0:
            raise BridgeError.validation(f"{label}: parameter tensor: expected a tensor of 1 or more dimensions, "
                                         f"got a 0-d tensor", target=label, parameter="tensor")
        if shape[-1] % parts:
            raise BridgeError.validation(f"{label}: parameter num_partitions: the last dimension ({shape[-1]:,}) "
                                         f"does not split into {parts:,} equal parts", target=label,
                                         parameter="num_partitions")
        elements = int(cast(Any, tensor).numel())
        most = max(elements, MAX_PP_SIZE)
        if parts > most:
            # Each part is a tensor object (~0.5 KB) whatever it holds: a tensor of shape [0, N] split
            # N ways asked for 5 million of them in 77 bytes (3 GB, 10 s). As many as the tensor has
            # elements is what its own bytes paid for; an empty one splits MAX_PP_SIZE ways at most.
            raise BridgeError(grpc.StatusCode.RESOURCE_EXHAUSTED, "validation",
                              f"{label}: parameter num_partitions: {parts:,} parts of a tensor of {elements:,} "
                              f"elements; at most {most:,} (its elements, or {MAX_PP_SIZE:,})", target=label,
                              parameter="num_partitions", reason="too many parts")


class StdoutSuppression:
    """What `suppress_stdout()` returns to a client: vLLM's own context manager, shared. It points the
    worker's file descriptor 1 at /dev/null, for every client, while any entered one is in force, and
    restores what was there when the last is exited (or its last ref released), in whatever order:
    vLLM's own, entered twice and exited out of order, left the worker's output on /dev/null for good,
    and each held two files while its ref lived.

    What it silences is what C libraries print, as vLLM's entry says, not the worker's log: before the
    first suppression, vLLM's log handlers that write to fd 1 are moved to a copy of it
    (`_logs_past_suppression`). One suppression in force at a time, refused to everyone else, let a
    stranger that entered one and went idle hide every vLLM log line from the operator, and keep every
    other client out, for as long as its connection stayed open."""

    def __init__(self) -> None:
        self._entered = False

    def __enter__(self) -> None:
        with _suppression:
            if self._entered:
                raise BridgeError(grpc.StatusCode.FAILED_PRECONDITION, "validation",
                                  "vllm.distributed.suppress_stdout: this suppression is entered already: exit it "
                                  "before entering it again",
                                  target="vllm.distributed.suppress_stdout", reason="context manager state")
            if not _suppressing:
                _logs_past_suppression()
                from vllm.distributed import suppress_stdout
                inner = suppress_stdout()
                inner.__enter__()
                _in_force.append(inner)
            _suppressing.add(self)
            self._entered = True

    def __exit__(self, *exc: object) -> bool:
        with _suppression:
            if not self._entered:
                return False
            self._entered = False
            _suppressing.discard(self)
            if _suppressing or not _in_force:
                return False
            return bool(_in_force.pop().__exit__(None, None, None))


_suppression = threading.Lock()
_suppressing: set[StdoutSuppression] = set()    # those entered
_in_force: list[Any] = []                       # vLLM's manager, entered while any is
_moved_logs: list[Any] = []                     # fd 1 as it was before the first suppression, copied


def _logs_past_suppression() -> None:
    """vLLM's log handlers that write to the worker's fd 1 write to a copy of it instead, made once:
    pointing fd 1 at /dev/null then silences what libraries print, and no longer the log."""
    if _moved_logs:
        return
    sys.stdout.flush()
    copy = os.fdopen(os.dup(1), "w", buffering=1, encoding=getattr(sys.stdout, "encoding", None) or "utf-8",
                     errors="backslashreplace")
    _moved_logs.append(copy)
    for handler in [h for name in ("", "vllm") for h in logging.getLogger(name).handlers
                    if isinstance(h, logging.StreamHandler) and _writes_to_fd1(h.stream)]:
        handler.setStream(copy)


@contextlib.contextmanager
def output_for_children() -> Iterator[None]:
    """The worker's own output on fd 1 while processes started inside inherit it, suppressed or not:
    an engine core started while a client held a suppression wrote its log to /dev/null for its
    whole life (the published engine's, rebuilt, among them)."""
    with _suppression:
        restored = bool(_in_force) and bool(_moved_logs)
        if restored:
            os.dup2(_moved_logs[0].fileno(), 1)
    try:
        yield
    finally:
        with _suppression:
            if restored and _in_force:
                devnull = os.open(os.devnull, os.O_WRONLY)
                os.dup2(devnull, 1)
                os.close(devnull)


def _writes_to_fd1(stream: Any) -> bool:
    try:
        return bool(stream.fileno() == 1)
    except (AttributeError, OSError, ValueError):
        return False


# vLLM's fake implementations of its collectives: what torch.compile traces in place of the real
# ones, which promise a result's shape and dtype, never its values.
_FAKES = ("all_reduce_fake", "reduce_scatter_fake", "all_gather_fake",
          "patched_fused_scaled_matmul_reduce_scatter_fake")


def _zeroed(name: str) -> Callable[..., Any]:
    """A fake's result, zeroed. The fakes return `torch.empty` memory: whatever the worker's heap held
    there last, another client's tokens and text among them (a stranger read a bystander's prompt
    back within 18 calls of all_reduce_fake, and the heap's addresses with it). A fake's values mean
    nothing, so zeros are as true as any, and carry nothing of anyone's."""
    def fake(*args: Any, **kwargs: Any) -> Any:
        import torch
        from vllm.distributed import parallel_state
        result = getattr(parallel_state, name)(*args, **kwargs)
        return result.zero_() if isinstance(result, torch.Tensor) else result
    fake.__name__ = fake.__qualname__ = name
    return fake


MAX_FAKE_BYTES = 64 << 20      # a fake's result at most (it is zeroed: every page of it is touched)


def _fake_shape(gathers: bool) -> Callable[[object, Mapping[str, object], CallContext], None]:
    """The fakes work out their result's shape from `dim` and `world_size` unchecked: a dim past the
    tensor's was a bare IndexError, a world size of 0 a ZeroDivisionError, and all_gather_fake's
    result (`gathers`) is world_size times its input, so a world size of a billion asked for
    terabytes. So dim is one of the tensor's, world_size from 1 to MAX_PP_SIZE, and the result
    within MAX_FAKE_BYTES."""
    def guard(receiver: object, args: Mapping[str, object], ctx: CallContext) -> None:
        import torch
        tensor, dim, size = args.get("tensor"), args.get("dim"), args.get("world_size")
        if not isinstance(tensor, torch.Tensor):
            return
        if type(dim) is int and not -tensor.dim() <= dim < tensor.dim():
            raise BridgeError.validation(f"parameter dim: expected a dimension of the tensor's {tensor.dim()} "
                                         f"({-tensor.dim()} to {tensor.dim() - 1}), got {short(dim)}",
                                         parameter="dim")
        if type(size) is int and not 1 <= size <= MAX_PP_SIZE:
            raise BridgeError.validation(f"parameter world_size: expected 1 to {MAX_PP_SIZE:,} ranks, got "
                                         f"{short(size)}", parameter="world_size")
        result = tensor.numel() * tensor.element_size() * (size if gathers and type(size) is int else 1)
        if result > MAX_FAKE_BYTES:
            raise BridgeError(grpc.StatusCode.RESOURCE_EXHAUSTED, "validation",
                              f"parameter world_size: a result of {result:,} bytes, over this server's limit of "
                              f"{MAX_FAKE_BYTES:,} for a fake's", parameter="world_size", reason="too large")
    return guard


# The multiply-adds one fake matmul may cost: ~1 s of one core.
MAX_FAKE_MACS = 1 << 32


def _fake_matmul(receiver: object, args: Mapping[str, object], ctx: CallContext) -> None:
    """patched_fused_scaled_matmul_reduce_scatter_fake multiplies A by B before anything looks at its
    group: A of [M, 16] and B of [16, N] in float8, a few MiB on the wire, asked the worker for an
    [M, N] result of gigabytes (and M·K·N multiply-adds of CPU). So A is of 2 or more dimensions, B of
    2, their inner dimensions agree, and the product is within MAX_FAKE_BYTES and MAX_FAKE_MACS."""
    import torch
    a, b = args.get("A"), args.get("B")
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
        return
    if a.dim() < 2 or b.dim() != 2:
        named = "A" if a.dim() < 2 else "B"
        raise BridgeError.validation(f"parameter {named}: expected A of 2 or more dimensions and B of 2, got A of "
                                     f"shape {list(a.shape)} and B of shape {list(b.shape)}", parameter=named)
    rows, inner, cols = math.prod(a.shape[:-1]), a.shape[-1], b.shape[1]     # (of an empty A too)
    if inner != b.shape[0]:
        raise BridgeError.validation(f"parameter B: expected {inner:,} rows (A's last dimension), got "
                                     f"{b.shape[0]:,}", parameter="B")
    dtype = args.get("out_dtype")
    size = (dtype if isinstance(dtype, torch.dtype) else a.dtype).itemsize
    result, work = rows * cols * size, rows * inner * cols
    if result > MAX_FAKE_BYTES or work > MAX_FAKE_MACS:
        raise BridgeError(grpc.StatusCode.RESOURCE_EXHAUSTED, "validation",
                          f"parameter B: A of {rows:,} × {inner:,} times B of {inner:,} × {cols:,} makes a result "
                          f"of {result:,} bytes with {work:,} multiply-adds; this server's limits for a fake's are "
                          f"{MAX_FAKE_BYTES:,} bytes and {MAX_FAKE_MACS:,}", parameter="B", reason="too large")


def _a_cuda_device(receiver: object, args: Mapping[str, object], ctx: CallContext) -> None:
    """graph_capture captures CUDA graphs on the given device: another device failed only when the
    manager was entered ("Expected a cuda device"), and on a worker without CUDA torch's own error
    came back as UNKNOWN ("invalid argument to exchangeDevice")."""
    import torch
    device = args.get("device")
    kind = device.type if isinstance(device, torch.device) else str(device).partition(":")[0]
    if kind != "cuda":
        raise BridgeError.validation(f"parameter device: expected a CUDA device, got {quote(str(device), 40)}",
                                     parameter="device")
    if not torch.cuda.is_available():
        raise BridgeError(grpc.StatusCode.FAILED_PRECONDITION, "validation",
                          "parameter device: this worker has no CUDA device to capture graphs on",
                          parameter="device", reason="no CUDA device")


def _cleanup_dist_env_and_memory(shutdown_ray: bool = False) -> None:
    """vLLM's own, less what it does to the whole process beyond the groups: it unfreezes the heap
    the worker froze at start (`wire/eventloop.py`) and collects all of it, ~0.3 s with the event loop
    held, at every call (and turns off the cache of vLLM's environment variables). A stranger calling
    it in a loop stalled every other client's streams (gaps of 0.4-0.7 s between tokens), and the heap
    stayed unfrozen for the worker's life. Here the groups go as in vLLM's, and what they leave is
    collected with the young generations only."""
    from vllm.distributed import parallel_state
    from vllm.platforms import current_platform
    parallel_state.destroy_model_parallel()
    parallel_state.destroy_distributed_environment()
    ray = sys.modules.get("ray")
    if shutdown_ray and ray is not None:      # (never imported: no Ray here to shut down)
        ray.shutdown()
    gc.collect(1)
    # (asked of the class: the platform object logs a warning for each attribute it lacks, at every call)
    if getattr(type(current_platform), "empty_cache", None) is not None:
        current_platform.empty_cache()


def _suppress_stdout() -> StdoutSuppression:
    return StdoutSuppression()


def _end_suppression(obj: Any) -> None:
    """The last ref to an entered suppression went: the worker's stdout comes back."""
    obj.__exit__(None, None, None)


_GUARDS: dict[str, Callable[[object, Mapping[str, object], CallContext], None]] = {
    "resolve_obj_by_qualname": _catalog_names_only, "init_logger": bounded_logger,
    "divide": _plain_numbers, "ensure_divisibility": _plain_numbers, "get_pp_indices": _bounded_stages,
    "is_torch_equal_or_newer": _short_version, "get_tcp_uri": a_port,
    "get_distributed_init_method": a_port, "split_tensor_along_last_dim": _split_evenly,
    "init_distributed_environment": a_rendezvous, "stateless_init_torch_distributed_process_group": a_rendezvous,
    "initialize_model_parallel": layout_sizes, "ensure_model_parallel_initialized": layout_sizes,
    "init_world_group": world_split, "init_model_parallel_group": world_split,
    "all_gather_fake": _fake_shape(gathers=True), "reduce_scatter_fake": _fake_shape(gathers=False),
    "all_reduce_fake": _fake_shape(gathers=False), "graph_capture": _a_cuda_device,
    "patched_fused_scaled_matmul_reduce_scatter_fake": _fake_matmul,
}
# Everything that talks to the other ranks of the group (or sets the group up or down, which is a
# rendezvous): called on one rank of a distributed pool it would block there, waiting for peers that
# never come, and every later collective of the pool would queue behind it. Each also uses (or
# changes) the process groups in force, which are their maker's (`group_guard`).
_COLLECTIVES = frozenset({
    "tensor_model_parallel_all_reduce", "tensor_model_parallel_all_gather", "tensor_model_parallel_gather",
    "tensor_model_parallel_reduce_scatter", "broadcast_tensor_dict", "all_reduce", "all_gather",
    "reduce_scatter", "patched_fused_scaled_matmul_reduce_scatter", "in_the_same_node_as",
    *SETS_UP, *TEARS_DOWN,
    "init_model_parallel_group", "init_world_group", "init_gloo_process_group", "graph_capture",
    "prepare_communication_buffer_for_model", "patch_tensor_parallel_group",
})

DISTRIBUTED = AdapterSpec(
    surface="distributed",
    module="vllm.distributed",
    aliases={"use_sched_yield": "USE_SCHED_YIELD"},
    exclusive=True,
    shared=frozenset({
        "divide", "ensure_divisibility", "get_pp_indices", "split_tensor_along_last_dim",
        "is_torch_equal_or_newer", "get_tcp_uri", "get_distributed_init_method", "resolve_obj_by_qualname",
        "init_logger", "logger", "sched_yield", "use_sched_yield", "suppress_stdout", "supports_custom_op",
        "all_gather_fake", "all_reduce_fake", "reduce_scatter_fake",
        "patched_fused_scaled_matmul_reduce_scatter_fake",
        # Stateless groups live in the returned object, not in the module's globals.
        "stateless_init_torch_distributed_process_group", "stateless_destroy_torch_distributed_process_group",
    }),
    inline=frozenset({"divide", "ensure_divisibility", "get_pp_indices", "is_torch_equal_or_newer"}),
    # The inline helpers' guards are plain functions: they run where the call is read (`Invoker.immediate`).
    guards={**_GUARDS, **{name: group_guard(name, _GUARDS.get(name)) for name in _COLLECTIVES | SWAPS | SETTINGS}},
    collectives=_COLLECTIVES,
    overrides={"suppress_stdout": _suppress_stdout, "cleanup_dist_env_and_memory": _cleanup_dist_env_and_memory,
               **{name: _zeroed(name) for name in _FAKES}},
    finalizers=(Finalizer("adapters.distributed", "StdoutSuppression", _end_suppression),
                Finalizer("vllm.distributed.parallel_state", "GroupCoordinator", end_coordinator)),
    frees=frozenset({
        "stateless_destroy_torch_distributed_process_group", "destroy_model_parallel",
        "destroy_distributed_environment", "cleanup_dist_env_and_memory",
    }),
    exposures=(
        Exposure("vllm.distributed.parallel_state", "GroupCoordinator", attributes=frozenset({
            "rank", "ranks", "world_size", "local_rank", "rank_in_group", "unique_name"})),
    ),
    profiles={
        "init_distributed_environment": "ml_inference",
        "initialize_model_parallel": "ml_inference",
        "ensure_model_parallel_initialized": "ml_inference",
        "stateless_init_torch_distributed_process_group": "ml_inference",
    },
)
