"""`vllm.distributed`: the process group state and the collectives.

torch.distributed keeps its groups in process-wide state and a collective must be issued in the same
order on every rank, so everything that touches a group runs in the worker's exclusive lane. The
arithmetic helpers are pure; the cheapest of them run inline on the event loop.
"""

from collections.abc import Mapping

from adapters.spec import AdapterSpec
from bridge_server.wire.errors import BridgeError


def _vllm_names_only(receiver: object, args: Mapping[str, object]) -> None:
    """resolve_obj_by_qualname would otherwise import anything: keep it to vLLM's own names."""
    qualname = str(args.get("qualname", ""))
    if not qualname.startswith("vllm."):
        raise BridgeError.validation(
            f"vllm.distributed.resolve_obj_by_qualname: parameter qualname: expected a name inside vllm "
            f"(vllm.…), got {qualname!r}", target="vllm.distributed.resolve_obj_by_qualname", parameter="qualname")


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
    guards={"resolve_obj_by_qualname": _vllm_names_only},
    # Everything that talks to the other ranks of the group (or sets the group up or down, which is
    # a rendezvous): called on one rank of a distributed pool it would block there, waiting for peers
    # that never come, and every later collective of the pool would queue behind it.
    collectives=frozenset({
        "tensor_model_parallel_all_reduce", "tensor_model_parallel_all_gather", "tensor_model_parallel_gather",
        "tensor_model_parallel_reduce_scatter", "broadcast_tensor_dict", "all_reduce", "all_gather",
        "reduce_scatter", "patched_fused_scaled_matmul_reduce_scatter", "in_the_same_node_as",
        "init_distributed_environment", "initialize_model_parallel", "ensure_model_parallel_initialized",
        "destroy_model_parallel", "destroy_distributed_environment", "cleanup_dist_env_and_memory",
        "init_model_parallel_group", "init_world_group", "init_gloo_process_group", "graph_capture",
        "prepare_communication_buffer_for_model",
    }),
    profiles={
        "init_distributed_environment": "ml_inference",
        "initialize_model_parallel": "ml_inference",
        "ensure_model_parallel_initialized": "ml_inference",
        "stateless_init_torch_distributed_process_group": "ml_inference",
    },
)
