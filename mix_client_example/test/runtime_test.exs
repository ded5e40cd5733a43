defmodule VllmBridge.RuntimeTest do
  # No server needed: runtime options are checked and merged before anything is sent.
  use ExUnit.Case, async: false

  alias VllmBridge.Runtime

  setup do
    saved = Application.get_all_env(:vllm_bridge)
    on_exit(fn -> restore(saved) end)
    :ok
  end

  defp restore(saved) do
    for {k, _} <- Application.get_all_env(:vllm_bridge),
        not Keyword.has_key?(saved, k),
        do: Application.delete_env(:vllm_bridge, k)

    for {k, v} <- saved, do: Application.put_env(:vllm_bridge, k, v)
  end

  defp raises(opts, pattern) do
    assert_raise ArgumentError, pattern, fn -> Vllm.Distributed.divide(6, 3, __runtime__: opts) end
  end

  test "a malformed option raises ArgumentError naming it, before anything is sent" do
    raises([timeout: -5], ~r/option :timeout: expected a positive integer \(ms\) or :infinity, got -5/)
    raises([timeout: "x"], ~r/option :timeout: .* got "x"/)
    raises([timeout: 0], ~r/option :timeout/)
    raises([timeout: 1.5], ~r/option :timeout/)
    raises([stream_timeout: -1], ~r/option :stream_timeout/)
    raises([stream_interval: -1], ~r/option :stream_interval/)

    raises(
      [timeout_profile: :nope],
      ~r/option :timeout_profile: expected one of :default, :ml_inference, :batch_job, :streaming, got :nope/
    )

    raises([affinity: "sometimes"], ~r/option :affinity: expected one of :hint, :strict_queue, :strict_fail_fast/)
    raises([session_id: ""], ~r/option :session_id/)
    raises([pool_name: 42], ~r/option :pool_name/)
    raises([rank: -1], ~r/option :rank/)
    raises([multiplex: :yes], ~r/option :multiplex/)
    raises([server: nil], ~r/option :server/)
    raises([tensors: :numpy], ~r/option :tensors/)

    raises(
      [stream_encoding: :patch_v3],
      ~r/option :stream_encoding: expected :patch_v2, :patch_v1 or :full, got :patch_v3/
    )

    raises([stream_encoding: "patch-v3,patch-v2"], ~r/option :stream_encoding/)
    raises([stream_encoding: "patch-v1,patch-v2"], ~r/option :stream_encoding/)
    raises([stream_tee: 1], ~r/option :stream_tee: expected true or false/)
    raises([timeot: 5], ~r/unknown option :timeot; known: \[:timeout,/)
    raises(:fast, ~r/__runtime__ must be a keyword list, got :fast/)
    # streams check before returning the stream, not when it is consumed
    assert_raise ArgumentError, ~r/option :stream_timeout/, fn ->
      Vllm.AsyncLLMEngine.generate(:engine, "x", %{}, "r", __runtime__: [stream_timeout: :forever])
    end
  end

  test "valid options normalize to what goes on the wire" do
    assert [timeout: 5, timeout_profile: "ml_inference", affinity: "hint", session_id: "s", pool_name: "p"] =
             Runtime.validate!(
               [timeout: 5, timeout_profile: :ml_inference, affinity: :hint, session_id: :s, pool_name: "p"],
               "t"
             )

    assert [timeout: nil, stream_timeout: :infinity] =
             Runtime.validate!([timeout: :infinity, stream_timeout: :infinity], "t")
  end

  test "metadata: the session always, the rest when set, refs for the router" do
    rt = %Runtime{
      timeout: 100,
      stream_timeout: :infinity,
      stream_interval: 0,
      pool_name: "llm",
      affinity: "hint",
      rank: 1
    }

    assert Runtime.metadata(rt, "own", ["w1.a", "w1.b"]) == %{
             "x-bridge-session" => "own",
             "x-bridge-stream-timeout-ms" => "inf",
             "x-bridge-stream-interval-ms" => "0",
             "x-bridge-pool" => "llm",
             "x-bridge-affinity" => "hint",
             "x-bridge-rank" => "1",
             "x-bridge-refs" => "w1.a,w1.b"
           }

    assert Runtime.metadata(%Runtime{session_id: "given"}, "own", []) == %{"x-bridge-session" => "given"}
  end

  test "streams ask for patch-v2, then patch-v1, unless the options say otherwise; unary calls send no encoding" do
    md = %{"x-bridge-session" => "s"}
    assert Runtime.stream_metadata(%Runtime{}, md) == Map.put(md, "x-bridge-stream-encoding", "patch-v2,patch-v1")

    for {opt, wire} <- [
          patch_v2: "patch-v2",
          patch_v1: "patch-v1",
          full: "full",
          "patch-v2": "patch-v2",
          "patch-v1": "patch-v1",
          "patch-v2,patch-v1": "patch-v2,patch-v1"
        ] do
      opt = if opt in [:patch_v2, :patch_v1, :full], do: opt, else: Atom.to_string(opt)
      assert [stream_encoding: ^wire] = Runtime.validate!([stream_encoding: opt], "t")
      assert Runtime.stream_metadata(%Runtime{stream_encoding: wire}, %{})["x-bridge-stream-encoding"] == wire
    end

    for full <- [:full, "full"] do
      [stream_encoding: wire] = Runtime.validate!([stream_encoding: full], "t")
      assert Runtime.stream_metadata(%Runtime{stream_encoding: wire}, %{})["x-bridge-stream-encoding"] == "full"
    end

    assert [stream_encoding: "patch-v1", stream_tee: true] =
             Runtime.validate!([stream_encoding: :patch_v1, stream_tee: true], "t")

    assert Runtime.stream_metadata(%Runtime{stream_tee: true}, %{}) == %{
             "x-bridge-stream-encoding" => "patch-v2,patch-v1",
             "x-bridge-stream-tee" => "1"
           }

    refute Map.has_key?(Runtime.metadata(%Runtime{}, "own", []), "x-bridge-stream-encoding")
    # app-wide: config :vllm_bridge, runtime: [stream_encoding: :full]
    Application.put_env(:vllm_bridge, :runtime, stream_encoding: :full)
    {rt, _} = Runtime.resolve!([])
    assert rt.stream_encoding == "full"
    {rt, _} = Runtime.resolve!(stream_encoding: :patch_v1)
    assert rt.stream_encoding == "patch-v1"
    {rt, _} = Runtime.resolve!(stream_encoding: :patch_v2)
    assert rt.stream_encoding == "patch-v2"
    Application.delete_env(:vllm_bridge, :runtime)
    {rt, _} = Runtime.resolve!([])
    assert rt.stream_encoding == "patch-v2,patch-v1"
  end

  test "defaults: the app's, then the server's, then the call's own" do
    Application.put_env(:vllm_bridge, :runtime, timeout_profile: :batch_job, pool_name: "app", timeout: 1_000)

    Application.put_env(:vllm_bridge, :servers,
      gpu: [address: "10.0.0.9:50051", runtime: [pool_name: "gpu-pool", affinity: :strict_queue]]
    )

    {rt, {:ok, server}} = Runtime.resolve!([])
    assert %{timeout_profile: "batch_job", pool_name: "app", timeout: 1_000, server: :default} = rt
    assert server.key == :default

    {rt, {:ok, server}} = Runtime.resolve!(server: :gpu, affinity: :hint, timeout: :infinity)
    assert %{timeout_profile: "batch_job", pool_name: "gpu-pool", affinity: "hint", timeout: nil, server: :gpu} = rt
    assert server.address == "10.0.0.9:50051"

    # a fallback server (the receiver ref's) is used only when no option names one
    {rt, _} = Runtime.resolve!([], :gpu)
    assert rt.server == :gpu
    {rt, _} = Runtime.resolve!([server: :default], :gpu)
    assert rt.server == :default

    # defaults are validated too, and say where they come from
    Application.put_env(:vllm_bridge, :runtime, timeout: -1)
    assert_raise ArgumentError, ~r/config :vllm_bridge, runtime:: option :timeout/, fn -> Runtime.resolve!([]) end
  end

  test "tensors: :nx needs Nx" do
    if Code.ensure_loaded?(Nx) do
      assert [tensors: :nx] = Runtime.validate!([tensors: :nx], "t")
    else
      assert_raise ArgumentError, ~r/Nx is not loaded/, fn -> Runtime.validate!([tensors: :nx], "t") end
    end
  end
end
