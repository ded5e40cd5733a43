# The forward context through a context-manager ref.
#
#     mix run examples/forward_context.exs
#
# `set_forward_context` is a Python context manager: the call returns it as a ref, and
# `VllmBridge.with_context/3` runs `__enter__`, the function, and always `__exit__`.
alias Vllm.ForwardContext.Module, as: FC

{:ok, config} = VllmBridge.new("vllm.config.VllmConfig")
{:ok, false} = FC.is_forward_context_available()

# Outside a context vLLM asserts; the error keeps the Python type, message and traceback.
{:error, %VllmBridge.Error{python_type: "AssertionError", code: code, category: category}} = FC.get_forward_context()
IO.puts("outside: #{category} AssertionError (#{code})")

# attn_metadata, vllm_config, then virtual_engine positionally; num_tokens as a Python keyword.
{:ok, cm} = FC.set_forward_context(nil, config, 0, num_tokens: 8)
IO.puts("context manager: #{inspect(cm)}")

{:ok, seen} =
  VllmBridge.with_context(cm, fn _entered ->
    {:ok, available} = FC.is_forward_context_available()
    {:ok, context} = FC.get_forward_context()
    {:ok, live} = FC._forward_context()
    %{available: available, context: context, live_attribute: live}
  end)

IO.puts("inside: available=#{seen.available}, get_forward_context -> #{inspect(seen.context)}")
IO.puts("inside: _forward_context -> #{inspect(seen.live_attribute)}")
{:ok, after_exit} = FC.is_forward_context_available()
IO.puts("after __exit__: available=#{after_exit}")

# Module attributes are zero-arity functions that read the attribute live.
for name <- [:batchsize_logging_interval, :track_batchsize, :last_logging_time, :current_platform] do
  {:ok, value} = apply(FC, name, [])
  IO.puts("#{name}: #{inspect(value)}")
end

{:ok, parallel} = VllmBridge.new("vllm.config.ParallelConfig")
{:ok, decision} = FC.coordinate_batch_across_dp(8, false, false, parallel)
IO.puts("coordinate_batch_across_dp(8, false, false, ParallelConfig()) -> #{inspect(decision)}")
{:ok, sizes} = FC._compute_sp_num_tokens(VllmBridge.Tensor.from_list([5, 7, 3], :int64), 2)
IO.puts("_compute_sp_num_tokens([5, 7, 3], 2) -> #{inspect(sizes)}")
VllmBridge.release([config, parallel, cm])
