# Vllm.Distributed: pure helpers, then a one-process gloo "cluster" and collectives on tensors.
#
#     mix run examples/distributed.exs
alias Vllm.Distributed, as: D
alias VllmBridge.Tensor

{:ok, 2} = D.divide(6, 3)
{:ok, {0, 16}} = D.get_pp_indices(32, 0, 2)
{:ok, uri} = D.get_tcp_uri("127.0.0.1", 29_500)
IO.puts("divide(6, 3) -> 2, get_pp_indices(32, 0, 2) -> {0, 16}, get_tcp_uri -> #{uri}")
{:error, error} = D.ensure_divisibility(7, 2)
IO.puts("ensure_divisibility(7, 2) -> #{error.category} #{error.python_type} (#{error.code}): #{error.message}")

# Process groups are process-wide state of the worker: set them up once (the example may run again).
{:ok, initialized?} = D.model_parallel_is_initialized()

unless initialized? do
  port = 29_600 + :rand.uniform(300)

  {:ok, _} =
    D.init_distributed_environment(1, 0, "tcp://127.0.0.1:#{port}", 0, "gloo",
      __runtime__: [timeout_profile: :ml_inference]
    )

  {:ok, nil} = D.initialize_model_parallel(1, 1)
end

{:ok, true} = D.model_parallel_is_initialized()
{:ok, world} = D.get_tensor_model_parallel_world_size()
{:ok, rank} = D.get_tensor_model_parallel_rank()
{:ok, group} = D.get_tp_group()
{:ok, group_size} = VllmBridge.get_attr(group, "world_size")
IO.puts("tensor parallel: world size #{world}, rank #{rank}, group #{inspect(group)} (world_size #{group_size})")

t = Tensor.from_list([[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]], :float32)
{:ok, reduced} = D.tensor_model_parallel_all_reduce(t)
{:ok, gathered} = D.tensor_model_parallel_all_gather(t, -1)
IO.puts("all_reduce -> #{inspect(Tensor.to_list(reduced))}, all_gather shape #{inspect(gathered.shape)}")
{:ok, broadcast} = D.broadcast_tensor_dict(%{"x" => t, "step" => 3})
IO.puts("broadcast_tensor_dict -> keys #{inspect(Map.keys(broadcast))}")
{:ok, cpu_group} = VllmBridge.get_attr(group, "cpu_group")
{:ok, same_node} = D.in_the_same_node_as(cpu_group, 0)
IO.puts("in_the_same_node_as(tp cpu_group, 0) -> #{inspect(same_node)}")
