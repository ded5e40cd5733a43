"""`vllm.forward_context` and its `DPMetadata` class.

The forward context is one module-level global, so every entry that reads or writes it runs in the
worker's exclusive lane; the token-count helpers are pure and run freely.
"""

from adapters.spec import AdapterSpec, Constructor

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
