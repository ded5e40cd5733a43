"""End to end: refs, sessions, deadlines, bad input and the standard services, over real sockets on
real worker processes."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from google.protobuf import descriptor_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from bridge_server.client.client import BridgeClient, CallError, Target
from bridge_server.wire.errors import BridgeError
from bridge_server.wire.options import MD_TIMEOUT_PROFILE, parse_metadata
from tests.conftest import WorkerProcess, _varint, free_port, large_requests, multiplex_batches, start_worker
from vllm_bridge.v1 import bridge_pb2 as pb
from vllm_bridge.v1 import bridge_pb2_grpc as pb_grpc

D = "vllm.distributed"
FC = "vllm.forward_context"


def test_a_ref_is_usable_from_another_session_and_refused_with_a_reason_once_released(worker: WorkerProcess) -> None:
    with BridgeClient(worker.address) as a, BridgeClient(worker.address) as b:
        dp = a.call(f"{FC}.DPMetadata", torch.tensor(7), torch.tensor([5, 7, 3]), session_id="elixir-pid-1")
        assert dp.session_id == "elixir-pid-1" and dp.id.startswith(dp.worker_id + ".")
        # Another Elixir process (another session) presents the same ref.
        assert b.call(Target.method(dp, "cu_tokens_across_sp"), 1, session_id="elixir-pid-2").tolist() == [5, 12, 15]
        assert a.release(dp) == 1
        with pytest.raises(CallError) as err:
            b.call(Target.method(dp, "cu_tokens_across_sp"), 1)
        assert err.value.code == grpc.StatusCode.NOT_FOUND
        assert dp.id in err.value.details and "released by the client" in err.value.details


def test_releasing_a_session_releases_its_refs_only(worker: WorkerProcess) -> None:
    with BridgeClient(worker.address) as c:
        mine = [c.call("vllm.config.ParallelConfig", session_id="s-release") for _ in range(3)]
        other = c.call("vllm.config.ParallelConfig", session_id="s-keep")
        assert c.release(session_id="s-release") == 3
        for ref in mine:
            with pytest.raises(CallError) as err:
                c.call(Target.get(ref, "world_size"))
            assert "released with its session 's-release'" in err.value.details
        assert c.call(Target.get(other, "world_size")) == 1


def test_session_cap_and_idle_ttl_evict_refs_with_a_reason(tmp_path: Path) -> None:
    w = start_worker(tmp_path, "--session-cap", "2", "--ref-ttl", "1")
    try:
        with BridgeClient(w.address) as c:
            refs = [c.call("vllm.config.ParallelConfig", session_id="capped") for _ in range(3)]
            with pytest.raises(CallError) as err:
                c.call(Target.get(refs[0], "world_size"))
            assert "exceeded its cap of 2 refs" in err.value.details
            assert c.call(Target.get(refs[2], "world_size")) == 1
            time.sleep(7)   # TTL 1 s, swept every 5 s
            with pytest.raises(CallError) as err:
                c.call(Target.get(refs[2], "world_size"))
            assert "expired: idle for more than 1 s" in err.value.details
    finally:
        w.stop()


def test_without_authentication_a_connection_takes_only_its_share_of_refs_and_evicts_only_its_own(
        tmp_path: Path) -> None:
    """Without an identity every client's limits are one. A stranger's connection that made refs up
    to the limit (max_refs_per_client, sessions alike) and left kept every other client from making
    any until the worker restarted; and one that filled the shared `default` session past its cap
    evicted the other connections' refs there. Now a connection holds at most its share (three
    quarters of its host's, which holds three quarters of the limit when alone), and a session's cap
    evicts the adder's own oldest only."""
    w = start_worker(tmp_path, "--session-cap", "8", "--max-refs-per-client", "40", "--max-sessions", "8")
    own = [("grpc.use_local_subchannel_pool", 1)]      # a connection each, as two processes have
    make = "vllm.config.ParallelConfig"

    def until_refused(client: BridgeClient, session: Callable[[int], str]) -> tuple[int, CallError]:
        for made in range(100):
            try:
                client.call(make, session_id=session(made))
            except CallError as err:
                assert err.code == grpc.StatusCode.RESOURCE_EXHAUSTED, err
                return made, err
        raise AssertionError("never refused")

    try:
        with BridgeClient(w.address, channel_options=own) as bystander, \
                BridgeClient(w.address, channel_options=own) as stranger:
            kept = bystander.call(make)                               # in `default`
            for _ in range(30):                                       # the stranger fills `default`...
                stranger.call(make)
            assert bystander.call(Target.get(kept, "world_size")) == 1    # ... and evicts only its own
            # sessions: of 8, its host may hold 6, of which the bystander's `default` is one: 3.75
            made, err = until_refused(stranger, lambda i: f"s-{i}")
            assert made == 3 and err.reason == "max_sessions" and "this connection holds 3 sessions" in err.details, err
            # refs: of 40, its host may hold 30, of which the bystander's one: 21.75 (8 in `default`)
            made, err = until_refused(stranger, lambda i: f"s-{i % 3}")
            assert made == 21 - 8 - 3 and err.reason == "max_refs_per_client", (made, err)
            assert "this connection holds 21 refs, its share" in err.details, err.details
            # the bystander on the same host still makes refs, and a session: 3/4 of what the host has left
            assert [bystander.call(make, session_id="mine") for _ in range(5)]
            made, err = until_refused(bystander, lambda i: "mine")
            assert made == 0 and "this connection holds 6 refs" in err.details, err.details
    finally:
        w.stop()


@pytest.fixture()
def slow_worker(tmp_path: Path) -> Iterator[WorkerProcess]:
    """A worker whose clients' process groups may have one rank from elsewhere: the tests' own peer."""
    w = start_worker(tmp_path, "--outside-ranks", "1", name="slow")
    yield w
    w.stop()


def test_a_process_group_has_no_more_ranks_than_the_pool_lets_it(client: BridgeClient) -> None:
    """By default a client's group has only the pool's ranks (here one): rank 0 of two would wait
    for a peer that never comes, in a thread no deadline takes back (torch waits 30 minutes), the
    exclusive lane with it. Refused at once; a group of one still forms."""
    for call in (lambda: client.call(f"{D}.stateless_init_torch_distributed_process_group", "127.0.0.1", free_port(),
                                     0, 2, "gloo", timeout=10),
                 lambda: client.call(f"{D}.init_distributed_environment", kwargs=dict(
                     world_size=2, rank=0, distributed_init_method=f"tcp://127.0.0.1:{free_port()}", backend="gloo"),
                     timeout=10)):
        with pytest.raises(CallError) as err:
            call()
        assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION and err.value.reason == "no such ranks", err.value
        assert "outside_ranks" in err.value.details
    # A rank the group does not have would wait as a peer for the store at its port, as long (rank 1 of
    # 1 wedged the exclusive lane, and twenty in the shared lane took every thread): refused by name.
    for rank in (1, -5):
        for call in (lambda: client.call(f"{D}.stateless_init_torch_distributed_process_group", "127.0.0.1",
                                         free_port(), rank, 1, "gloo", timeout=10),
                     lambda: client.call(f"{D}.init_distributed_environment", kwargs=dict(
                         world_size=1, rank=rank, distributed_init_method=f"tcp://127.0.0.1:{free_port()}",
                         backend="gloo"), timeout=10)):
            with pytest.raises(CallError) as err:
                call()
            assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT and err.value.detail.parameter == "rank", \
                err.value
            assert f"expected a rank of the group's 1 (0 to 0), got {rank}" in err.value.details, err.value.details
    group = client.call(f"{D}.stateless_init_torch_distributed_process_group", "127.0.0.1", free_port(), 0, 1, "gloo",
                        timeout=30)
    assert group is not None
    client.call(f"{D}.stateless_destroy_torch_distributed_process_group", group, timeout=30)


def test_a_process_group_listens_only_where_it_meets(worker: WorkerProcess, client: BridgeClient) -> None:
    """torch's rendezvous store listens on every interface whatever host it is given, and gloo at
    the address the machine's name resolves to: a group made "at 127.0.0.1" took keys from anyone
    who could reach the machine. Every socket the worker listens on stays at loopback."""
    import ipaddress

    import psutil
    port = free_port()
    group = client.call(f"{D}.stateless_init_torch_distributed_process_group", "127.0.0.1", port, 0, 1, "gloo",
                        timeout=30)
    try:
        listening = [c.laddr for c in psutil.Process(worker.proc.pid).net_connections(kind="inet")
                     if c.status == psutil.CONN_LISTEN]
        assert any(a.port == port for a in listening), listening
        mapped = [getattr(ipaddress.ip_address(a.ip), "ipv4_mapped", None) or ipaddress.ip_address(a.ip)
                  for a in listening]           # gRPC listens at 127.0.0.1 through an IPv6 socket
        assert all(ip.is_loopback for ip in mapped), (port, listening)
    finally:
        client.call(f"{D}.stateless_destroy_torch_distributed_process_group", group, timeout=30)
        client.release(group)


def test_a_process_group_at_a_port_in_use_is_a_failed_precondition(worker: WorkerProcess,
                                                                    client: BridgeClient) -> None:
    in_use = int(worker.address.rpartition(":")[2])           # the worker's own
    with pytest.raises(CallError) as err:
        client.call(f"{D}.stateless_init_torch_distributed_process_group", "127.0.0.1", in_use, 0, 1, "gloo",
                    timeout=60)
    assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION, err.value
    assert "DistNetworkError" in err.value.details and str(in_use) in err.value.details, err.value.details
    assert client.call(f"{D}.divide", 10, 5) == 2


def test_process_groups_take_at_most_a_quarter_of_the_workers_open_files(tmp_path: Path) -> None:
    """Each group holds ~13 sockets and files while its ref lives; 1,532 of them took a worker to
    its limit of open files, and it died (its engine could not be rebuilt). Past a quarter of the
    limit a new group is refused, the worker serves on, and releasing groups makes room again."""
    import resource

    import psutil
    w = start_worker(tmp_path, name="groups")
    try:
        process = psutil.Process(w.proc.pid)
        _, hard = resource.prlimit(w.proc.pid, resource.RLIMIT_NOFILE)
        resource.prlimit(w.proc.pid, resource.RLIMIT_NOFILE, ((process.num_fds() + 40) * 4, hard))
        with BridgeClient(w.address) as c:
            groups = []
            with pytest.raises(CallError) as err:
                for _ in range(20):
                    groups.append(c.call(f"{D}.stateless_init_torch_distributed_process_group", "127.0.0.1",
                                         free_port(), 0, 1, "gloo", timeout=30))
            assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED, err.value
            # the worker-wide quarter, or first this client's share of it (three quarters of the room left)
            assert err.value.reason == "too many open files", err.value
            assert "25% of its limit" in err.value.details or "holds at most 75%" in err.value.details, err.value
            assert 1 <= len(groups) < 20, len(groups)
            assert c.call(f"{D}.divide", 10, 5) == 2                      # the worker serves on
            for group in groups:
                c.call(f"{D}.stateless_destroy_torch_distributed_process_group", group, timeout=30)
                c.release(group)
            again = c.call(f"{D}.stateless_init_torch_distributed_process_group", "127.0.0.1", free_port(), 0, 1,
                           "gloo", timeout=30)
            assert again is not None
    finally:
        w.stop()


def test_one_identity_holds_at_most_its_share_of_the_files_clients_objects_hold(tmp_path: Path) -> None:
    """The open files a worker lets clients' objects take are every client's, authenticated or not:
    one identity's 381 process groups took them all, and every other identity's calls that make
    anything were refused. What an object opened when it was made counts against its maker's share,
    three quarters of what the others leave."""
    import resource

    import psutil
    tokens = tmp_path / "tokens"
    tokens.write_text("alice:alice-token-0123456789abcdef\nbob:bob-token-0123456789abcdef0\n")
    tokens.chmod(0o600)
    w = start_worker(tmp_path, "--token-file", str(tokens), name="files")
    group = (f"{D}.stateless_init_torch_distributed_process_group", "127.0.0.1")
    try:
        process = psutil.Process(w.proc.pid)
        with BridgeClient(w.address, token="alice-token-0123456789abcdef") as alice, \
                BridgeClient(w.address, token="bob-token-0123456789abcdef0") as bob:
            base = process.num_fds()
            mine = [alice.call(*group, free_port(), 0, 1, "gloo", timeout=30)]
            each = process.num_fds() - base
            assert each >= 4, each
            # clients' objects may now hold 4.5 groups' files together: alice three quarters of that
            _, hard = resource.prlimit(w.proc.pid, resource.RLIMIT_NOFILE)
            resource.prlimit(w.proc.pid, resource.RLIMIT_NOFILE, ((base + each * 9 // 2) * 4, hard))
            # A group kept by a second ref, minted by a read, with the ref it was charged to released:
            # charged to nobody once, so alice could fill the room for everyone. The charge is the
            # object's while it lives.
            config = alice.call("vllm.config.VllmConfig")
            with pytest.raises(CallError) as err:
                for _ in range(8):
                    made = alice.call(*group, free_port(), 0, 1, "gloo", timeout=30)
                    manager = alice.call(f"{FC}.set_forward_context", made, config)
                    alice.call(Target.method(manager, "__enter__"))
                    mine.append(alice.call(f"{FC}.get_forward_context")["attn_metadata"])
                    alice.call(Target.method(manager, "__exit__"))
                    alice.release(made)
                    alice.release(manager)
            assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and err.value.reason == "too many open files"
            assert "holds at most 75% of what the others leave" in err.value.details, err.value.details
            assert len(mine) == 3, len(mine)
            theirs = bob.call(*group, free_port(), 0, 1, "gloo", timeout=30)     # bob still makes one
            bob.release(theirs)
            alice.release(mine[0])
            mine[0] = alice.call(*group, free_port(), 0, 1, "gloo", timeout=30)   # released: room again
            for ref in mine:
                alice.release(ref)
    finally:
        w.stop()


def test_suppress_stdout_is_shared_silences_no_log_and_ends_with_the_last(worker: WorkerProcess,
                                                                          client: BridgeClient) -> None:
    """An entered `suppress_stdout` points the worker's stdout at /dev/null for every client until it
    is exited, holding two files: 9,500 of them took a worker to its open-file limit and it died, and
    vLLM's own, two exited out of order, left its output on /dev/null for good. One in force and
    refused to everyone else let a stranger that entered it and went idle hide every vLLM log line
    and keep every other client out. Now any client may enter one; the output comes back when the
    last is exited or released, in any order; and vLLM's log lines reach the worker's output all along."""
    import os
    stdout = os.readlink(f"/proc/{worker.proc.pid}/fd/1")
    first = client.call(f"{D}.suppress_stdout")
    client.call(Target.method(first, "__enter__"))
    assert os.readlink(f"/proc/{worker.proc.pid}/fd/1") == "/dev/null"
    with pytest.raises(CallError) as err:
        client.call(Target.method(first, "__enter__"))
    assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION and "entered already" in err.value.details
    with BridgeClient(worker.address) as other:
        second = other.call(f"{D}.suppress_stdout")
        other.call(Target.method(second, "__enter__"))             # a second client enters too
        port = free_port()
        other.call(f"{D}.init_distributed_environment", 1, 0, f"tcp://127.0.0.1:{port}", 0, "gloo", timeout=30)
        other.call(f"{D}.destroy_distributed_environment")
        logged = f"distributed_init_method=tcp://127.0.0.1:{port}"
        deadline = time.monotonic() + 10
        while logged not in worker.log.read_text(errors="replace") and time.monotonic() < deadline:
            time.sleep(0.1)
        assert logged in worker.log.read_text(errors="replace")    # vLLM's log, suppressed or not
        assert client.call(Target.method(first, "__exit__")) is False      # the first out ...
        assert os.readlink(f"/proc/{worker.proc.pid}/fd/1") == "/dev/null"  # ... the other's still in force
        assert other.release(second) == 1                      # never exited: its release ends it
    assert os.readlink(f"/proc/{worker.proc.pid}/fd/1") == stdout
    client.release(first)
    again = client.call(f"{D}.suppress_stdout")
    client.call(Target.method(again, "__enter__"))
    client.call(Target.method(again, "__exit__"))
    assert os.readlink(f"/proc/{worker.proc.pid}/fd/1") == stdout
    assert client.call(f"{D}.divide", 10, 5) == 2


def test_what_a_closed_connection_made_goes_after_orphan_ref_s(tmp_path: Path) -> None:
    """Without authentication only the connection that made a ref could release it by session: a
    client that entered `suppress_stdout` and made process groups, then went away, left the worker
    silent and short of open files for good. Once its connection has closed and nothing has used
    them for orphan_ref_s, they are released, and presenting one says why; the refs of a connection
    still open stay."""
    import os

    import psutil
    own = [("grpc.use_local_subchannel_pool", 1)]      # each client its own connection
    w = start_worker(tmp_path, "--orphan-ref-s", "1", name="orphans")
    try:
        process = psutil.Process(w.proc.pid)
        stdout = os.readlink(f"/proc/{w.proc.pid}/fd/1")
        with BridgeClient(w.address, channel_options=own) as stays:
            kept = stays.call(f"{D}.suppress_stdout")
            stays.call(Target.method(kept, "__enter__"))    # the first suppression moves vLLM's log to a
            stays.call(Target.method(kept, "__exit__"))     # copy of stdout, once: one file for good
            files = process.num_fds()
            with BridgeClient(w.address, channel_options=own) as goes:
                entered = goes.call(f"{D}.suppress_stdout")
                goes.call(Target.method(entered, "__enter__"))
                groups = [goes.call(f"{D}.stateless_init_torch_distributed_process_group", "127.0.0.1", free_port(),
                                    0, 1, "gloo", timeout=30) for _ in range(3)]
                assert process.num_fds() > files + 3 * 5
                assert os.readlink(f"/proc/{w.proc.pid}/fd/1") == "/dev/null"
            # watched from outside (a call naming a ref would count as its use)
            deadline = time.monotonic() + 30
            while (os.readlink(f"/proc/{w.proc.pid}/fd/1") != stdout or process.num_fds() > files + 2) and \
                    time.monotonic() < deadline:
                time.sleep(0.2)
            assert os.readlink(f"/proc/{w.proc.pid}/fd/1") == stdout      # its suppression ended
            assert process.num_fds() <= files + 2, (process.num_fds(), files)      # the groups' sockets closed
            for ref in (entered, *groups):
                with pytest.raises(CallError) as err:
                    stays.call(Target.method(ref, "__exit__"))
                assert err.value.code == grpc.StatusCode.NOT_FOUND and "(orphan_ref_s)" in err.value.details, \
                    err.value
            stays.call(Target.method(kept, "__enter__"))            # the open connection's ref stays
            assert os.readlink(f"/proc/{w.proc.pid}/fd/1") == "/dev/null"
            assert stays.call(Target.method(kept, "__exit__")) is False
    finally:
        w.stop()


def test_what_closed_connections_left_goes_soon_once_their_host_is_refused_refs(tmp_path: Path) -> None:
    """Refs of closed connections counted in their host's share for orphan_ref_s (an hour): a stranger
    that made its share of refs and left kept every client of its host from any ref that long. Once
    the host is refused a ref, what its closed connections left unused for PRESSED_ORPHAN_S goes."""
    from bridge_server.worker.reclaim import PRESSED_ORPHAN_S
    own = [("grpc.use_local_subchannel_pool", 1)]
    w = start_worker(tmp_path, "--max-refs-per-client", "40", name="pressed")
    try:
        left: list[Any] = []
        for _ in range(10):        # connections, each taking its share of what its host has left, then gone
            with BridgeClient(w.address, channel_options=own) as goes:
                made = len(left)
                try:
                    while len(left) < 100:
                        left.append(goes.call("vllm.config.ParallelConfig"))
                except CallError as err:
                    assert err.reason == "max_refs_per_client", err
                if len(left) == made:
                    break           # the host's whole share is held
        assert len(left) == 30, len(left)     # three quarters of 40
        t0 = time.monotonic()
        with BridgeClient(w.address, channel_options=own) as later:
            with pytest.raises(CallError) as err:
                later.call("vllm.config.ParallelConfig")
            assert err.value.reason == "max_refs_per_client", err.value      # the host's share is taken
            while time.monotonic() - t0 < PRESSED_ORPHAN_S + 20:
                try:
                    later.call("vllm.config.ParallelConfig")
                    break
                except CallError as e:
                    assert e.reason == "max_refs_per_client", e
                    time.sleep(1)
            else:
                pytest.fail("the closed connection's refs still counted")
            with pytest.raises(CallError) as err:
                later.call(Target.get(left[0], "world_size"))
            assert err.value.code == grpc.StatusCode.NOT_FOUND and "refused refs for its share" in err.value.details
    finally:
        w.stop()


@pytest.mark.parametrize("args,kwargs,parameter", [
    ((1, 2, 3), {}, "exc_type"), ((None, "x", None), {}, "exc_value"), ((None,), {}, ""),
    ((None, None, None, None), {}, "args[3]"), ((), {"typ": "ValueError", "value": None, "traceback": None}, "typ"),
])
def test_an_exit_takes_three_nones_or_nothing_and_a_refused_one_leaves_the_manager_entered(
        worker: WorkerProcess, client: BridgeClient, args: tuple[Any, ...], kwargs: dict[str, Any],
        parameter: str) -> None:
    """An exit's arguments say how its block ended, and a client has no exception to give: anything
    but three Nones went into the manager, which let go of the worker's stdout and then failed on it as
    a bare TypeError, leaving the output on /dev/null. Refused by name, the manager stays entered and
    its exit still restores the output."""
    import os
    stdout = os.readlink(f"/proc/{worker.proc.pid}/fd/1")
    manager = client.call(f"{D}.suppress_stdout")
    client.call(Target.method(manager, "__enter__"))
    try:
        with pytest.raises(CallError) as err:
            client.call(Target.method(manager, "__exit__"), *args, kwargs=kwargs)
        assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT, err.value
        assert "expected no arguments or three Nones" in err.value.details, err.value.details
        assert err.value.detail.parameter == parameter, err.value.detail
        assert os.readlink(f"/proc/{worker.proc.pid}/fd/1") == "/dev/null"
        assert client.call(Target.method(manager, "__exit__"), None, None, None) is False
        assert os.readlink(f"/proc/{worker.proc.pid}/fd/1") == stdout
    finally:
        client.release(manager)
    assert os.readlink(f"/proc/{worker.proc.pid}/fd/1") == stdout


@pytest.mark.parametrize("target,args", [("get_tcp_uri", ("127.0.0.1", 70_000)),
                                         ("get_distributed_init_method", ("127.0.0.1", -5)),
                                         ("stateless_init_torch_distributed_process_group",
                                          ("127.0.0.1", 65_536, 0, 1, "gloo"))])
def test_a_port_is_a_tcp_port(client: BridgeClient, target: str, args: tuple[Any, ...]) -> None:
    with pytest.raises(CallError) as err:
        client.call(f"{D}.{target}", *args, timeout=30)
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT, err.value
    assert f"parameter port: expected a TCP port (0 to 65,535), got {args[1]}" in err.value.details, err.value.details
    assert err.value.detail.parameter == "port"
    assert client.call(f"{D}.get_tcp_uri", "127.0.0.1", 65_535) == "tcp://127.0.0.1:65535"


def test_an_init_method_names_a_tcp_port(client: BridgeClient) -> None:
    with pytest.raises(CallError) as err:
        client.call(f"{D}.init_distributed_environment", 1, 0, "tcp://127.0.0.1:70000", timeout=30)
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT, err.value
    assert "names no TCP port" in err.value.details and err.value.detail.parameter == "distributed_init_method"


FAKE_CALLS: dict[str, Callable[[torch.Tensor], tuple[Any, ...]]] = {
    "all_reduce_fake": lambda t: (t, "g"),
    "reduce_scatter_fake": lambda t: (t, 0, 1, "g"),
    "all_gather_fake": lambda t: (t, 0, 1, "g"),
}


def test_a_fake_collectives_result_holds_nothing_the_worker_had_in_memory(worker: WorkerProcess,
                                                                          client: BridgeClient) -> None:
    """vLLM's fakes return `torch.empty` memory, whatever the worker's heap held there last: a
    stranger read a bystander's prompt back with all_reduce_fake. Each fake's result is zeros, of the
    shape and dtype the fake promises, however the heap was used before (here: by the tensors of
    ones the calls before sent). Every documented fake is covered (the fused matmul one computes its
    result and is zeroed all the same; it needs float8 matrices, which this CPU has no kernel for)."""
    fakes = {e.name.rpartition(".")[2] for e in client.describe(D).entries if e.name.endswith("_fake")}
    assert set(FAKE_CALLS) | {"patched_fused_scaled_matmul_reduce_scatter_fake"} == fakes, fakes
    with BridgeClient(worker.address) as bystander:
        for size in (1_000, 4_096, 30_000, 250_000):
            for name, args in FAKE_CALLS.items():
                for _ in range(3):
                    bystander.call(f"{D}.divide", 6, 3)
                    result = client.call(f"{D}.{name}", *args(torch.full((size,), 7.0)))
                    assert result.shape == (size,) and result.dtype == torch.float32, (name, result.shape)
                    assert not result.any(), (name, size, result.nonzero()[:5])


@pytest.mark.parametrize("name,args,code,said", [
    ("all_gather_fake", (torch.ones(4), 5, 2, "g"), grpc.StatusCode.INVALID_ARGUMENT,
     "parameter dim: expected a dimension of the tensor's 1 (-1 to 0), got 5"),
    ("reduce_scatter_fake", (torch.ones(4), 0, 0, "g"), grpc.StatusCode.INVALID_ARGUMENT,
     "parameter world_size: expected 1 to 1,024 ranks, got 0"),
    ("all_gather_fake", (torch.ones(1_000_000), 0, 1_000, "g"), grpc.StatusCode.RESOURCE_EXHAUSTED,
     "a result of 4,000,000,000 bytes, over this server's limit"),
    ("patched_fused_scaled_matmul_reduce_scatter_fake",
     (torch.ones(200_000, 16, dtype=torch.float8_e4m3fn), torch.ones(16, 20_000, dtype=torch.float8_e4m3fn),
      torch.tensor(1.0), torch.tensor(1.0), "sum", 0, 0, "g", [200_000, 20_000], None, None, "float32", False),
     grpc.StatusCode.RESOURCE_EXHAUSTED, "makes a result of 16,000,000,000 bytes with 64,000,000,000"),
    ("patched_fused_scaled_matmul_reduce_scatter_fake",      # nothing to multiply, a result all the same
     (torch.ones(16_384, 0), torch.ones(0, 16_384), torch.tensor(1.0), torch.tensor(1.0), "sum", 0, 0, "g",
      [16_384, 16_384]),
     grpc.StatusCode.RESOURCE_EXHAUSTED, "makes a result of 1,073,741,824 bytes"),
    ("patched_fused_scaled_matmul_reduce_scatter_fake",
     (torch.ones(8, 16), torch.ones(12, 4), torch.tensor(1.0), torch.tensor(1.0), "sum", 0, 0, "g", [8, 4]),
     grpc.StatusCode.INVALID_ARGUMENT, "parameter B: expected 16 rows (A's last dimension), got 12"),
])
def test_a_fakes_shape_is_one_it_can_make(client: BridgeClient, name: str, args: tuple[Any, ...],
                                           code: grpc.StatusCode, said: str) -> None:
    """A dim past the tensor's (a bare IndexError), a world size of 0 (ZeroDivisionError), a
    gathered result of gigabytes, which zeroing would touch page by page, or a fake matmul whose few
    MiB of float8 multiply into gigabytes, are refused by name."""
    with pytest.raises(CallError) as err:
        client.call(f"{D}.{name}", *args)
    assert err.value.code == code and said in err.value.details, err.value.details
    assert client.call(f"{D}.divide", 10, 5) == 2


def test_what_makes_an_object_per_part_makes_no_more_than_the_request_paid_for(client: BridgeClient) -> None:
    """`u_batch_slices` is `list(...)`: of a [N, 0] tensor (60 bytes) it made N tensor objects (4
    million: 2 GB); `split_tensor_along_last_dim` of a [0, N] tensor N ways the same (5 million: 3 GB).
    Each is refused at once, and what the request's own items pay for still works."""
    started = time.monotonic()
    for bad in (torch.zeros(50_000_000, 0), "x" * 1000, {"a": 1}):
        with pytest.raises(CallError) as err:
            client.call("vllm.forward_context.u_batch_slices", bad, timeout=30)
        assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT and err.value.detail is not None, err.value
        assert err.value.detail.parameter == "args[0]" and "expected a list or a tuple" in err.value.details
    assert client.call("vllm.forward_context.u_batch_slices", [1, 2]) == [1, 2]
    assert client.call("vllm.forward_context.u_batch_slices") == []
    with pytest.raises(CallError) as err:
        client.call(f"{D}.split_tensor_along_last_dim", torch.zeros(0, 50_000_000), 50_000_000, timeout=30)
    assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and err.value.reason == "too many parts", err.value
    assert time.monotonic() - started < 10
    assert len(client.call(f"{D}.split_tensor_along_last_dim", torch.zeros(0, 1024), 1024)) == 1024
    for module in (D, "vllm.forward_context"):      # vLLM's init_logger is in both: bounded in both
        with pytest.raises(CallError) as err:
            client.call(f"{module}.init_logger", "x." * 30_000, timeout=30)
        assert err.value.detail is not None and err.value.detail.parameter == "name", err.value
        assert f"{module}.init_logger: parameter name: 60,000 characters is over the limit" in err.value.details
    assert client.call(f"{D}.divide", 10, 5) == 2


def test_one_client_adds_at_most_its_share_of_the_loggers_a_worker_keeps(tmp_path: Path) -> None:
    """A worker keeps every logger init_logger makes (and a placeholder per dotted prefix) for its
    life, at most 10,000: one stranger's names left every other client unable to name a new one.
    One client (an identity, else a host) adds at most 1,250; the names that exist stay anyone's."""
    w = start_worker(tmp_path, name="loggers")
    try:
        with BridgeClient(w.address) as client:
            made = 0
            with pytest.raises(CallError) as err:
                for i in range(100):          # 97 new loggers a name: its prefixes are placeholders too
                    client.call(f"{D}.init_logger", f"p{i:02d}." + ".".join(["x"] * 96), timeout=30)
                    made += 1
            assert made == 12, made             # 12 x 97 = 1,164; a 13th would pass 1,250
            assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and err.value.reason == "too many loggers"
            assert "this client has added 1,164 loggers to this worker" in err.value.details, err.value
            assert client.call(f"{D}.init_logger", "p00." + ".".join(["x"] * 96)) is not None    # an existing one
    finally:
        w.stop()


def test_token_counts_are_integer_tensors_however_they_get_there(client: BridgeClient) -> None:
    """A float8 (or complex, or bool) tensor of token counts was taken, and every DPMetadata method and
    sequence-parallel helper then failed in torch as UNIMPLEMENTED, naming nothing."""
    counts = torch.zeros(2, dtype=torch.float8_e4m3fn)
    with pytest.raises(CallError) as err:
        client.call("vllm.forward_context.DPMetadata", torch.tensor(5), counts)
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT and err.value.detail is not None, err.value
    assert err.value.detail.parameter == "num_tokens_across_dp_cpu" and "dtype float8_e4m3fn" in err.value.details
    with pytest.raises(CallError) as err:
        client.call("vllm.forward_context._compute_sp_num_tokens", torch.ones(2, dtype=torch.complex64), 2)
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT, err.value
    with pytest.raises(CallError) as err:
        client.call("vllm.forward_context.DPMetadata.make", {"data_parallel_size": 2}, 5,
                    torch.ones(2, dtype=torch.bool))
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT and "dtype bool" in err.value.details, err.value
    dp = client.call("vllm.forward_context.DPMetadata", torch.tensor(5), torch.tensor([5, 3]))
    assert client.call(Target.method(dp, "cu_tokens_across_sp"), 2).tolist() == [3, 6, 8, 10]
    client.release(dp)


def test_no_repr_a_client_reads_tells_where_the_heap_lies(client: BridgeClient) -> None:
    """Default reprs show memory addresses ("<function divide at 0x7faa...>"), which defeat address
    randomization: a ref's repr and Describe's defaults show none."""
    divide = client.call(f"{D}.resolve_obj_by_qualname", f"{D}.divide")
    platform = client.call("vllm.forward_context.current_platform")
    for ref in (divide, platform):
        assert ref.repr and " at 0x" not in ref.repr, ref.repr
    assert divide.repr == "<function divide>", divide.repr
    described = client.describe("")
    shown = [p.default_repr for e in described.entries for p in e.parameters if p.default_repr]
    assert shown and not [r for r in shown if " at 0x" in r], [r for r in shown if " at 0x" in r]


def _rendezvous_peer(port: int) -> None:
    """Rank 1 of a 2-rank gloo group: completes the rendezvous rank 0 is blocked in."""
    from vllm.distributed import stateless_init_torch_distributed_process_group
    stateless_init_torch_distributed_process_group("127.0.0.1", port, 1, 2, "gloo")


def test_the_worker_enforces_a_deadline_during_a_slow_call_and_keeps_serving(slow_worker: WorkerProcess) -> None:
    port = free_port()
    with BridgeClient(slow_worker.address) as c:
        # Rank 0 of a 2-rank group blocks until rank 1 arrives: a real slow vLLM call. No gRPC deadline is
        # set by the client here, only the bridge's timeout option, so the DEADLINE_EXCEEDED is the worker's.
        start = time.monotonic()
        with pytest.raises(CallError) as err:
            c.call(f"{D}.stateless_init_torch_distributed_process_group", "127.0.0.1", port, 0, 2, "gloo",
                   timeout_s=1.0)
        elapsed = time.monotonic() - start
        assert err.value.code == grpc.StatusCode.DEADLINE_EXCEEDED and err.value.category == "timeout"
        assert "stateless_init_torch_distributed_process_group" in err.value.details
        assert elapsed < 5
        # The same through the gRPC deadline.
        with pytest.raises(CallError) as err:
            c.call(f"{D}.stateless_init_torch_distributed_process_group", "127.0.0.1", free_port(), 0, 2, "gloo",
                   timeout=1.0)
        assert err.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
        assert c.call(f"{D}.divide", 10, 5) == 2
        assert c.call(Target.get(c.call("vllm.config.ParallelConfig"), "world_size")) == 1
    peer = threading.Thread(target=_rendezvous_peer, args=(port,), daemon=True)
    peer.start()
    peer.join(30)


def test_calls_given_up_in_the_workers_threads_are_bounded_per_client_and_said_in_health(tmp_path: Path) -> None:
    """A blocking call given up at its deadline runs on in its thread (C code cannot be pre-empted):
    twenty groups waiting for a peer that never came took every thread of the shared lane, every
    blocking call then timed out, and health said SERVING; twenty sent at once from one connection
    all passed a check of calls already given up. A client (its identity, else its host) holds at
    most three quarters of the threads the others leave, running or given up, its other calls
    waiting; with its share given up it is refused; a worker whose threads all run such calls says
    so in health; all of it ends when the calls do."""
    import psutil
    names = [f"c{i}" for i in range(4)]
    tokens = tmp_path / "tokens"
    tokens.write_text("".join(f"{n}:{n}-token-0123456789abcdef\n" for n in names))
    tokens.chmod(0o600)
    w = start_worker(tmp_path, "--outside-ranks", "1", "--token-file", str(tokens), name="abandon")
    listening: list[int] = []
    try:
        clients = [BridgeClient(w.address, token=f"{n}-token-0123456789abcdef") for n in names]
        health = health_pb2_grpc.HealthStub(grpc.insecure_channel(w.address))

        def status() -> int:
            return health.Check(health_pb2.HealthCheckRequest(), timeout=5).status

        def give_up(c: BridgeClient, calls: int) -> list[CallError]:
            """`calls` groups at once, each rank 0 of 2 waiting for rank 1 in a shared thread, given up."""
            ports = [free_port() for _ in range(calls)]
            errors: list[CallError] = []

            def one(port: int) -> None:
                try:
                    c.call(f"{D}.stateless_init_torch_distributed_process_group", "127.0.0.1", port, 0, 2, "gloo",
                           timeout_s=2.0)
                except CallError as err:
                    errors.append(err)
            threads = [threading.Thread(target=one, args=(port,)) for port in ports]
            for t in threads:
                t.start()
            for t in threads:
                t.join(30)
            time.sleep(0.5)
            open_ports = {c.laddr.port for c in psutil.Process(w.proc.pid).net_connections(kind="tcp")
                          if c.status == psutil.CONN_LISTEN}
            listening.extend(p for p in ports if p in open_ports)      # those that ran: their peers are owed
            return errors

        first = clients[0]
        errors = give_up(first, 16)          # alone, it may hold 12 of the 16 threads: 4 wait, in vain
        assert len(errors) == 16 and {e.code for e in errors} == {grpc.StatusCode.DEADLINE_EXCEEDED}, errors
        waited = [e for e in errors if "waiting for a thread: this client's calls hold 12" in e.details]
        assert len(waited) == 4 and len(listening) == 12, (errors, listening)
        with pytest.raises(CallError) as err:          # its twelve threads all run calls it gave up
            first.call("vllm.config.ParallelConfig", timeout=10)
        assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and err.value.reason == "abandoned calls", \
            err.value
        assert "12 of this client's calls" in err.value.details and "(12: three quarters" in err.value.details, \
            err.value
        assert first.call(f"{D}.divide", 8, 2) == 4     # an inline helper needs no thread
        # the four left are the others': three quarters of them for the next client, and so on
        assert clients[1].call(Target.get(clients[1].call("vllm.config.ParallelConfig"), "world_size")) == 1
        assert status() == health_pb2.HealthCheckResponse.SERVING
        assert len(give_up(clients[1], 4)) == 4 and len(listening) == 15
        assert status() == health_pb2.HealthCheckResponse.SERVING
        assert len(give_up(clients[2], 2)) == 2 and len(listening) == 16
        deadline = time.monotonic() + 10     # health is recomputed within a second
        while status() != health_pb2.HealthCheckResponse.NOT_SERVING and time.monotonic() < deadline:
            time.sleep(0.2)
        assert status() == health_pb2.HealthCheckResponse.NOT_SERVING
        peers = [threading.Thread(target=_rendezvous_peer, args=(port,), daemon=True) for port in listening]
        for peer in peers:
            peer.start()
        for peer in peers:
            peer.join(60)
        deadline = time.monotonic() + 20
        while status() != health_pb2.HealthCheckResponse.SERVING and time.monotonic() < deadline:
            time.sleep(0.2)
        assert status() == health_pb2.HealthCheckResponse.SERVING
        assert first.call(Target.get(first.call("vllm.config.ParallelConfig"), "world_size")) == 1
        for c in clients:
            c.close()
    finally:
        w.stop()


def test_state_changing_calls_run_one_at_a_time_while_other_calls_flow(slow_worker: WorkerProcess) -> None:
    port = free_port()
    init = f"tcp://127.0.0.1:{port}"
    results: list[object] = []
    with BridgeClient(slow_worker.address) as c:
        # A: rank 0 of a world of 2 blocks in the exclusive lane until rank 1 joins.
        a = threading.Thread(target=lambda: results.append(c.call(
            f"{D}.init_distributed_environment", kwargs=dict(world_size=2, rank=0, distributed_init_method=init,
                                                             local_rank=0, backend="gloo"), timeout=60)))
        a.start()
        time.sleep(1.0)
        # B touches process-wide state too: it waits behind A, and its deadline passes while it waits.
        with pytest.raises(CallError) as err:
            c.call(f"{FC}.is_forward_context_available", timeout_s=0.5)
        assert err.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
        assert "waiting for the exclusive lane" in err.value.details
        # C is pure: it runs meanwhile.
        assert c.call(f"{D}.divide", 8, 2) == 4
        peer = subprocess.Popen([sys.executable, "-c", (
            "from vllm.distributed import init_distributed_environment as i; "
            f"i(world_size=2, rank=1, distributed_init_method={init!r}, local_rank=0, backend='gloo')")])
        a.join(60)
        peer.wait(60)
        assert results == [None]
        assert c.call(f"{D}.get_world_group") is not None
        assert c.call(f"{FC}.is_forward_context_available") is False


def test_a_timeout_profile_applies_when_the_call_has_no_deadline(client: BridgeClient) -> None:
    assert client.call(f"{D}.divide", 9, 3, timeout_profile="batch_job") == 3
    with pytest.raises(CallError) as err:
        client.call(f"{D}.divide", 9, 3, timeout_profile="forever")
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT and MD_TIMEOUT_PROFILE in err.value.details


BAD_CALLS = [
    ("unknown name", lambda c: c.call(f"{D}.devide", 6, 3), grpc.StatusCode.NOT_FOUND, "did you mean vllm.distributed.divide"),
    ("too many args", lambda c: c.call(f"{D}.divide", 6, 3, 1), grpc.StatusCode.INVALID_ARGUMENT, "too many positional arguments"),
    ("missing arg", lambda c: c.call(f"{D}.divide", 6), grpc.StatusCode.INVALID_ARGUMENT, "'denominator'"),
    ("unknown kwarg", lambda c: c.call(f"{D}.divide", 6, 3, kwargs={"denom": 1}), grpc.StatusCode.INVALID_ARGUMENT, "'denom'"),
    ("wrong type", lambda c: c.call(f"{D}.divide", "six", 3), grpc.StatusCode.INVALID_ARGUMENT,
     "expected a number (int or float), got str"),
    ("bad map for a config", lambda c: c.call(f"{FC}.DPMetadata.make", {"no_such_field": 1}, 7, torch.tensor([7])),
     grpc.StatusCode.INVALID_ARGUMENT, "cannot build ParallelConfig"),
    ("private member", lambda c: c.call(Target.method(c.call("vllm.config.ParallelConfig"), "_secret")),
     grpc.StatusCode.PERMISSION_DENIED, "not part of the documented surface"),
    ("unknown ref", lambda c: c.call(Target.method(pb.Ref(id="w0.nope"), "x")), grpc.StatusCode.NOT_FOUND, "w0.nope"),
    ("not a ref id", lambda c: c.call(Target.method(pb.Ref(id="nodot"), "x")), grpc.StatusCode.INVALID_ARGUMENT,
     "'nodot' is not a ref id"),
    ("unknown object", lambda c: c.call(Target.method("no-such-object", "generate")), grpc.StatusCode.NOT_FOUND,
     "no published object 'no-such-object'"),
    ("method as function", lambda c: c.call(f"{FC}.DPMetadata.sp_local_sizes", 2), grpc.StatusCode.INVALID_ARGUMENT,
     "call it on a ref"),
    ("args to an attribute", lambda c: c.call(f"{FC}.track_batchsize", 1), grpc.StatusCode.INVALID_ARGUMENT,
     "takes no arguments"),
    ("a function read as a module attribute", lambda c: c.call(Target(pb.Target(
        kind=pb.Target.MODULE_ATTR, name=f"{D}.destroy_model_parallel"))), grpc.StatusCode.INVALID_ARGUMENT,
     "is a function, and target kind MODULE_ATTR reads a module attribute, and never calls"),
    ("a function built as a class", lambda c: c.call(Target(pb.Target(kind=pb.Target.CONSTRUCTOR, name=f"{D}.divide")),
                                                     6, 3), grpc.StatusCode.INVALID_ARGUMENT,
     "is a function, and target kind CONSTRUCTOR builds a class: use target kind FUNCTION"),
    ("a module attribute built as a class", lambda c: c.call(Target(pb.Target(
        kind=pb.Target.CONSTRUCTOR, name=f"{D}.logger"))), grpc.StatusCode.INVALID_ARGUMENT,
     "is a module attribute, and target kind CONSTRUCTOR builds a class"),
    ("bad affinity", lambda c: c.call(f"{D}.divide", 6, 3, affinity="sometimes"), grpc.StatusCode.INVALID_ARGUMENT,
     "unknown affinity"),
    ("division by zero", lambda c: c.call(f"{D}.divide", 6, 0), grpc.StatusCode.INVALID_ARGUMENT,
     "ZeroDivisionError"),
    ("interval past its limit", lambda c: list(c.stream(f"{D}.divide", 6, 3, stream_interval_s=3600)),
     grpc.StatusCode.INVALID_ARGUMENT, "x-bridge-stream-interval-ms: '3600000' ms is over the limit of 10,000 ms"),
]


@pytest.mark.parametrize("case,call,code,needle", BAD_CALLS, ids=[c[0] for c in BAD_CALLS])
def test_bad_input_gets_a_clear_error_and_the_worker_keeps_its_state(client: BridgeClient, case: str, call: object,
                                                                     code: grpc.StatusCode, needle: str) -> None:
    kept = client.call("vllm.config.ParallelConfig", kwargs={"data_parallel_size": 3})
    with pytest.raises(CallError) as err:
        call(client)  # type: ignore[operator]
    assert err.value.code == code, err.value.details
    assert needle in err.value.details, err.value.details
    assert client.call(Target.get(kept, "data_parallel_size")) == 3


def test_a_coalescing_interval_is_bounded() -> None:
    key = "x-bridge-stream-interval-ms"
    assert parse_metadata(((key, "10000"),)).stream_interval_s == 10.0
    assert parse_metadata(((key, "0"),)).stream_interval_s is None       # 0: every output, as without it
    for raw in ("10001", "10000000000000", "inf"):
        with pytest.raises(BridgeError) as err:
            parse_metadata(((key, raw),))
        assert err.value.parameter == key and "over the limit of 10,000 ms" in err.value.message


def test_parsed_options_are_remembered_but_a_refusal_is_given_every_time() -> None:
    """The unit of option parsing alone: the same pairs give the same options (remembered), a
    malformed value is refused on each call that sends it, never remembered as anything."""
    md = (("x-bridge-session", "s"), ("x-bridge-timeout-ms", "2500"), ("user-agent", "test"))
    first = parse_metadata(md)
    assert (first.session_id, first.timeout_s, first.session_sent) == ("s", 2.5, True)
    assert parse_metadata(list(md)) is first
    assert parse_metadata((("x-bridge-pool", "p"),)).session_sent is False
    bad = (("x-bridge-timeout-ms", "soon"),)
    for _ in range(2):
        with pytest.raises(BridgeError) as err:
            parse_metadata(bad)
        assert err.value.parameter == "x-bridge-timeout-ms" and "'soon'" in err.value.message
    # milliseconds in one form on every path: a Multiplex start's options carry what a header cannot
    for raw in ("١٢٠٠٠", "5_000", " 5 ", "1e3", "nan", "-5", "0x10"):
        with pytest.raises(BridgeError) as err:
            parse_metadata((("x-bridge-stream-timeout-ms", raw),))
        assert err.value.parameter == "x-bridge-stream-timeout-ms" and "ASCII digits, or inf" in err.value.message
    assert parse_metadata((("x-bridge-timeout-ms", "inf"),)).timeout_s is None
    assert parse_metadata((("x-bridge-timeout-ms", "12.5"),)).timeout_s == 0.0125


def test_malformed_values_on_the_wire_are_refused_by_path(worker: WorkerProcess) -> None:
    with grpc.insecure_channel(worker.address) as channel:
        stub = pb_grpc.BridgeStub(channel)
        cases = [
            (pb.Value(tensor=pb.Tensor(dtype="float32", shape=[4], data=b"\x00" * 3)), "args[0]"),
            (pb.Value(tensor=pb.Tensor(dtype="float33", shape=[1], data=b"\x00" * 4)), "float33"),
            (pb.Value(big_int="12x"), "args[0]"),
            (pb.Value(), "args[0]"),
            (pb.Value(set=pb.Items(items=[pb.Value(list=pb.Items())])), "args[0]"),
        ]
        for value, needle in cases:
            req = pb.CallRequest(target=pb.Target(kind=pb.Target.FUNCTION, name=f"{D}.divide"), args=[value, value])
            with pytest.raises(grpc.RpcError) as err:
                stub.Call(req)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert needle in err.value.details(), err.value.details()
        with pytest.raises(grpc.RpcError) as err:
            stub.Call(pb.CallRequest(target=pb.Target(kind=pb.Target.METHOD, name="x")))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "receiver" in err.value.details()


def test_stock_health_and_reflection_services_answer(worker: WorkerProcess) -> None:
    with grpc.insecure_channel(worker.address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", "vllm_bridge.v1.Bridge"):
            assert health.Check(health_pb2.HealthCheckRequest(service=service)).status == \
                health_pb2.HealthCheckResponse.SERVING
        refl = reflection_pb2_grpc.ServerReflectionStub(channel)
        replies = list(refl.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")])))
        names = {s.name for s in replies[0].list_services_response.service}
        assert {"vllm_bridge.v1.Bridge", "grpc.health.v1.Health"} <= names


def test_reflection_describes_the_contract_and_nothing_else(worker: WorkerProcess) -> None:
    """Reflection answers from the process's descriptors. The process's own pool holds every file its
    libraries loaded (protobuf's `descriptor.proto`, vLLM's and torch's protos...), more than the
    documents describe; the server's pool holds the served services' files only."""
    with grpc.insecure_channel(worker.address) as channel:
        refl = reflection_pb2_grpc.ServerReflectionStub(channel)
        asked = [reflection_pb2.ServerReflectionRequest(file_by_filename="vllm_bridge/v1/bridge.proto"),
                 reflection_pb2.ServerReflectionRequest(file_containing_symbol="vllm_bridge.v1.Pool"),
                 reflection_pb2.ServerReflectionRequest(file_containing_symbol="grpc.health.v1.Health"),
                 reflection_pb2.ServerReflectionRequest(file_by_filename="google/protobuf/descriptor.proto"),
                 reflection_pb2.ServerReflectionRequest(
                     file_containing_symbol="google.protobuf.FileDescriptorProto")]
        replies = list(refl.ServerReflectionInfo(iter(asked), timeout=30))
    served = [r.WhichOneof("message_response") for r in replies]
    assert served == ["file_descriptor_response"] * 3 + ["error_response"] * 2, served
    assert all(r.error_response.error_code == grpc.StatusCode.NOT_FOUND.value[0] for r in replies[3:])
    bridge = descriptor_pb2.FileDescriptorProto.FromString(replies[0].file_descriptor_response.file_descriptor_proto[0])
    assert "Bridge" in [s.name for s in bridge.service]


def test_the_open_health_service_keeps_little_for_a_stranger(worker: WorkerProcess) -> None:
    """Health answers without a token, and its servicer keeps a watched name, the request and its bytes
    for as long as the stream lasts: 6 watches of 60 MB names held 1.7 GB of the pool server, 90,000
    small ones from one host 600 MB. A name is at most 256 characters; a host holds 1,024 watches."""
    from bridge_server.wire.open_services import MAX_WATCHES_PER_HOST
    with grpc.insecure_channel(worker.address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        long = health_pb2.HealthCheckRequest(service="s" * 300)
        for call in (lambda: health.Check(long, timeout=10), lambda: next(health.Watch(long, timeout=10))):
            with pytest.raises(grpc.RpcError) as err:
                call()
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value
            assert "service: a name of 300 characters is over the limit of 256" in err.value.details()
        # nor anything past the name: a request is bounded by its bytes, unknown fields and all
        from bridge_server.wire.open_services import MAX_OPEN_REQUEST_BYTES
        padded = health_pb2.HealthCheckRequest(service="").SerializeToString() + b"\xfa\x3f" + \
            _varint(MAX_OPEN_REQUEST_BYTES) + b"u" * MAX_OPEN_REQUEST_BYTES     # field 1023, bytes: unknown
        for method in ("Check", "Watch"):
            with pytest.raises(grpc.RpcError) as err:
                rpc = channel.unary_stream if method == "Watch" else channel.unary_unary
                got = rpc(f"/grpc.health.v1.Health/{method}")(padded, timeout=10)
                next(got) if method == "Watch" else got
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value
            assert f"over the limit of {MAX_OPEN_REQUEST_BYTES:,}" in err.value.details(), err.value
        watches = [health.Watch(health_pb2.HealthCheckRequest(service=""), timeout=60)
                   for _ in range(MAX_WATCHES_PER_HOST)]
        assert all(next(w).status == health_pb2.HealthCheckResponse.SERVING for w in watches)
        with pytest.raises(grpc.RpcError) as err:
            next(health.Watch(health_pb2.HealthCheckRequest(service=""), timeout=10))
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "1,024 watches" in err.value.details()
        watches.pop().cancel()
        time.sleep(0.5)
        again = health.Watch(health_pb2.HealthCheckRequest(service=""), timeout=10)
        assert next(again).status == health_pb2.HealthCheckResponse.SERVING
        for w in [*watches, again]:
            w.cancel()


def test_the_open_reflection_service_keeps_little_for_a_stranger(worker: WorkerProcess) -> None:
    """Reflection answers without a token, and copies each request into its reply, which stays in the
    server while its caller reads nothing: 12 streams of one 60 MB request each held 3 GB of the pool
    server. A request is at most 16 KiB; a host holds at most 32 request streams open (reflection's
    and Multiplex's together, `wire/receiving.py`), fewer than reflection's own bound of 64."""
    from bridge_server.wire.open_services import MAX_OPEN_REQUEST_BYTES
    from bridge_server.wire.receiving import ReceiveLimits
    streams_per_host = ReceiveLimits().streams_per_host

    listing = reflection_pb2.ServerReflectionRequest(list_services="")
    with grpc.insecure_channel(worker.address, options=[("grpc.max_send_message_length", 64 << 20)]) as channel:
        refl = reflection_pb2_grpc.ServerReflectionStub(channel)
        huge = reflection_pb2.ServerReflectionRequest(file_containing_symbol="x" * (60 << 20))
        for request in (huge, reflection_pb2.ServerReflectionRequest(
                file_by_filename="f" * (MAX_OPEN_REQUEST_BYTES + 1))):
            with pytest.raises(grpc.RpcError) as err:
                list(refl.ServerReflectionInfo(iter([listing, request]), timeout=30))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value
            assert f"over the limit of {MAX_OPEN_REQUEST_BYTES:,}" in err.value.details()
        gates = [threading.Event() for _ in range(streams_per_host + 1)]

        def held(gate: threading.Event) -> Iterator[reflection_pb2.ServerReflectionRequest]:
            yield listing
            gate.wait(60)
        streams = [refl.ServerReflectionInfo(held(g), timeout=60) for g in gates[:-1]]
        assert all(next(s).list_services_response.service for s in streams)
        with pytest.raises(grpc.RpcError) as err:
            next(refl.ServerReflectionInfo(held(gates[-1]), timeout=10))
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err.value
        assert f"(streams_per_host {streams_per_host})" in err.value.details(), err.value
        gates[0].set()
        list(streams[0])
        time.sleep(0.5)
        again = list(refl.ServerReflectionInfo(iter([listing]), timeout=10))
        assert {s.name for s in again[0].list_services_response.service} >= {"vllm_bridge.v1.Bridge"}
        for g in gates:
            g.set()
        for s in streams[1:]:
            list(s)


def test_many_concurrent_calls_are_served_at_once(worker: WorkerProcess) -> None:
    from concurrent.futures import ThreadPoolExecutor
    with BridgeClient(worker.address) as c, ThreadPoolExecutor(32) as pool:
        results = list(pool.map(lambda i: c.call(f"{D}.get_pp_indices", 64, i % 4, 4), range(256)))
    assert results == [((i % 4) * 16, (i % 4) * 16 + 16) for i in range(256)]


@pytest.mark.parametrize("case,call,code,needle", BAD_CALLS, ids=[c[0] for c in BAD_CALLS])
def test_bad_input_over_multiplex_fails_that_call_alone_with_the_same_error(client: BridgeClient, case: str,
                                                                            call: object, code: grpc.StatusCode,
                                                                            needle: str) -> None:
    with client.multiplex() as mux:
        kept = mux.call("vllm.config.ParallelConfig", kwargs={"data_parallel_size": 3})
        with pytest.raises(CallError) as err:
            call(mux)  # type: ignore[operator]
        assert err.value.code == code, err.value.details
        assert needle in err.value.details, err.value.details
        assert mux.call(Target.get(kept, "data_parallel_size")) == 3


def test_multiplex_runs_calls_together_and_finishes_them_after_the_client_half_closes(worker: WorkerProcess) -> None:
    def start(call_id: int, *args: int, name: str = f"{D}.get_pp_indices") -> pb.MuxRequest:
        call = pb.CallRequest(target=pb.Target(kind=pb.Target.FUNCTION, name=name),
                              args=[pb.Value(int=a) for a in args])
        return pb.MuxRequest(start=pb.MuxStart(id=call_id, call=call))

    requests = [start(i, 64, i % 4, 4) for i in range(1, 65)]
    requests.append(pb.MuxRequest())             # neither start nor cancel: ends the stream
    with grpc.insecure_channel(worker.address) as channel:
        stub = pb_grpc.BridgeStub(channel)
        events: dict[int, list[pb.MuxEvent]] = {}
        replies = stub.Multiplex(iter(requests[:64]))   # the iterator ends: a half-close
        count = 0
        for reply in replies:
            count += 1
            for e in reply.events:
                events.setdefault(e.id, []).append(e)
        assert sorted(events) == list(range(1, 65)) and count <= 64
        for i in range(1, 65):
            (e,) = events[i]
            assert tuple(v.int for v in e.value.tuple.items) == ((i % 4) * 16, (i % 4) * 16 + 16)
        # A request that is neither start, cancel nor credit names no call: an error event for id 0,
        # and the stream carries on with the calls after it.
        got = {e.id: e for r in stub.Multiplex(iter(requests[-1:] + requests[:1])) for e in r.events}
        assert got[0].error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
        assert "start, cancel, credit or batch" in got[0].error.message
        assert tuple(v.int for v in got[1].value.tuple.items) == (16, 32)


def test_multiplex_takes_requests_in_batches(worker: WorkerProcess) -> None:
    multiplex_batches(worker.address)


def test_a_large_request_is_parsed_in_its_turn_and_a_bad_one_fails_alone(worker: WorkerProcess) -> None:
    large_requests(worker.address)


def test_a_batch_over_the_request_limit_fails_each_call_it_starts_and_the_stream_goes_on(tmp_path: Path) -> None:
    """A MuxBatch is one message: over max_request_bytes it is refused whole, but every start in it
    hears why (none waits for ever), and the stream takes the next request."""
    w = start_worker(tmp_path, "--max-request-bytes", "65536", name="small-requests")
    try:
        with BridgeClient(w.address) as c:
            def start(call_id: int, *args: object) -> pb.MuxRequest:
                req, _ = c.request(f"{D}.divide", args, None)
                return pb.MuxRequest(start=pb.MuxStart(id=call_id, call=req))

            big = pb.MuxRequest(batch=pb.MuxBatch(requests=[start(i, "x" * 30_000, 3) for i in (1, 2, 3)]))
            assert 65_536 < big.ByteSize() < 65_536 + 64 * 1024     # past our limit, within gRPC's
            got = {e.id: e for r in c.stub.Multiplex(iter([big, start(4, 6, 3)]), timeout=30) for e in r.events}
    finally:
        w.stop()
    assert sorted(got) == [1, 2, 3, 4]
    for i in (1, 2, 3):
        assert got[i].error.code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0], got[i]
        assert "max_request_bytes" in got[i].error.message
    assert got[4].value.int == 2


def test_the_plain_asyncio_loop_serves_too(tmp_path: Path) -> None:
    """Workers run on uvloop by default; `--loop asyncio` is the fallback and must serve the same."""
    w = start_worker(tmp_path, "--loop", "asyncio", name="asyncio-loop")
    try:
        with BridgeClient(w.address) as c:
            assert c.call(f"{D}.divide", 6, 3) == 2
            with c.multiplex() as mux:
                assert mux.call(f"{D}.get_pp_indices", 64, 1, 4) == (16, 32)
            with pytest.raises(CallError) as err:
                c.call(f"{D}.divide", 6, 3, 1)
            assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    finally:
        w.stop()


def test_a_collective_on_a_lone_worker_takes_one_form_of_its_calls(client: BridgeClient) -> None:
    """A worker alone is a group of one rank: `call` or one `per_rank` call runs there once; both
    at once is refused (the worker ran `call`, a pool `per_rank`), as is neither."""
    request, _ = client.request("vllm.distributed.divide", (6, 3))
    assert client.stub.Collective(pb.CollectiveRequest(per_rank=[request]), timeout=10).results[0].value.int == 2
    for given, needle in ((pb.CollectiveRequest(call=request, per_rank=[request]), "not both"),
                          (pb.CollectiveRequest(), "give `call`")):
        with pytest.raises(grpc.RpcError) as err:
            client.stub.Collective(given, timeout=10)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT   # type: ignore[attr-defined]
        assert needle in err.value.details()   # type: ignore[attr-defined]


def test_setting_an_attribute_is_checked_by_its_type_and_counted_in_the_bytes_refs_hold(tmp_path: Path) -> None:
    """Bytes were counted only when a ref was made, and a set attribute skipped the type check its
    constructor applies: a small DPMetadata given a 48 MB tensor 24 times took the worker 1.1 GB
    past the limit of the bytes refs may hold."""
    w = start_worker(tmp_path, "--max-ref-bytes-per-client", "1000000")
    dp = "vllm.forward_context.DPMetadata"
    try:
        with BridgeClient(w.address) as c:
            small = c.call(dp, torch.tensor(7), torch.tensor([5, 7, 3]))
            with pytest.raises(CallError) as err:                  # its declared type: list[int] | None
                c.call(Target.set(small, "local_sizes"), "abc")
            assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT, err.value
            assert "parameter local_sizes" in err.value.details and "got str 'abc'" in err.value.details
            c.call(Target.set(small, "local_sizes"), [3, 3, 4])
            assert c.call(Target.get(small, "local_sizes")) == [3, 3, 4]
            # 60,000 ints: ~0.5 MB of slots, twice over the limit (a tensor's bytes count the same way)
            c.call(Target.set(small, "local_sizes"), list(range(60_000)))
            with pytest.raises(CallError) as err:
                c.call(Target.set(small, "local_sizes"), list(range(80_000)))
            assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED, err.value
            assert "max_ref_bytes_per_client" in err.value.details and "setting a builtins.list" in err.value.details
            with pytest.raises(CallError) as err:                  # what it holds now is counted
                c.call(dp, torch.tensor(7), torch.zeros(70_000, dtype=torch.int64))
            assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED, err.value
            c.call(Target.set(small, "local_sizes"), None)            # and what it dropped is not
            assert c.call(dp, torch.tensor(7), torch.zeros(70_000, dtype=torch.int64)) is not None
    finally:
        w.stop()


def test_a_release_of_a_session_no_header_could_name_is_refused(client: BridgeClient) -> None:
    """A session id is at most 256 characters wherever it is given: a Release naming a longer one
    freed nothing and said nothing."""
    with pytest.raises(CallError) as err:
        client.release(session_id="s" * 300)
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT and "a session id of 300 characters" in err.value.details
    assert client.release(session_id="s" * 256) == 0
