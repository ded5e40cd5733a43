# Streaming generation from the engine `make serve` publishes under the name "engine".
#
#     mix run examples/generate_stream.exs
#
# Prints the completion as it is generated, then stops a second, long generation after three
# outputs: leaving the stream early cancels the gRPC call, and the server aborts the request in vLLM.
alias Vllm.AsyncLLMEngine

engine = System.get_env("VLLM_BRIDGE_ENGINE", "engine")
id = fn -> "example-#{System.unique_integer([:positive])}" end
# A map where a parameter expects vllm.SamplingParams is built into one by the server.
params = %{max_tokens: 24, temperature: 0.0, ignore_eos: true}

{:ok, stream} =
  AsyncLLMEngine.generate(engine, "Hello, world", params, id.(), __runtime__: [timeout_profile: :ml_inference])

# Each item is a vllm.outputs.RequestOutput record; its text is cumulative.
last =
  Enum.reduce(stream, "", fn output, printed ->
    text = get_in(output, [:outputs, Access.at(0), :text])
    IO.write(String.slice(text, String.length(printed)..-1//1))
    text
  end)

IO.puts("\n-- #{String.length(last)} characters")

{:ok, long} = AsyncLLMEngine.generate(engine, "Once upon a time", %{params | max_tokens: 200}, id.())
started = System.monotonic_time(:millisecond)
tokens = long |> Stream.map(&length(get_in(&1, [:outputs, Access.at(0), :token_ids]))) |> Enum.take(3)
IO.puts("stopped after #{inspect(tokens)} tokens, #{System.monotonic_time(:millisecond) - started} ms")

# The engine has nothing left running: the cancelled request was aborted, not left to finish.
{:ok, processor} = VllmBridge.get_attr(engine, "output_processor")
Process.sleep(200)
{:ok, unfinished} = VllmBridge.call_method(processor, "get_num_unfinished_requests")
IO.puts("unfinished requests in the engine: #{unfinished}")

{:ok, tasks} = AsyncLLMEngine.get_supported_tasks(engine)
{:ok, paused?} = AsyncLLMEngine.is_paused(engine)
{:ok, errored?} = AsyncLLMEngine.errored(engine)
IO.puts("supported tasks #{inspect(tasks)}, paused #{paused?}, errored #{errored?}")
