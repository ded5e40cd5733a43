"""The worker's process groups: where they meet, what they are made of, and whose they are.

A process group meets its peers at a store on the network and takes pickled objects from them, and
what torch makes for it (files, threads, a wait for every rank) stays in the process whatever becomes
of the object a client holds. So before torch sees a request to make one: it meets only at hosts the
operator allows, its ranks and layout are ones this worker's world has, its backend one the machine
has; while it is in force it is its maker's; and a coordinator a client made goes with its last ref.
The checks are `vllm.distributed` guards (`adapters/distributed.py` says which entry gets which).
"""

import ipaddress
import logging
import os
import socket
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import grpc

from adapters.engine_requests import clip_int
from adapters.spec import CallContext
from bridge_server.wire.errors import BridgeError, quote

__all__ = ["GROUP_HOLD_LAPSE_S", "MAX_PP_SIZE", "SETS_UP", "SETTINGS", "SWAPS", "TEARS_DOWN", "a_port",
           "a_rendezvous", "end_coordinator", "group_guard", "layout_sizes", "meet_at_loopback",
           "meet_only_where_asked", "short", "world_split"]

MAX_PP_SIZE = 1 << 10       # ranks along one axis of a layout, and pipeline stages get_pp_indices lays out


def a_port(receiver: object, args: Mapping[str, object], ctx: CallContext) -> None:
    """get_tcp_uri and get_distributed_init_method format whatever port they get into the address a
    rendezvous then fails to parse or bind (tcp://host:70000, tcp://host:-5): a port is a TCP port."""
    port = args.get("port")
    if type(port) is int and not 0 <= port <= 65535:
        raise BridgeError(grpc.StatusCode.INVALID_ARGUMENT, "validation",
                          f"parameter port: expected a TCP port (0 to 65,535), got {short(port)}",
                          parameter="port", reason="out of range")


def short(value: object) -> str:
    """A value as an error names it: an int by its digits (or its size, past 200 bits), else its type."""
    return clip_int(value) if type(value) is int else type(value).__name__


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
SETS_UP = frozenset({"init_distributed_environment", "initialize_model_parallel",
                      "ensure_model_parallel_initialized"})
TEARS_DOWN = frozenset({"destroy_model_parallel", "destroy_distributed_environment", "cleanup_dist_env_and_memory"})
# What puts other groups in force for every client while it lasts: a
# stranger's `patch_tensor_parallel_group`, entered on every rank of a distributed pool, swapped the
# pool's tensor-parallel group for groups of one rank each, and every other client's all_reduce
# returned its tensor unreduced, silently. A change like setting up or tearing down.
SWAPS = frozenset({"patch_tensor_parallel_group"})
# What changes how the groups set up next are made, for every client (a process-wide flag): a change too.
SETTINGS = frozenset({"set_custom_all_reduce"})


@dataclass
class _GroupHold:
    holder: str | None = None        # None: no client's; "": the server's
    used: float = 0.0


_groups = _GroupHold()


def _groups_exist() -> bool:
    from vllm.distributed import parallel_state
    return parallel_state._WORLD is not None or parallel_state.model_parallel_is_initialized()


def group_guard(name: str, then: Callable[[object, Mapping[str, object], CallContext], None] | None = None) -> Any:
    """The guard of an entry that sets up, tears down or uses the process groups (see _GroupHold),
    after the entry's own guard (`then`) if it has one."""
    changes = name in SETS_UP or name in TEARS_DOWN or name in SWAPS or name in SETTINGS

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
        if name in SETS_UP:
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


def a_rendezvous(receiver: object, args: Mapping[str, object], ctx: CallContext) -> None:
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
    a_port(receiver, args, ctx)
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
                                     f"got {short(rank)}", parameter="rank")
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


def world_split(receiver: object, args: Mapping[str, object], ctx: CallContext) -> None:
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
                                             f"{world - 1}), got {short(rank)}", parameter=key)
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
                                     f"world has {world}), got {short(local)}", parameter="local_rank")


_PARALLEL_SIZES = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "prefill_context_model_parallel_size")


def layout_sizes(receiver: object, args: Mapping[str, object], ctx: CallContext) -> None:
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
                                         f"{short(value)}", parameter=name)
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


def end_coordinator(coordinator: Any) -> None:
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


def _allowed_host(key: str, host: object, hosts: frozenset[str]) -> None:
    if not isinstance(host, str) or host.lower() not in {h.lower() for h in hosts}:
        raise BridgeError(grpc.StatusCode.PERMISSION_DENIED, "validation",
                          f"parameter {key}: host {quote(host)} is not one this server lets "
                          f"process groups meet at ({', '.join(sorted(hosts))}; pool config key rendezvous_hosts)",
                          parameter=key, reason="host not allowed")


meet_only_where_asked()
