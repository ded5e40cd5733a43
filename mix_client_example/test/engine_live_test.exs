defmodule VllmBridge.EngineLiveTest do
  # A stream the client stops, or whose caller dies, or whose deadline passes, is aborted inside
  # vLLM: the engine's own log says so ("Request <id> aborted."), which reaches Logger through the
  # VllmBridge.Server this module starts (an engine on the tiny model with enable_log_requests).
  # VLLM_BRIDGE_VENV; excluded without it. The engine takes ~30 s and ~2.5 GB to start.
  use ExUnit.Case, async: false
  @moduletag :server
  @moduletag timeout: 600_000

  import ExUnit.CaptureLog

  alias Vllm.AsyncLLMEngine, as: Engine

  @venv if System.get_env("VLLM_BRIDGE_VENV", "") != "", do: System.get_env("VLLM_BRIDGE_VENV")

  setup_all do
    {model, 0} =
      System.cmd(Path.join([@venv, "bin", "python"]), [
        "-c",
        "from bridge_server.tools.tiny_model import ensure_tiny_model; print(ensure_tiny_model())"
      ])

    dir = Path.join(System.tmp_dir!(), "vb-engine-live-#{System.unique_integer([:positive])}")
    File.mkdir_p!(dir)
    config = Path.join(dir, "engine.toml")

    File.write!(config, """
    [[pools]]
    name = "llm"
    workers = 1
    [[pools.objects]]
    name = "engine"
    target = "vllm.AsyncLLMEngine.from_engine_args"
    kwargs = { engine_args = { model = "#{model |> String.split("\n", trim: true) |> List.last()}", dtype = "float32", max_model_len = 256, enforce_eager = true, enable_log_requests = true } }
    """)

    opts = [name: :engine_test, venv: @venv, config: config, shutdown_timeout: 30_000]
    capture_log(fn -> {:ok, _} = start_supervised({VllmBridge.Server, opts}) end)
    on_exit(fn -> File.rm_rf!(dir) end)
    :ok
  end

  defp id, do: "exunit-abort-#{System.unique_integer([:positive])}"
  defp greedy(n), do: %{max_tokens: n, temperature: 0.0, ignore_eos: true}

  defp generate(id, runtime),
    do: Engine.generate(:engine, "Hello", greedy(200), id, __runtime__: [server: :engine_test] ++ runtime)

  # Runs `fun` and returns whether the engine logged the abort of `id` (within 3 s).
  defp aborted?(id, fun) do
    log =
      capture_log(fn ->
        fun.()
        Process.sleep(3_000)
      end)

    log =~ "Request #{id} aborted."
  end

  test "a stream consumed to its end is not aborted (the log line means what the tests take it to)" do
    id = id()
    refute aborted?(id, fn -> assert [_ | _] = id |> generate([]) |> elem(1) |> Enum.to_list() end)
  end

  test "a stream stopped early (shared Multiplex stream) is aborted in the engine" do
    id = id()
    assert aborted?(id, fn -> assert [_, _, _] = id |> generate([]) |> elem(1) |> Enum.take(3) end)
  end

  test "a stream stopped early (a gRPC call of its own) is aborted in the engine" do
    id = id()
    assert aborted?(id, fn -> assert [_, _] = id |> generate(multiplex: false) |> elem(1) |> Enum.take(2) end)
  end

  test "a stream whose caller dies is aborted in the engine" do
    id = id()
    test = self()

    assert aborted?(id, fn ->
             pid =
               spawn(fn ->
                 id |> generate([]) |> elem(1) |> Stream.each(fn _ -> send(test, :item) end) |> Stream.run()
               end)

             assert_receive :item, 30_000
             # killed: the stream's after-function never runs; the multiplexer sees the caller go
             Process.exit(pid, :kill)
           end)
  end

  test "a stream past its deadline is aborted in the engine" do
    id = id()

    assert aborted?(id, fn ->
             # 50 ms: time enough to reach the engine, not to generate 200 tokens
             {:ok, stream} = generate(id, timeout: 50)
             assert %VllmBridge.Error{code: :deadline_exceeded} = catch_error(Enum.to_list(stream))
           end)
  end
end
