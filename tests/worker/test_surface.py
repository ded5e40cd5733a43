"""End to end: the documented vllm.forward_context / vllm.distributed surface, called over a real gRPC
socket on a real worker process running real vLLM."""

from __future__ import annotations

from typing import Any

import grpc
import pytest
import torch

from bridge_server.client.client import BridgeClient, CallError, Target
from tests.conftest import WorkerProcess, free_port

FC = "vllm.forward_context"
D = "vllm.distributed"


def test_forward_context_is_set_read_and_cleared_through_a_context_manager_ref(client: BridgeClient) -> None:
    assert client.call(f"{FC}.is_forward_context_available") is False
    assert client.call(f"{FC}._forward_context") is None
    config = client.call("vllm.config.VllmConfig")
    manager = client.call(f"{FC}.set_forward_context", None, config, kwargs={"virtual_engine": 0})
    assert manager.type_name.endswith("_GeneratorContextManager")

    client.call(Target.method(manager, "__enter__"))
    try:
        assert client.call(f"{FC}.is_forward_context_available") is True
        context = client.call(f"{FC}.get_forward_context")
        # ForwardContext is a dataclass: it comes by value, as a record naming its type.
        assert context["virtual_engine"] == 0
        assert context["attn_metadata"] is None
        live = client.call(f"{FC}._forward_context")      # module attribute, read live
        assert live is not None and live["virtual_engine"] == 0
    finally:
        client.call(Target.method(manager, "__exit__"))

    assert client.call(f"{FC}.is_forward_context_available") is False
    assert client.call(f"{FC}._forward_context") is None
    with pytest.raises(CallError) as err:
        client.call(f"{FC}.get_forward_context")
    assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert err.value.detail.python_type == "AssertionError"
    assert f"{FC}.get_forward_context" in err.value.details and "Forward context is not set" in err.value.details


def test_a_context_manager_ref_used_out_of_order_is_refused_by_its_state(client: BridgeClient) -> None:
    """A generator's context manager is entered once, then exited once. An exit before any enter
    (RuntimeError "generator didn't stop") and a second enter (AttributeError 'args') came back as
    UNKNOWN, naming neither the manager nor its state; and the forward context stays as it was."""
    config = client.call("vllm.config.VllmConfig")
    manager = client.call(f"{FC}.set_forward_context", None, config)

    def refused(method: str) -> str:
        with pytest.raises(CallError) as err:
            client.call(Target.method(manager, method))
        assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION, err.value
        assert err.value.reason == "context manager state" and "set_forward_context" in err.value.details
        return err.value.details

    assert "is not entered yet" in refused("__exit__")
    assert client.call(f"{FC}.is_forward_context_available") is False
    client.call(Target.method(manager, "__enter__"))
    assert "is entered already" in refused("__enter__")
    assert client.call(f"{FC}.is_forward_context_available") is True
    client.call(Target.method(manager, "__exit__"))
    assert "is exited already" in refused("__exit__") and "is exited already" in refused("__enter__")
    assert client.call(f"{FC}.is_forward_context_available") is False


def test_context_managers_of_one_state_are_exited_innermost_first(client: BridgeClient) -> None:
    """`set_forward_context` restores, on exit, the context it found on entering: a, b, exit a,
    exit b left every client with a's stale context. Exits go innermost first, as nested `with`
    statements go; a manager whose refs are all released no longer counts."""
    config = client.call("vllm.config.VllmConfig")
    a, b, c, d = (client.call(f"{FC}.set_forward_context", None, config) for _ in range(4))
    for m in (a, b):
        client.call(Target.method(m, "__enter__"))
    with pytest.raises(CallError) as err:
        client.call(Target.method(a, "__exit__"))
    assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION and err.value.reason == "context manager order"
    assert "1 context manager(s) of the same state were entered after this one" in err.value.details
    client.call(Target.method(b, "__exit__"))
    client.call(Target.method(a, "__exit__"))
    assert client.call(f"{FC}.is_forward_context_available") is False
    # an inner one released while entered: the outer one exits, and the state is what it was before it
    for m in (c, d):
        client.call(Target.method(m, "__enter__"))
    client.release(d)
    client.call(Target.method(c, "__exit__"))
    assert client.call(f"{FC}.is_forward_context_available") is False
    # managers of another object's state are their own: a DPMetadata's sizes, in any order against these
    dp = client.call(f"{FC}.DPMetadata", torch.tensor(7), torch.tensor([5, 7, 3]))
    sizes = client.call(Target.method(dp, "sp_local_sizes"), 2)
    outer = client.call(f"{FC}.set_forward_context", None, config)
    client.call(Target.method(outer, "__enter__"))
    client.call(Target.method(sizes, "__enter__"))
    client.call(Target.method(outer, "__exit__"))
    client.call(Target.method(sizes, "__exit__"))
    assert client.call(Target.get(dp, "local_sizes")) is None


def test_the_forward_context_in_force_is_one_clients_and_only_it_reads_it(worker: WorkerProcess,
                                                                          client: BridgeClient) -> None:
    """The forward context is one module global: what a client entered (its attn_metadata, refs and
    all) every client read, with authentication too, and another client's manager entered on top
    kept the first from exiting. The state is one client's at a time; only it reads the context; and
    a manager released while in force is exited (it stayed in force for good)."""
    own_connection = [("grpc.use_local_subchannel_pool", 1)]
    config = client.call("vllm.config.VllmConfig")
    mine = client.call(f"{FC}.set_forward_context", {"secret": "mine"}, config)
    client.call(Target.method(mine, "__enter__"))
    try:
        with BridgeClient(worker.address, channel_options=own_connection) as other:
            for read in ("get_forward_context", "is_forward_context_available", "_forward_context"):
                with pytest.raises(CallError) as err:
                    other.call(f"{FC}.{read}")
                assert err.value.code == grpc.StatusCode.PERMISSION_DENIED and err.value.reason == "not yours", read
            theirs = other.call(f"{FC}.set_forward_context", None, config)
            with pytest.raises(CallError) as err:
                other.call(Target.method(theirs, "__enter__"))
            assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION and err.value.reason == "context in force"
            # nor may it end the hold by the ref's id: neither its exit nor its release
            for end in (lambda: other.call(Target.method(mine, "__exit__")), lambda: other.release(mine)):
                with pytest.raises(CallError) as err:
                    end()
                assert err.value.code == grpc.StatusCode.PERMISSION_DENIED and err.value.reason == "not yours"
        assert client.call(f"{FC}.get_forward_context")["attn_metadata"] == {"secret": "mine"}
    finally:
        client.call(Target.method(mine, "__exit__"))
    released = client.call(f"{FC}.set_forward_context", {"secret": "gone"}, config)
    client.call(Target.method(released, "__enter__"))
    client.release(released)
    with BridgeClient(worker.address, channel_options=own_connection) as other:
        assert other.call(f"{FC}.is_forward_context_available") is False
        assert other.call(f"{FC}._forward_context") is None


def test_dp_metadata_methods_compute_the_documented_sizes(client: BridgeClient) -> None:
    dp = client.call(f"{FC}.DPMetadata", torch.tensor(7), torch.tensor([5, 7, 3]))
    assert dp.type_name == "vllm.forward_context.DPMetadata"

    sp = client.call(Target.method(dp, "sp_local_sizes"), 2)
    assert client.call(Target.method(sp, "__enter__")) == [3, 3, 4, 4, 2, 2]
    assert client.call(Target.get(dp, "local_sizes")) == [3, 3, 4, 4, 2, 2]
    client.call(Target.method(sp, "__exit__"))
    assert client.call(Target.get(dp, "local_sizes")) is None


def test_a_manager_entered_and_released_is_exited_at_once(client: BridgeClient) -> None:
    """A released manager was exited only when a client next asked of its state; an object's state
    (`DPMetadata.sp_local_sizes`) no one asks of again, so each one entered and released kept the
    object and its tensors for good (10-15 MB a cycle with a million-entry tensor)."""
    dp = client.call(f"{FC}.DPMetadata", torch.tensor(7), torch.tensor([5, 7, 3]))
    sp = client.call(Target.method(dp, "sp_local_sizes"), 2)
    assert client.call(Target.method(sp, "__enter__")) == [3, 3, 4, 4, 2, 2]
    assert client.release(sp) == 1
    assert client.call(Target.get(dp, "local_sizes")) is None      # exited with its release

    chunked = client.call(Target.method(dp, "chunked_sizes"), 1, 4, 1)
    assert client.call(Target.method(chunked, "__enter__")) == [1, 3, 1]
    client.call(Target.method(chunked, "__exit__"))

    cu = client.call(Target.method(dp, "cu_tokens_across_sp"), 1)
    assert isinstance(cu, torch.Tensor) and cu.tolist() == [5, 12, 15] and cu.dtype == torch.int64


def test_dp_metadata_make_accepts_a_config_ref_or_a_map(client: BridgeClient) -> None:
    config = client.call("vllm.config.ParallelConfig", kwargs={"data_parallel_size": 2, "data_parallel_rank": 1})
    made = client.call(f"{FC}.DPMetadata.make", config, 7, torch.tensor([5, 7]))
    assert made["max_tokens_across_dp_cpu"].item() == 7
    # A map where the signature wants a ParallelConfig is built into one.
    from_map = client.call(f"{FC}.DPMetadata.make", {"data_parallel_size": 2, "data_parallel_rank": 1}, 7,
                           torch.tensor([5, 7]))
    assert torch.equal(from_map["num_tokens_across_dp_cpu"], made["num_tokens_across_dp_cpu"])
    with pytest.raises(CallError) as err:   # vLLM's bare assertion still says which call failed
        client.call(f"{FC}.DPMetadata.make", client.call("vllm.config.ParallelConfig"), 7, torch.tensor([7]))
    assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert "DPMetadata.make" in err.value.details and "AssertionError" in err.value.details


@pytest.mark.parametrize("record,kwargs,said", [
    ("vllm.config.ParallelConfig", {"data_parallel_size": 50_000_000}, "field data_parallel_size: expected 1 to 1,024"),
    ("vllm.config.ParallelConfig", {"data_parallel_rank": -1}, "field data_parallel_rank: expected 0 to 1,023"),
    ("vllm.config.VllmConfig", {"parallel_config": {"tensor_parallel_size": 10**9}},
     "parameter parallel_config: cannot build ParallelConfig from the map given: field tensor_parallel_size: "
     "expected 1 to 1,024"),
])
def test_a_configs_sizes_are_those_of_a_layout(client: BridgeClient, record: str, kwargs: dict[str, Any],
                                                said: str) -> None:
    """vLLM sizes tensors by a ParallelConfig's sizes: a data_parallel_size of 5 * 10**7 made
    coordinate_batch_across_dp allocate 1 GB of the worker from 200 bytes, and a tensor parallel size
    of 10**9 was refused as "too large swap space". Each is refused by name, directly or nested."""
    with pytest.raises(CallError) as err:
        client.call(record, kwargs=kwargs)
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT and said in err.value.details, err.value
    assert "pydantic" not in err.value.details, err.value
    assert client.call(record, kwargs={"parallel_config": {"data_parallel_size": 1_024}}
                       if record.endswith("VllmConfig") else {"data_parallel_size": 1_024})


def test_coordinate_batch_across_dp_returns_the_documented_tuple(client: BridgeClient) -> None:
    result = client.call(f"{FC}.coordinate_batch_across_dp", 8, False, False, client.call("vllm.config.ParallelConfig"))
    assert result == (False, None, 0) and isinstance(result, tuple)


def test_distributed_environment_with_gloo_and_collectives_on_tensors_by_value(worker: WorkerProcess,
                                                                               client: BridgeClient) -> None:
    """And the groups are their maker's to set up again or tear down, anyone's to use: any client
    destroyed the groups another had set up, between two of its collectives."""
    client.call(f"{D}.init_distributed_environment", kwargs=dict(
        world_size=1, rank=0, distributed_init_method=f"tcp://127.0.0.1:{free_port()}", local_rank=0,
        backend="gloo"))
    # the sizes lay the world's ranks out as a grid: ones that cannot were torch's "shape '[-1, 1, 0, 1,
    # 0]' is invalid", naming nothing; and a backend this machine lacks came back as gloo
    for args, kwargs, parameter in (((0, 1), {}, "tensor_model_parallel_size"),
                                    ((2, 1), {}, "tensor_model_parallel_size"),
                                    ((1, 3), {}, "pipeline_model_parallel_size"),
                                    ((2, 1), {"decode_context_model_parallel_size": 3},
                                     "decode_context_model_parallel_size"),
                                    ((1, 1), {"backend": "xyz"}, "backend")):
        with pytest.raises(CallError) as err:
            client.call(f"{D}.initialize_model_parallel", *args, kwargs=kwargs)
        assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT and err.value.detail.parameter == parameter, \
            (args, kwargs, err.value)
    # each list of ranks is two torch groups that outlive the coordinator: [[0]] a thousand times kept
    # 8,000 files and 6,000 threads; a coordinator's lists split the world
    for name, args, said in (("init_model_parallel_group", ([[0]] * 3, 0, "gloo"), "rank 0 is in more than one"),
                             ("init_model_parallel_group", ([[1]], 0, "gloo"), "expected ranks of the world's 1"),
                             ("init_model_parallel_group", ([[]], 0, "gloo"), "expected a non-empty list"),
                             ("init_model_parallel_group", ([], 0, "gloo"), "holding this worker's rank 0"),
                             ("init_world_group", ([0, 0], 0, "gloo"), "rank 0 is in more than one"),
                             ("init_world_group", ([0], 7, "gloo"), "parameter local_rank: expected a rank on")):
        with pytest.raises(CallError) as err:
            client.call(f"{D}.{name}", *args)
        assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT and said in err.value.details, err.value
        assert err.value.detail.parameter in ("group_ranks", "ranks", "local_rank"), err.value
    # and a coordinator a client made and released takes its torch groups with it (8 files and 6 threads
    # each had stayed for good); one vLLM uses stays, whoever released a ref to it
    import psutil
    process = psutil.Process(worker.proc.pid)
    made = client.call(f"{D}.init_model_parallel_group", [[0]], 0, "gloo")
    client.release(made)
    files, threads = process.num_fds(), process.num_threads()
    for _ in range(10):
        client.release(client.call(f"{D}.init_world_group", [0], 0, "gloo"))
    assert process.num_fds() <= files + 2 and process.num_threads() <= threads + 2, \
        (files, process.num_fds(), threads, process.num_threads())
    with pytest.raises(CallError) as err:
        client.call(f"{D}.stateless_init_torch_distributed_process_group", "127.0.0.1", free_port(), 0, 1, "mpi")
    assert err.value.detail.parameter == "backend" and "expected one of 'gloo'" in err.value.details, err.value
    client.call(f"{D}.initialize_model_parallel", 1, 1)
    assert client.call(f"{D}.model_parallel_is_initialized") is True
    client.release(client.call(f"{D}.get_tp_group"))       # vLLM's own: released, it stays
    assert client.call(f"{D}.get_tensor_model_parallel_rank") == 0
    assert client.call(f"{D}.get_tensor_model_parallel_world_size") == 1
    group = client.call(f"{D}.get_tp_group")
    assert group.type_name.endswith("GroupCoordinator")
    assert client.call(Target.get(group, "world_size")) == 1

    t = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    reduced = client.call(f"{D}.tensor_model_parallel_all_reduce", t)
    assert torch.equal(reduced, t)
    gathered = client.call(f"{D}.tensor_model_parallel_all_gather", t, -1)
    assert gathered.shape == (2, 3) and torch.equal(gathered, t)
    bf16 = torch.tensor([1.5, -2.25], dtype=torch.bfloat16)
    assert torch.equal(client.call(f"{D}.tensor_model_parallel_all_reduce", bf16), bf16)

    t = torch.ones(4)
    own = [("grpc.use_local_subchannel_pool", 1)]
    with BridgeClient(worker.address, channel_options=own) as stranger:
        assert torch.equal(stranger.call(f"{D}.tensor_model_parallel_all_reduce", t), t)
        for name in ("destroy_model_parallel", "destroy_distributed_environment", "cleanup_dist_env_and_memory",
                     "initialize_model_parallel", "set_custom_all_reduce"):
            with pytest.raises(CallError) as err:
                stranger.call(f"{D}.{name}", *((1, 1) if name.startswith("init") else (False,) if name.startswith(
                    "set") else ()))
            assert err.value.code == grpc.StatusCode.PERMISSION_DENIED and err.value.reason == "groups held", err.value
            assert "process groups are another client's" in err.value.details, err.value
        assert torch.equal(client.call(f"{D}.tensor_model_parallel_all_reduce", t), t)
        client.call(f"{D}.destroy_model_parallel")
        client.call(f"{D}.destroy_distributed_environment")
        stranger.call(f"{D}.init_distributed_environment", 1, 0, f"tcp://127.0.0.1:{free_port()}", 0, "gloo")
        stranger.call(f"{D}.initialize_model_parallel", 1, 1)
        with pytest.raises(CallError) as err:
            client.call(f"{D}.destroy_model_parallel")
        assert err.value.reason == "groups held", err.value
        stranger.call(f"{D}.destroy_model_parallel")
        stranger.call(f"{D}.destroy_distributed_environment")
    assert client.call(f"{D}.model_parallel_is_initialized") is False
    # cleanup_dist_env_and_memory tears the groups down (and, below, nothing else of the process)
    client.call(f"{D}.init_distributed_environment", 1, 0, f"tcp://127.0.0.1:{free_port()}", 0, "gloo")
    client.call(f"{D}.initialize_model_parallel", 1, 1)
    client.call(f"{D}.set_custom_all_reduce", True)
    assert client.call(f"{D}.cleanup_dist_env_and_memory") is None
    assert client.call(f"{D}.model_parallel_is_initialized") is False
    with pytest.raises(CallError) as err:      # no world to lay out: vLLM's bare assertion, said
        client.call(f"{D}.initialize_model_parallel", 1, 1)
    assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION and err.value.reason == "no process group", err.value


def test_cleaning_up_the_distributed_environment_leaves_the_rest_of_the_process_alone() -> None:
    """vLLM's cleanup_dist_env_and_memory unfreezes the heap that a worker freezes at start and
    collects all of it, holding the event loop ~0.3 s at each call: a stranger calling it in a loop
    stalled every other client's streams, and the heap stayed unfrozen. The catalog's runs vLLM's
    destroys only, and collects the young generations."""
    import gc

    from adapters.distributed import DISTRIBUTED
    cleanup = DISTRIBUTED.overrides["cleanup_dist_env_and_memory"]
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        assert frozen > 0
        cleanup()
        cleanup(shutdown_ray=True)     # no Ray here: nothing to shut down
        assert gc.get_freeze_count() > frozen // 2     # (frozen objects freed meanwhile leave it; vLLM's: 0)
    finally:
        gc.unfreeze()


def test_distributed_pure_helpers(client: BridgeClient) -> None:
    assert client.call(f"{D}.get_pp_indices", 32, 0, 2) == (0, 16)
    assert client.call(f"{D}.divide", 6, 3) == 2
    assert type(client.call(f"{D}.divide", 6, 3)) is int
    with pytest.raises(CallError) as err:
        client.call(f"{D}.ensure_divisibility", 7, 2)
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.category == "python_error" and err.value.detail.python_type == "AssertionError"
    assert "7 is not divisible by 2" in err.value.details and "ensure_divisibility" in err.value.details
    assert "Traceback" in err.value.detail.traceback


def test_describe_lists_every_entry_with_parameters(client: BridgeClient) -> None:
    catalog = client.describe()
    by_name = {e.name: e for e in catalog.entries}
    divide = by_name[f"{D}.divide"]
    assert [p.name for p in divide.parameters] == ["numerator", "denominator"]
    assert [p.doc_type for p in divide.parameters] == ["term()", "term()"]     # as the document says
    assert divide.documented_in == "003_7ef0e01ebdeb04f0.txt"
    sfc = by_name[f"{FC}.set_forward_context"]
    assert sfc.exclusive and [p.name for p in sfc.parameters][:3] == ["attn_metadata", "vllm_config", "virtual_engine"]
    assert sfc.parameters[2].has_default and sfc.parameters[2].default_repr == "0"
    assert by_name[f"{FC}._forward_context"].kind == by_name[f"{FC}._forward_context"].MODULE_ATTR
    assert by_name[f"{FC}.DPMetadata"].kind == by_name[f"{FC}.DPMetadata"].CONSTRUCTOR
    assert catalog.vllm_version.startswith("0.14.0")
    only_dp = client.describe(prefix=f"{FC}.DPMetadata")
    assert only_dp.entries and all(e.name.startswith(f"{FC}.DPMetadata") for e in only_dp.entries)


def test_the_sequence_parallel_helpers_compute_and_are_bounded(client: BridgeClient) -> None:
    """They make an entry per rank and sequence-parallel slot: a size of 10**8 from a 30-byte call
    took 2.3 GB and 10 s of the worker. Within the bound they compute as vLLM does."""
    assert client.call(f"{FC}._compute_sp_num_tokens", torch.tensor([5, 3]), 2) == [3, 3, 2, 2]
    assert client.call(f"{FC}._compute_chunked_local_num_tokens", torch.tensor([5, 3]), 2, 2, 1) == [1, 1, 1, 1]
    for name, extra in (("_compute_sp_num_tokens", ()), ("_compute_chunked_local_num_tokens", (2, 0))):
        with pytest.raises(CallError) as err:
            client.call(f"{FC}.{name}", torch.tensor([1]), 10**8, *extra)
        assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED, err.value
        assert "sequence_parallel_size" in err.value.details and "1,048,576 entries" in err.value.details
    for name, extra in (("_compute_sp_num_tokens", ()), ("_compute_chunked_local_num_tokens", (2, 0))):
        for size in (0, -2):        # torch's refusal was a bare RuntimeError: UNKNOWN, naming nothing
            with pytest.raises(CallError) as err:
                client.call(f"{FC}.{name}", torch.tensor([5, 6]), size, *extra)
            assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT, err.value
            assert f"parameter sequence_parallel_size: expected a size of 1 or more, got {size}" in err.value.details


def test_split_tensor_along_last_dim_names_a_count_it_cannot_split_by(client: BridgeClient) -> None:
    split = "vllm.distributed.split_tensor_along_last_dim"
    assert [t.tolist() for t in client.call(split, torch.arange(4).reshape(1, 4), 2)] == [[[0, 1]], [[2, 3]]]
    for tensor, parts, needle in ((torch.zeros(2, 2), 0, "num_partitions: expected 1 or more, got 0"),
                                  (torch.zeros(2, 2), -1, "num_partitions: expected 1 or more, got -1"),
                                  (torch.zeros(2, 3), 2, "the last dimension (3) does not split into 2 equal parts"),
                                  (torch.tensor(5), 1, "expected a tensor of 1 or more dimensions")):
        with pytest.raises(CallError) as err:
            client.call(split, tensor, parts)
        assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT and needle in err.value.details, err.value


def test_iterate_walks_a_tensor_row_by_row_as_asked() -> None:
    """A tensor's own iterator splits it into a view per row at once (3 million rows held the
    worker's event loop 3.5 s and kept 2 GB of views); ITERATE asks for each row when it sends it."""
    import types

    from bridge_server.worker.streams import lazily
    big = torch.zeros(3_000_000, dtype=torch.int64)
    rows = lazily(big)
    assert isinstance(rows, types.GeneratorType)
    assert int(next(rows)) == 0
    assert [r.tolist() for r in lazily(torch.arange(6).reshape(3, 2))] == [[0, 1], [2, 3], [4, 5]]
    scalar, plain = torch.tensor(7), [1, 2]
    assert lazily(scalar) is scalar and lazily(plain) is plain      # 0-d: torch's own error when iterated


def test_the_inline_helpers_take_only_what_keeps_them_trivial(client: BridgeClient) -> None:
    """They run on the worker's event loop: divide("%1000000000d", 1) formatted a 1 GB string there,
    get_pp_indices with pp_size 2**62 made a list until the worker was killed, and DPMetadata's
    methods sized their lists by a client's number. Over Call and over Multiplex alike."""
    cases = [((f"{D}.divide", "%1000000000d", 1), grpc.StatusCode.INVALID_ARGUMENT, "numerator"),
             ((f"{D}.ensure_divisibility", 6, b"x"), grpc.StatusCode.INVALID_ARGUMENT, "denominator"),
             ((f"{D}.get_pp_indices", 64, 2**62 - 1, 2**62), grpc.StatusCode.INVALID_ARGUMENT, "pp_size"),
             ((f"{D}.get_pp_indices", 32, 4, 4), grpc.StatusCode.INVALID_ARGUMENT, "pp_rank"),
             # a layer count of 4,300 digits, over stages that do not divide it: each logged in full
             ((f"{D}.get_pp_indices", 10**4299 + 1023, 0, 1024), grpc.StatusCode.INVALID_ARGUMENT, "num_hidden_layers"),
             ((f"{D}.get_pp_indices", 32, True, 4), grpc.StatusCode.INVALID_ARGUMENT, "pp_rank"),
             ((f"{D}.is_torch_equal_or_newer", "1.0+" + "a." * 100_000), grpc.StatusCode.INVALID_ARGUMENT, "target"),
             ((f"{D}.is_torch_equal_or_newer", "not a version"), grpc.StatusCode.INVALID_ARGUMENT, "target")]
    with client.multiplex() as mux:
        for (target, *args), code, parameter in cases:
            for call in (client.call, mux.call):
                with pytest.raises(CallError) as err:
                    call(target, *args, timeout=10)
                assert err.value.code == code, (target, err.value)
                assert err.value.detail is not None and err.value.detail.parameter == parameter, err.value
    assert client.call(f"{D}.divide", 6, 3) == 2 and client.call(f"{D}.divide", 7.5, 2.5) == 3.0
    assert client.call(f"{D}.get_pp_indices", 32, 3, 4) == (24, 32)
    assert client.call(f"{D}.is_torch_equal_or_newer", "1.0") is True
    dp = client.call(f"{FC}.DPMetadata", torch.tensor(7), torch.tensor([5, 7, 3]))
    for method in ("cu_tokens_across_sp", "sp_local_sizes"):
        with pytest.raises(CallError) as err:
            client.call(Target.method(dp, method), 10**9, timeout=10)
        assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "1,048,576 entries" in err.value.details
    assert client.call(Target.method(dp, "cu_tokens_across_sp"), 2).tolist() == [3, 6, 10, 14, 16, 18]
    client.release(dp)


def test_a_refusal_in_vllms_words_names_the_parameter_it_opens_with(client: BridgeClient) -> None:
    """vLLM's own checks say which argument they refused in words only ("presence_penalty must be in
    [-2, 2], got inf."): the parameter is named where the text opens with one of the call's."""
    for kwargs, parameter in (({"presence_penalty": float("inf")}, "presence_penalty"),
                              ({"temperature": -1.0}, "temperature")):
        with pytest.raises(CallError) as err:
            client.call("vllm.SamplingParams", kwargs=kwargs)
        assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT, err.value
        assert err.value.detail.parameter == parameter, err.value
