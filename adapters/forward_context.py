"""`vllm.forward_context` and its `DPMetadata` class.

The forward context is one module-level global, so every entry that reads or writes it runs in the
worker's exclusive lane; the token-count helpers are pure and run freely. The configs a client
builds to pass in (VllmConfig, ParallelConfig) take only their sizes and ranks from a client: their
other fields name classes to load, executors to start and addresses to reach.
"""

from collections.abc import Mapping
from typing import Any

import grpc

from adapters.distributed import bounded_logger
from adapters.process_groups import MAX_PP_SIZE, short
from adapters.spec import AdapterSpec, CallContext, Constructor, Exposure, Policy, RecordRule
from bridge_server.wire.errors import BridgeError

MODULE = "vllm.forward_context"
MAX_SP_TOKENS = 1 << 20      # entries the sequence-parallel helpers may make (ranks x sequence-parallel size)


def _bounded_sp(receiver: object, args: Mapping[str, object], ctx: CallContext) -> None:
    """The sequence-parallel helpers make a tensor and a list of one entry per rank and sequence-
    parallel slot: 30 bytes asking for a size of 10**8 took 2.3 GB and 10 s of the worker. The same
    holds for DPMetadata's methods (`cu_tokens_across_sp(10**9)`: 16 GB), on the ranks it holds."""
    _token_counts(receiver, args, ctx)
    key = "sp_size" if "sp_size" in args else "sequence_parallel_size"
    sp = args.get(key)
    if type(sp) is int and sp < 1:      # torch's own refusal is a bare RuntimeError ("ZeroDivisionError")
        raise BridgeError.validation(f"parameter {key}: expected a size of 1 or more, got {sp}", parameter=key)
    tokens = args.get("num_tokens_across_dp_cpu", getattr(receiver, "num_tokens_across_dp_cpu", None))
    numel = getattr(tokens, "numel", None)
    if type(sp) is int and callable(numel) and max(sp, 1) * numel() > MAX_SP_TOKENS:
        label = f"parameter {key}"
        raise BridgeError(grpc.StatusCode.RESOURCE_EXHAUSTED, "validation",
                          f"{label}: {sp:,} slots for each of {numel():,} ranks is over this server's limit of "
                          f"{MAX_SP_TOKENS:,} entries", parameter=key, reason="too large")


# A ParallelConfig's sizes and ranks, each along one axis of a layout: vLLM sizes tensors by them
# (`coordinate_batch_across_dp` made a [5, data_parallel_size] tensor: 10**9 asked for 20 GB from a
# request of 200 bytes, 5 * 10**7 took 1 GB), and checked a size of 10**9 only as "too large swap space".
_SIZES = ("pipeline_parallel_size", "tensor_parallel_size", "prefill_context_parallel_size",
          "decode_context_parallel_size", "data_parallel_size", "data_parallel_size_local")
_RANKS = ("data_parallel_rank", "data_parallel_rank_local")


def _parallel_sizes(fields: Mapping[str, Any], policy: Policy) -> None:
    """(A VllmConfig's parallel_config given as a map is built as a ParallelConfig, by this rule.)"""
    label = "vllm.config.ParallelConfig"
    for name in (*_SIZES, *_RANKS, "ubatch_size"):
        value = fields.get(name)
        low = 1 if name in _SIZES else 0
        high = MAX_PP_SIZE - 1 if name in _RANKS else MAX_PP_SIZE
        if type(value) is int and not low <= value <= high:
            raise BridgeError.validation(f"{label}: field {name}: expected {low} to {high:,}, got {short(value)}",
                                         target=label, parameter=name)


def _a_list(receiver: object, args: Mapping[str, object], ctx: CallContext) -> None:
    """u_batch_slices is vLLM's `list[UBatchSlice]` alias, and calling it is `list(iterable)`: of a
    tensor of shape [N, 0] (60 bytes) it made N tensor objects, 4 million of them 2 GB, before the
    result was refused as too large; of text, one string per character. What it makes a list of is
    a list or a tuple, whose items the request paid for (its arguments come by position:
    "0", as `list` has no signature to bind them to)."""
    for key, value in args.items():
        if not isinstance(value, (list, tuple)):
            raise BridgeError.validation(f"parameter {key if key != '0' else 'args[0]'}: expected a list or a tuple "
                                         f"(of UBatchSlice), got {type(value).__name__}",
                                         parameter=key if key != "0" else "args[0]")


def _own_context(receiver: object, args: Mapping[str, object], ctx: CallContext) -> None:
    """The forward context in force is one module global: what a client entered with
    set_forward_context (its attn_metadata, its refs) was every client's to read, identities and all.
    Only the client that entered the context in force reads it (`worker/contexts.py` keeps them one
    client's at a time)."""
    import vllm.forward_context
    holder = ctx.holder(vllm.forward_context.__file__ or "", ctx.client)
    if holder and holder != ctx.client:
        raise BridgeError(grpc.StatusCode.PERMISSION_DENIED, "validation",
                          "the forward context in force was entered by another client; a client reads only its "
                          "own", reason="not yours")


FORWARD_CONTEXT = AdapterSpec(
    surface="forward_context",
    module=MODULE,
    # The documents give snake_case names to two things the module spells otherwise.
    aliases={"u_batch_slices": "UBatchSlices"},
    exclusive=True,
    guards={"_compute_sp_num_tokens": _bounded_sp, "_compute_chunked_local_num_tokens": _bounded_sp,
            "u_batch_slices": _a_list, "init_logger": bounded_logger, "get_forward_context": _own_context,
            "is_forward_context_available": _own_context, "_forward_context": _own_context},
    shared=frozenset({"_compute_chunked_local_num_tokens", "_compute_sp_num_tokens", "init_logger",
                      "u_batch_slices", "batchsize_logging_interval", "track_batchsize", "logger",
                      "current_platform", "coordinate_batch_across_dp"}),
    record_rules=(
        RecordRule("vllm.config", "VllmConfig", fields=frozenset({"parallel_config", "optimization_level"})),
        RecordRule("vllm.config", "ParallelConfig", check=_parallel_sizes, fields=frozenset({
            "pipeline_parallel_size", "tensor_parallel_size", "prefill_context_parallel_size",
            "decode_context_parallel_size", "data_parallel_size", "data_parallel_size_local", "data_parallel_rank",
            "data_parallel_rank_local", "enable_expert_parallel", "enable_eplb", "enable_dbo", "ubatch_size",
            "dbo_decode_token_threshold", "dbo_prefill_token_threshold", "disable_custom_all_reduce",
            "max_parallel_loading_workers", "dcp_kv_cache_interleave_size", "cp_kv_cache_interleave_size"})),
    ),
    exposures=(
        Exposure("vllm.config", "VllmConfig", fields=True),
        Exposure("vllm.config", "ParallelConfig", fields=True, attributes=frozenset({"world_size", "world_size_across_dp"})),
        Exposure("vllm.forward_context", "ForwardContext", fields=True),
    ),
    constructors=(
        Constructor("vllm.forward_context.ForwardContext", MODULE, "ForwardContext"),
        Constructor("vllm.forward_context.BatchDescriptor", MODULE, "BatchDescriptor"),
        Constructor("vllm.config.VllmConfig", "vllm.config", "VllmConfig"),
        Constructor("vllm.config.ParallelConfig", "vllm.config", "ParallelConfig"),
    ),
)

_COUNT_TENSORS = ("max_tokens_across_dp_cpu", "num_tokens_across_dp_cpu")


def _token_counts(receiver: object, args: Mapping[str, object], ctx: CallContext) -> None:
    """DPMetadata's tensors are token counts, which its methods and the sequence-parallel helpers add
    up and split: a float8, complex or bit tensor was taken, and each of them then failed in torch as
    NotImplementedError ("add_stub not implemented for 'Float8_e4m3fn'"), status UNIMPLEMENTED,
    naming nothing. Counts are ints, whether given to the call or held by its receiver (a DPMetadata
    built before the check, or by vLLM)."""
    import torch
    integral = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)
    for key in _COUNT_TENSORS:
        for value, where in ((args.get(key), key), (getattr(receiver, key, None), f"receiver's {key}")):
            if isinstance(value, torch.Tensor) and value.dtype not in integral:
                raise BridgeError.validation(f"parameter {where}: expected a tensor of integer token counts, got "
                                             f"dtype {str(value.dtype).removeprefix('torch.')}", parameter=key)


DP_METADATA = AdapterSpec(
    surface="dp_metadata",
    module=MODULE,
    cls="DPMetadata",
    exclusive=False,
    guards={"cu_tokens_across_sp": _bounded_sp, "sp_local_sizes": _bounded_sp, "chunked_sizes": _bounded_sp,
            "new": _token_counts, "make": _token_counts},
)
