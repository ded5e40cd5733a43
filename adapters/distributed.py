"""`vllm.distributed`: the process group state and the collectives.

torch.distributed keeps its groups in process-wide state and a collective must be issued in the same
order on every rank, so everything that touches a group runs in the worker's exclusive lane. The
arithmetic helpers are pure; the cheapest of them run inline on the event loop.
"""

import gc
import ipaddress
import logging
import os
import socket
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, cast
from urllib.parse import urlsplit

import grpc

from adapters.engine_requests import clip_int
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


MAX_PP_SIZE = 1 << 10       # pipeline stages get_pp_indices lays out (a list, and a log line, of one entry each)
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
                              f"parameter {key}: expected an int from {low:,} to {high:,}, got {_short(value)}",
                              parameter=key, reason="out of range")
    size, rank = args["pp_size"], args.get("pp_rank")
    assert isinstance(size, int)
    if type(rank) is not int or not 0 <= rank < size:
        raise BridgeError(grpc.StatusCode.INVALID_ARGUMENT, "validation",
                          f"parameter pp_rank: expected a stage of {size:,} (0 to {size - 1:,}), got {_short(rank)}",
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


def _a_port(receiver: object, args: Mapping[str, object], ctx: CallContext) -> None:
    """get_tcp_uri and get_distributed_init_method format whatever port they get into the address a
    rendezvous then fails to parse or bind (tcp://host:70000, tcp://host:-5): a port is a TCP port."""
    port = args.get("port")
    if type(port) is int and not 0 <= port <= 65535:
        raise BridgeError(grpc.StatusCode.INVALID_ARGUMENT, "validation",
                          f"parameter port: expected a TCP port (0 to 65,535), got {_short(port)}",
                          parameter="port", reason="out of range")


def _short(value: object) -> str:
    """A value as an error names it: an int by its digits (or its size, past 200 bits), else its type."""
    return clip_int(value) if type(value) is int else type(value).__name__


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
    import logging
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


# Who set up the worker's process groups (vLLM's parallel_state globals: the world group and the
# model-parallel groups, one set per process), and when that client last called an entry of them. Any
# client could destroy the groups another had set up, between two of its collectives (its next one
# failed "tensor model parallel group is not initialized"), and on a distributed pool, the groups its
# ranks joined at start. So they are their maker's: while it uses them, only it (or an operator) sets
# them up again or tears them down; a client's hold lapses after GROUP_HOLD_LAPSE_S unused, as a
# forward context's does, so that one that left without destroying them keeps nobody out for good.
# The groups a distributed pool's ranks join at start (the worker's own call, client "") are the
# server's: only an operator changes them. Any client may use the groups in force.
GROUP_HOLD_LAPSE_S = 60.0
_SETS_UP = frozenset({"init_distributed_environment", "initialize_model_parallel",
                      "ensure_model_parallel_initialized"})
_TEARS_DOWN = frozenset({"destroy_model_parallel", "destroy_distributed_environment", "cleanup_dist_env_and_memory"})
# What puts other groups in force for every client while it lasts: a
# stranger's `patch_tensor_parallel_group`, entered on every rank of a distributed pool, swapped the
# pool's tensor-parallel group for groups of one rank each, and every other client's all_reduce
# returned its tensor unreduced, silently. A change like setting up or tearing down.
_SWAPS = frozenset({"patch_tensor_parallel_group"})
# What changes how the groups set up next are made, for every client (a process-wide flag): a change too.
_SETTINGS = frozenset({"set_custom_all_reduce"})


@dataclass
class _GroupHold:
    holder: str | None = None        # None: no client's; "": the server's
    used: float = 0.0


_groups = _GroupHold()


def _groups_exist() -> bool:
    from vllm.distributed import parallel_state
    return parallel_state._WORLD is not None or parallel_state.model_parallel_is_initialized()


def _group_guard(name: str, then: Callable[[object, Mapping[str, object], CallContext], None] | None = None) -> Any:
    """The guard of an entry that sets up, tears down or uses the process groups (see _GroupHold),
    after the entry's own guard (`then`) if it has one."""
    changes = name in _SETS_UP or name in _TEARS_DOWN or name in _SWAPS or name in _SETTINGS

    def guard(receiver: object, args: Mapping[str, object], ctx: CallContext) -> None:
        if then is not None:
            then(receiver, args, ctx)
        now = time.monotonic()
        holder = _groups.holder if _groups_exist() else None
        if holder is not None and holder != ctx.client:
            if not changes:
                return          # another's groups, used: they stay their maker's, its hold not renewed
            if not ctx.policy.operator(ctx.identity) and (holder == "" or now - _groups.used <= GROUP_HOLD_LAPSE_S):
                whose = "the server's (a distributed pool's ranks joined them at start)" if holder == "" else \
                    f"another client's, which used them within the last {GROUP_HOLD_LAPSE_S:.0f} s"
                raise BridgeError(grpc.StatusCode.PERMISSION_DENIED, "validation",
                                  f"vllm.distributed.{name}: this worker's process groups are {whose}: only their "
                                  f"maker (or an operator) sets them up again, swaps them or tears them down; any "
                                  f"client may use them", target=f"vllm.distributed.{name}", reason="groups held")
        if name in _SETS_UP:
            _groups.holder = ctx.client        # (one that fails leaves no groups, and so no hold)
        _groups.used = now
    return guard


def _store_at_its_host(host_name: str, port: int, world_size: int | None = None, is_master: bool = False,
                       **kwargs: Any) -> Any:
    """torch's TCPStore, but a store's server listens at the host its rendezvous names only. torch's
    own listens on every interface, whatever host it is given: a group a client made "at 127.0.0.1"
    took keys (and pickled objects) from anyone who could reach the machine."""
    from torch.distributed import DistNetworkError, TCPStore
    if is_master and kwargs.get("master_listen_fd") is None:
        # Never torch's own socket: it listens on every interface. Where ours cannot be made (a host
        # name that does not resolve, " 127.0.0.1" with its blank; a port in use), the group is not made.
        try:
            kwargs["master_listen_fd"] = _listening_at(host_name, port)
        except OSError as exc:
            raise DistNetworkError(f"a process group's store cannot listen at host {host_name!r}, port {port} "
                                   f"(it listens at the host its rendezvous names, and only there): {exc}") from None
    return TCPStore(host_name, port, world_size, is_master, **kwargs)


def _listening_at(host: object, port: int) -> int:
    """A socket listening at (host, port), handed over as its fd (the store closes it); OSError
    where it cannot be made."""
    if not isinstance(host, str) or not host:
        raise OSError(f"no host to listen at: {host!r}")
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(socket.SOMAXCONN)
    except OSError:
        sock.close()
        raise
    return sock.detach()


def meet_only_where_asked() -> None:
    """Installed when this adapter loads: rendezvous stores listen at their own host (above)."""
    import importlib
    # (the module by its name: `torch.distributed.rendezvous` as an attribute is the function it defines)
    rendezvous = importlib.import_module("torch.distributed.rendezvous")
    setattr(rendezvous, "TCPStore", _store_at_its_host)   # noqa: B010 - a module global torch looks up per call


def meet_at_loopback(hosts: frozenset[str]) -> None:
    """At a worker's start, where every host its process groups may meet at is loopback: its engines'
    own groups and gloo's sockets stay there too. vLLM's engine core makes a group at the address
    the machine's name resolves to (reachable from elsewhere), and gloo listens there for its peers;
    `VLLM_HOST_IP` and `GLOO_SOCKET_IFNAME` (the operator's, if set) keep them at loopback. The
    engine core's store server listens at that host only because the engine core, spawned from the
    worker, loads this module too (`cli.py`)."""
    if hosts and all(_loopback(h) for h in hosts):
        os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")


def _loopback(host: str) -> bool:
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _rendezvous(receiver: object, args: Mapping[str, object], ctx: CallContext) -> None:
    """A process group meets peers on the network and takes pickled objects from them: only at
    hosts the operator allows (loopback by default). An init method is read as torch reads it
    (scheme in any case, blanks around it), and only two kinds pass: `tcp://` to an allowed host, and
    `env://` (the server's own environment, which the operator set). `file://` would have torch
    create, read and delete a file the client names. Its ranks are at most the pool's."""
    hosts = ctx.policy.rendezvous_hosts
    method = args.get("distributed_init_method")
    if method is not None:
        parts = urlsplit(method.strip()) if isinstance(method, str) else None
        scheme = parts.scheme.lower() if parts is not None else ""
        if scheme not in ("tcp", "env"):
            raise BridgeError(grpc.StatusCode.PERMISSION_DENIED, "validation",
                              f"parameter distributed_init_method: {quote(method)} is not tcp://HOST:PORT "
                              f"(at an allowed host) or env://", parameter="distributed_init_method",
                              reason="init method not allowed")
        if scheme == "tcp":
            _allowed_host("distributed_init_method", parts.hostname if parts is not None else None, hosts)
            try:
                _ = parts.port if parts is not None else None
            except ValueError:
                raise BridgeError.validation(f"parameter distributed_init_method: {quote(method)} names no TCP "
                                             f"port (0 to 65,535)", parameter="distributed_init_method") from None
    _a_port(receiver, args, ctx)
    if "host" in args:
        host = args["host"]
        _allowed_host("host", host, hosts)      # as given: " 127.0.0.1" resolves nowhere, and is not allowed
    size, most = args.get("world_size"), ctx.world_size + ctx.policy.outside_ranks
    if isinstance(size, int) and size > most:
        # Its other ranks would have to come from elsewhere: the call waits for them in a thread
        # that no deadline can take back (torch waits 30 minutes), the exclusive lane with it.
        raise BridgeError(grpc.StatusCode.FAILED_PRECONDITION, "validation",
                          f"parameter world_size: a process group of {size:,} ranks, where this "
                          f"pool has {ctx.world_size} and lets {ctx.policy.outside_ranks} join from elsewhere (pool "
                          f"config key outside_ranks; a distributed pool has as many ranks as its workers)",
                          parameter="world_size", reason="no such ranks")
    rank = args.get("rank")
    if type(size) is int and size > 0 and type(rank) is int and rank != -1 and not 0 <= rank < size:
        # A rank the group does not have waits for its store at the port as a peer would, until
        # torch's timeout (30 minutes), in a thread no deadline takes back. (-1: vLLM's "not given",
        # which torch refuses at once.)
        raise BridgeError.validation(f"parameter rank: expected a rank of the group's {size:,} (0 to {size - 1:,}), "
                                     f"got {_short(rank)}", parameter="rank")
    _a_backend(receiver, args, ctx)


def _backends() -> list[str]:
    import torch
    import torch.distributed as dist
    have = ["gloo"] if dist.is_gloo_available() else []
    if dist.is_nccl_available() and torch.cuda.is_available():
        have.append("nccl")
    return have


def _a_backend(receiver: object, args: Mapping[str, object], ctx: CallContext) -> None:
    """A group's backend is one this machine has: given another ("xyz", "mpi", "nccl" without a GPU)
    a stateless group quietly came back as gloo, and `init_distributed_environment` set up the world
    with it. None (where a call takes it) means the world's."""
    if "backend" not in args or args["backend"] is None:
        return
    backend, have = args["backend"], _backends()
    if backend not in have:
        raise BridgeError.validation(f"parameter backend: expected one of {', '.join(map(repr, have)) or 'none'} (the "
                                     f"process-group backends this worker has), got {quote(str(backend), 40)}",
                                     parameter="backend")


def _world(label: str) -> tuple[int, int]:
    """The size of the world the worker's groups are set up in, and the worker's rank in it;
    FAILED_PRECONDITION without one."""
    import torch.distributed as dist
    if not dist.is_initialized():
        raise BridgeError(grpc.StatusCode.FAILED_PRECONDITION, "validation",
                          f"no process group is set up in this worker {label}: call init_distributed_environment "
                          f"first", reason="no process group")
    return int(dist.get_world_size()), int(dist.get_rank())


def _group_ranks(receiver: object, args: Mapping[str, object], ctx: CallContext) -> None:
    """Each list of ranks becomes two torch groups (~4 files and ~3 threads each), which stay
    registered in torch whatever becomes of the coordinator: one call naming [[0]] a thousand times
    took 8,000 files and 6,000 threads for good, and every client's constructors were refused. A
    coordinator's groups split the world: disjoint lists of distinct ranks of it, at most as many
    lists as it has ranks."""
    _a_backend(receiver, args, ctx)
    key = "group_ranks" if "group_ranks" in args else "ranks"
    lists = args.get(key)
    lists = lists if key == "group_ranks" else [lists]
    if not isinstance(lists, list):
        return              # the binding said so
    world, own = _world("to make groups of")
    seen: set[int] = set()
    for i, ranks in enumerate(lists):
        where = f"{key}[{i}]" if key == "group_ranks" else key
        if not isinstance(ranks, list) or not ranks:
            raise BridgeError.validation(f"parameter {where}: expected a non-empty list of ranks", parameter=key)
        for rank in ranks:
            if type(rank) is not int or not 0 <= rank < world:
                raise BridgeError.validation(f"parameter {where}: expected ranks of the world's {world} (0 to "
                                             f"{world - 1}), got {_short(rank)}", parameter=key)
            if rank in seen:
                raise BridgeError.validation(f"parameter {where}: rank {rank} is in more than one group (the groups "
                                             f"of one coordinator split the world's {world} ranks)", parameter=key)
            seen.add(rank)
    if own not in seen:          # a coordinator is this process's: vLLM's bare assertion came after its groups
        raise BridgeError.validation(f"parameter {key}: expected a list holding this worker's rank {own} (a "
                                     f"coordinator's groups are made for the process that makes it), got none",
                                     parameter=key)
    local = args.get("local_rank")
    if type(local) is int and not 0 <= local < world:     # the process's index on its machine: a device's
        raise BridgeError.validation(f"parameter local_rank: expected a rank on this machine, 0 to {world - 1} (the "
                                     f"world has {world}), got {_short(local)}", parameter="local_rank")


_PARALLEL_SIZES = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "prefill_context_model_parallel_size")


def _model_parallel_sizes(receiver: object, args: Mapping[str, object], ctx: CallContext) -> None:
    """The model-parallel sizes lay the world's ranks out as a grid (vLLM reshapes them): a size below
    1, or sizes whose product does not divide the world, failed as torch's "shape '[-1, 1, 0, 1, 0]' is
    invalid for input of size 1", naming nothing; with no world set up, as a bare assertion."""
    _a_backend(receiver, args, ctx)
    product = 1
    for name in (*_PARALLEL_SIZES, "decode_context_model_parallel_size"):
        value = args.get(name)
        if value is None and name == "decode_context_model_parallel_size":
            continue
        if type(value) is not int or not 1 <= value <= MAX_PP_SIZE:
            raise BridgeError.validation(f"parameter {name}: expected a number of ranks from 1 to {MAX_PP_SIZE:,}, got "
                                         f"{_short(value)}", parameter=name)
        if name in _PARALLEL_SIZES:
            product *= value
    dcp, tp = args.get("decode_context_model_parallel_size"), args.get("tensor_model_parallel_size", 1)
    if type(dcp) is int and type(tp) is int and tp % dcp:
        raise BridgeError.validation(f"parameter decode_context_model_parallel_size: expected a divisor of "
                                     f"tensor_model_parallel_size ({tp}), got {dcp}",
                                     parameter="decode_context_model_parallel_size")
    world, _ = _world("to lay out")
    if world % product:
        name = next((n for n in _PARALLEL_SIZES if args.get(n, 1) != 1), _PARALLEL_SIZES[0])
        raise BridgeError.validation(f"parameter {name}: the tensor, pipeline and prefill-context sizes multiply to "
                                     f"{product:,} ranks, which do not divide the world's {world}", parameter=name)


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
    """What `suppress_stdout()` returns to a client: vLLM's own context manager, entered by one caller
    at a time. It points the worker's file descriptor 1 at /dev/null, for every client, until exited,
    and restores whatever it found there when entered: two entered at once and exited out of order
    left the worker's output on /dev/null for good (and each held two files while its ref lived).
    A second enter while one is in force is refused; releasing the last ref exits it."""

    def __init__(self) -> None:
        self._inner: Any = None

    def __enter__(self) -> None:
        if _suppressing:
            raise BridgeError(grpc.StatusCode.FAILED_PRECONDITION, "validation",
                              "vllm.distributed.suppress_stdout: the worker's stdout is suppressed already (by this "
                              "or another caller's suppress_stdout, for every client): exit that one first",
                              target="vllm.distributed.suppress_stdout", reason="already suppressed")
        from vllm.distributed import suppress_stdout
        inner = suppress_stdout()
        inner.__enter__()
        self._inner = inner
        _suppressing.append(self)

    def __exit__(self, *exc: object) -> bool:
        inner, self._inner = self._inner, None
        if inner is None:
            return False
        _suppressing.remove(self)
        return bool(inner.__exit__(*exc))


_suppressing: list[StdoutSuppression] = []      # the one in force, if any


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
                                         f"({-tensor.dim()} to {tensor.dim() - 1}), got {_short(dim)}",
                                         parameter="dim")
        if type(size) is int and not 1 <= size <= MAX_PP_SIZE:
            raise BridgeError.validation(f"parameter world_size: expected 1 to {MAX_PP_SIZE:,} ranks, got "
                                         f"{_short(size)}", parameter="world_size")
        result = tensor.numel() * tensor.element_size() * (size if gathers and type(size) is int else 1)
        if result > MAX_FAKE_BYTES:
            raise BridgeError(grpc.StatusCode.RESOURCE_EXHAUSTED, "validation",
                              f"parameter world_size: a result of {result:,} bytes, over this server's limit of "
                              f"{MAX_FAKE_BYTES:,} for a fake's", parameter="world_size", reason="too large")
    return guard


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


def _end_coordinator(coordinator: Any) -> None:
    """A GroupCoordinator holds two torch groups (~8 files and ~6 threads on gloo) that torch keeps
    registered whatever becomes of the coordinator: each one a client made (`init_model_parallel_group`,
    `init_world_group`) and released left them for good, until every client's constructors were
    refused "too many open files". With its last ref its groups go, unless vLLM uses it (one that
    `initialize_model_parallel` set up, or one `patch_tensor_parallel_group` has in force)."""
    from vllm.distributed import parallel_state
    if any(coordinator is value for value in vars(parallel_state).values()):
        return
    try:
        coordinator.destroy()
    except Exception as exc:    # noqa: BLE001 - the world it was made in may be gone already
        logging.getLogger("vllm_bridge.worker").warning("a released process group could not be destroyed: %s", exc)


def _suppress_stdout() -> StdoutSuppression:
    return StdoutSuppression()


def _end_suppression(obj: Any) -> None:
    """The last ref to an entered suppression went: the worker's stdout comes back."""
    obj.__exit__(None, None, None)


def _allowed_host(key: str, host: object, hosts: frozenset[str]) -> None:
    if not isinstance(host, str) or host.lower() not in {h.lower() for h in hosts}:
        raise BridgeError(grpc.StatusCode.PERMISSION_DENIED, "validation",
                          f"parameter {key}: host {quote(host)} is not one this server lets "
                          f"process groups meet at ({', '.join(sorted(hosts))}; pool config key rendezvous_hosts)",
                          parameter=key, reason="host not allowed")


meet_only_where_asked()

_GUARDS: dict[str, Callable[[object, Mapping[str, object], CallContext], None]] = {
    "resolve_obj_by_qualname": _catalog_names_only, "init_logger": bounded_logger,
    "divide": _plain_numbers, "ensure_divisibility": _plain_numbers, "get_pp_indices": _bounded_stages,
    "is_torch_equal_or_newer": _short_version, "get_tcp_uri": _a_port,
    "get_distributed_init_method": _a_port, "split_tensor_along_last_dim": _split_evenly,
    "init_distributed_environment": _rendezvous, "stateless_init_torch_distributed_process_group": _rendezvous,
    "initialize_model_parallel": _model_parallel_sizes, "ensure_model_parallel_initialized": _model_parallel_sizes,
    "init_world_group": _group_ranks, "init_model_parallel_group": _group_ranks,
    "all_gather_fake": _fake_shape(gathers=True), "reduce_scatter_fake": _fake_shape(gathers=False),
    "all_reduce_fake": _fake_shape(gathers=False), "graph_capture": _a_cuda_device,
}
# Everything that talks to the other ranks of the group (or sets the group up or down, which is a
# rendezvous): called on one rank of a distributed pool it would block there, waiting for peers that
# never come, and every later collective of the pool would queue behind it. Each also uses (or
# changes) the process groups in force, which are their maker's (`_group_guard`).
_COLLECTIVES = frozenset({
    "tensor_model_parallel_all_reduce", "tensor_model_parallel_all_gather", "tensor_model_parallel_gather",
    "tensor_model_parallel_reduce_scatter", "broadcast_tensor_dict", "all_reduce", "all_gather",
    "reduce_scatter", "patched_fused_scaled_matmul_reduce_scatter", "in_the_same_node_as",
    *_SETS_UP, *_TEARS_DOWN,
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
    guards={**_GUARDS, **{name: _group_guard(name, _GUARDS.get(name)) for name in _COLLECTIVES | _SWAPS | _SETTINGS}},
    collectives=_COLLECTIVES,
    overrides={"suppress_stdout": _suppress_stdout, "cleanup_dist_env_and_memory": _cleanup_dist_env_and_memory,
               **{name: _zeroed(name) for name in _FAKES}},
    finalizers=(Finalizer("adapters.distributed", "StdoutSuppression", _end_suppression),
                Finalizer("vllm.distributed.parallel_state", "GroupCoordinator", _end_coordinator)),
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
