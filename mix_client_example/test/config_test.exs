defmodule VllmBridge.ConfigTest do
  # No server needed: which server a call goes to, and how it connects.
  use ExUnit.Case, async: false

  alias VllmBridge.{Config, Error}

  setup do
    saved = Application.get_all_env(:vllm_bridge)
    saved_env = for k <- ~w(VLLM_BRIDGE_ADDRESS VLLM_BRIDGE_TOKEN), do: {k, System.get_env(k)}

    on_exit(fn ->
      for {k, _} <- Application.get_all_env(:vllm_bridge),
          not Keyword.has_key?(saved, k),
          do: Application.delete_env(:vllm_bridge, k)

      for {k, v} <- saved, do: Application.put_env(:vllm_bridge, k, v)
      for {k, v} <- saved_env, do: if(v, do: System.put_env(k, v), else: System.delete_env(k))
      Config.unregister(:test_registered)
    end)

    System.delete_env("VLLM_BRIDGE_TOKEN")
    :ok
  end

  test "the default server: config address, else $VLLM_BRIDGE_ADDRESS, else 127.0.0.1:50051" do
    Application.delete_env(:vllm_bridge, :address)
    System.delete_env("VLLM_BRIDGE_ADDRESS")

    assert {:ok, %{key: :default, address: "127.0.0.1:50051", endpoint: {:tcp, ~c"127.0.0.1", 50051}}} =
             Config.server(nil)

    System.put_env("VLLM_BRIDGE_ADDRESS", "localhost:6000")
    assert {:ok, %{address: "localhost:6000"}} = Config.server(:default)
    Application.put_env(:vllm_bridge, :address, "10.1.2.3:7000")
    assert {:ok, %{address: "10.1.2.3:7000"}} = Config.server(:default)
    Application.put_env(:vllm_bridge, :default_server, :gpu)
    Application.put_env(:vllm_bridge, :servers, gpu: [address: "gpu:1"])
    assert {:ok, %{key: :gpu, address: "gpu:1"}} = Config.server(nil)
  end

  test "addresses: host:port, [ipv6]:port, unix sockets; others refused" do
    assert {:ok, %{key: "[::1]:5", endpoint: {:tcp, ~c"::1", 5}}} = Config.server("[::1]:5")
    assert {:ok, %{endpoint: {:unix, "/run/b.sock"}}} = Config.server("unix:/run/b.sock")
    assert {:ok, %{endpoint: {:unix, "/run/b.sock"}}} = Config.server("unix:///run/b.sock")
    assert {:ok, %{endpoint: {:tcp, ~c"h", 1}}} = Config.server("dns:///h:1")

    for bad <- ["nohost", "h:0", "h:99999", "h:port", ":5"] do
      assert_raise ArgumentError, ~r/is not host:port|bad port/, fn -> Config.server(bad) end
    end
  end

  test "named servers, over the top-level connection options; unknown names are refused" do
    Application.put_env(:vllm_bridge, :keepalive, 20_000)
    Application.put_env(:vllm_bridge, :token, "top")

    Application.put_env(:vllm_bridge, :servers,
      a: [address: "a:1"],
      b: [address: "b:1", keepalive: :infinity, token_file: "/run/t", tls: [cacertfile: "/ca.pem"]]
    )

    assert {:ok, %{keepalive: 20_000, token: {:token, "top"}, tls: false}} = Config.server(:a)
    assert {:ok, %{keepalive: :infinity, token: {:file, "/run/t"}, tls: [cacertfile: "/ca.pem"]}} = Config.server(:b)

    assert_raise ArgumentError, ~r/unknown server :c: configure it .*known: \[:default, :a, :b/, fn ->
      Config.server(:c)
    end
  end

  test "the token: given, a file, else $VLLM_BRIDGE_TOKEN" do
    Application.put_env(:vllm_bridge, :servers, a: [address: "a:1"])
    assert {:ok, %{token: nil}} = Config.server(:a)
    System.put_env("VLLM_BRIDGE_TOKEN", "from-env")
    assert {:ok, %{token: {:token, "from-env"}}} = Config.server(:a)
    Application.put_env(:vllm_bridge, :servers, a: [address: "a:1", token: "t", token_file: "f"])
    assert_raise ArgumentError, ~r/give :token or :token_file, not both/, fn -> Config.server(:a) end
    Application.put_env(:vllm_bridge, :servers, a: [address: "a:1", token: ""])
    assert_raise ArgumentError, ~r/token: expected a non-empty string/, fn -> Config.server(:a) end
  end

  test "keepalive: no more often than the servers accept" do
    assert Config.min_keepalive() == 10_000

    for ok <- [10_000, 30_000, :infinity] do
      Application.put_env(:vllm_bridge, :servers, a: [address: "a:1", keepalive: ok])
      assert {:ok, %{keepalive: ^ok}} = Config.server(:a)
    end

    for bad <- [9_999, 0, -1, "30s", nil] do
      Application.put_env(:vllm_bridge, :servers, a: [address: "a:1", keepalive: bad])
      assert_raise ArgumentError, ~r/keepalive: expected ms >= 10000/, fn -> Config.server(:a) end
    end
  end

  test "tls and other options are checked" do
    for {opts, pattern} <- [
          {[tls: :yes], ~r/tls: expected true, false or a keyword list/},
          {[tls: [certfile: "c.pem"]], ~r/needs both :certfile and :keyfile/},
          {[connect_timeout: 0], ~r/connect_timeout: expected a positive integer/},
          {[colour: :blue], ~r/unknown options \[:colour\]/}
        ] do
      Application.put_env(:vllm_bridge, :servers, a: [address: "a:1"] ++ opts)
      assert_raise ArgumentError, pattern, fn -> Config.server(:a) end
    end

    Application.put_env(:vllm_bridge, :servers, a: [address: "a:1", tls: true])
    assert {:ok, %{tls: true}} = Config.server(:a)
  end

  test "a server a VllmBridge.Server runs: its address while up, an error otherwise" do
    Config.register(:test_registered, :starting)
    assert {:error, %Error{code: :unavailable, message: msg}} = Config.server(:test_registered)
    assert msg =~ "is not serving: its VllmBridge.Server is starting"

    Config.register(:test_registered, :up, address: "127.0.0.1:4242", token_file: "/run/tok")
    assert {:ok, %{address: "127.0.0.1:4242", token: {:file, "/run/tok"}}} = Config.server(:test_registered)

    # calls to it fail at once, with the reason, when it is not up
    Config.register(:test_registered, :stopped)

    assert {:error, %Error{category: "grpc_error", code: :unavailable}} =
             Vllm.Distributed.divide(6, 3, __runtime__: [server: :test_registered])
  end

  test "calls to a server that does not answer fail with :unavailable" do
    assert {:error, %Error{category: "grpc_error", code: :unavailable, message: msg}} =
             Vllm.Distributed.divide(6, 3, __runtime__: [server: "127.0.0.1:1"])

    assert msg =~ "cannot connect to 127.0.0.1:1"

    {:ok, stream} = VllmBridge.iterate("it", __runtime__: [server: "127.0.0.1:1"])
    assert %Error{code: :unavailable} = catch_error(Enum.to_list(stream))
  end

  test "callers that wait for a failing connection get its error, not one attempt each in turn" do
    # a port whose accept queue is full: each attempt waits the whole connect_timeout
    {:ok, listen} = :gen_tcp.listen(0, backlog: 0, ip: {127, 0, 0, 1})
    {:ok, port} = :inet.port(listen)
    fillers = for _ <- 1..4, do: :gen_tcp.connect(~c"127.0.0.1", port, [], 200)
    assert Enum.any?(fillers, &match?({:error, :timeout}, &1)), "the accept queue did not fill"
    Application.put_env(:vllm_bridge, :servers, slow: [address: "127.0.0.1:#{port}", connect_timeout: 1_000])
    started = System.monotonic_time(:millisecond)

    results =
      1..8
      |> Task.async_stream(fn _ -> VllmBridge.Health.check(:slow) end, max_concurrency: 8, timeout: 30_000)
      |> Enum.map(fn {:ok, r} -> r end)

    assert Enum.all?(results, &match?({:error, %Error{code: :unavailable}}, &1))
    assert System.monotonic_time(:millisecond) - started < 3_000
  end

  test "a token file that cannot be read fails the connection, saying so" do
    Application.put_env(:vllm_bridge, :servers, t: [address: "127.0.0.1:1", token_file: "/nonexistent/token"])
    assert {:error, %Error{code: :unavailable, message: msg}} = VllmBridge.Health.check(:t)

    assert msg =~ "cannot read the token file /nonexistent/token"
  end
end
