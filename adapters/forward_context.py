"""`vllm.forward_context` and its `DPMetadata` class.

The forward context is one module-level global, so every entry that reads or writes it runs in the
worker's exclusive lane; the token-count helpers are pure and run freely. The configs a client
builds to pass in (VllmConfig, ParallelConfig) take only their sizes and ranks from a client: their
other fields name classes to load, executors to start and addresses to reach.
"""

from adapters.spec import AdapterSpec, Constructor, Exposure, RecordRule

MODULE = "vllm.forward_context"

FORWARD_CONTEXT = AdapterSpec(
    surface="forward_context",
    module=MODULE,
    # The documents give snake_case names to two things the module spells otherwise.
    aliases={"u_batch_slices": "UBatchSlices"},
    exclusive=True,
    shared=frozenset({"_compute_chunked_local_num_tokens", "_compute_sp_num_tokens", "init_logger",
                      "u_batch_slices", "batchsize_logging_interval", "track_batchsize", "logger",
                      "current_platform", "coordinate_batch_across_dp"}),
    record_rules=(
        RecordRule("vllm.config", "VllmConfig", fields=frozenset({"parallel_config", "optimization_level"})),
        RecordRule("vllm.config", "ParallelConfig", fields=frozenset({
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

DP_METADATA = AdapterSpec(
    surface="dp_metadata",
    module=MODULE,
    cls="DPMetadata",
    exclusive=False,
)
