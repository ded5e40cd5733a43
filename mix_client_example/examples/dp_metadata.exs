# Vllm.ForwardContext.DPMetadata: a class binding. `new` builds an instance and returns a ref;
# methods take the ref first; `local_sizes` is an attribute read.
#
#     mix run examples/dp_metadata.exs
alias Vllm.ForwardContext.DPMetadata
alias VllmBridge.Tensor

# Tensors by value: a struct with dtype, shape and little-endian data (or an Nx tensor, with Nx).
{:ok, dp} = DPMetadata.new(Tensor.from_list(7, :int64), Tensor.from_list([5, 7, 3], :int64))
IO.puts("new -> #{inspect(dp)}")

{:ok, cu} = DPMetadata.cu_tokens_across_sp(dp, 1)
IO.puts("cu_tokens_across_sp(1) -> #{inspect(Tensor.to_list(cu))} (#{cu.dtype}, shape #{inspect(cu.shape)})")
{:ok, nil} = DPMetadata.local_sizes(dp)

# sp_local_sizes and chunked_sizes are context managers: local_sizes is set only inside.
{:ok, cm} = DPMetadata.sp_local_sizes(dp, 2)
{:ok, inside} = VllmBridge.with_context(cm, fn entered -> {entered, DPMetadata.local_sizes(dp)} end)
IO.puts("sp_local_sizes(2): entered #{inspect(elem(inside, 0))}, local_sizes #{inspect(elem(inside, 1))}")

{:ok, cm} = DPMetadata.chunked_sizes(dp, 1, 4, 1)
{:ok, chunk} = VllmBridge.with_context(cm, fn _ -> DPMetadata.get_chunk_sizes_across_dp_rank(dp) end)
IO.puts("chunked_sizes(1, 4, 1): get_chunk_sizes_across_dp_rank -> #{inspect(chunk)}")
IO.puts("after the context: local_sizes -> #{inspect(DPMetadata.local_sizes(dp))}")

# `make` is a classmethod: call it on the class (the module) or on an instance ref. It returns a
# DPMetadata.t(), as `new` does: an instance (a ref), usable with the other functions.
{:ok, parallel} = VllmBridge.new("vllm.config.ParallelConfig", [], data_parallel_size: 2, data_parallel_rank: 1)
{:ok, made} = DPMetadata.make(DPMetadata, parallel, 7, Tensor.from_list([5, 7], :int64))
{:ok, made_cu} = DPMetadata.cu_tokens_across_sp(made, 1)
IO.puts("make on the class -> #{inspect(made)}, cu_tokens_across_sp(1) -> #{inspect(Tensor.to_list(made_cu))}")
{:ok, _} = DPMetadata.make(dp, parallel, 7, Tensor.from_list([5, 7], :int64))

# The optional constructor argument: positionally in a list, or as a keyword.
{:ok, with_sizes} = DPMetadata.new(Tensor.from_list(7, :int64), Tensor.from_list([5, 7, 3], :int64), [[2, 2, 3]])
{:ok, [2, 2, 3]} = DPMetadata.local_sizes(with_sizes)
{:ok, same} = DPMetadata.new(Tensor.from_list(7, :int64), Tensor.from_list([5, 7, 3], :int64), [], local_sizes: [1])
{:ok, [1]} = DPMetadata.local_sizes(same)

# A ref is data: another process can use it (it lives as long as this process's session).
task = Task.async(fn -> DPMetadata.cu_tokens_across_sp(dp, 1) end)
{:ok, _} = Task.await(task)
IO.puts("used from another process: ok")
{:ok, released} = VllmBridge.release([dp, with_sizes, same, parallel, made])
IO.puts("released #{released} refs")
{:error, %VllmBridge.Error{category: "ref", message: message}} = DPMetadata.local_sizes(dp)
IO.puts("after release: #{message}")
