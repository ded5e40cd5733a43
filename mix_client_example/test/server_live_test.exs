defmodule VllmBridge.ServerLiveTest do
  # Starts real servers with VllmBridge.Server (VLLM_BRIDGE_VENV: the project's .venv); excluded
  # without it. The pool has no engine, so a server starts in seconds.
  use ExUnit.Case, async: false
  @moduletag :server
  @moduletag timeout: 300_000

  import ExUnit.CaptureLog

  alias VllmBridge.{Error, Server}

  @venv if System.get_env("VLLM_BRIDGE_VENV", "") != "", do: System.get_env("VLLM_BRIDGE_VENV")
  # --stdin-watch lands with the server side of the child spec; detected, so the rest can run before it
  @stdin_watch (@venv &&
                  System.cmd(Path.join([@venv, "bin", "vllm-bridge"]), ["serve", "--help"]) |> elem(0) =~
                    "--stdin-watch") || false

  setup_all do
    dir = Path.join(System.tmp_dir!(), "vb-server-live-#{System.unique_integer([:positive])}")
    File.mkdir_p!(dir)
    config = Path.join(dir, "plain.toml")
    File.write!(config, "[[pools]]\nname = \"plain\"\nworkers = 1\n")
    on_exit(fn -> File.rm_rf!(dir) end)
    %{config: config, dir: dir}
  end

  defp opts(ctx, name, extra \\ []) do
    [name: name, venv: @venv, config: ctx.config, stdin_watch: @stdin_watch, shutdown_timeout: 20_000] ++ extra
  end

  # The server's process and every process under it (workers, engine cores...).
  defp tree(os_pid) do
    {out, 0} = System.cmd("ps", ["-eo", "pid=,ppid="])

    children =
      out
      |> String.split("\n", trim: true)
      |> Enum.map(fn line -> line |> String.split() |> Enum.map(&String.to_integer/1) end)
      |> Enum.group_by(&Enum.at(&1, 1), &Enum.at(&1, 0))

    Stream.iterate([os_pid], fn pids -> Enum.flat_map(pids, &Map.get(children, &1, [])) end)
    |> Enum.take_while(&(&1 != []))
    |> List.flatten()
  end

  defp alive?(os_pid), do: match?({_, 0}, System.cmd("kill", ["-0", "#{os_pid}"], stderr_to_stdout: true))

  defp gone?(pids, within_ms) do
    Enum.any?(0..div(within_ms, 100), fn _ ->
      Process.sleep(100)
      not Enum.any?(pids, &alive?/1)
    end)
  end

  defp os_pid(name), do: name |> Server.whereis() |> :sys.get_state() |> Map.fetch!(:os_pid)

  test "start_link returns once it serves; calls reach it; stopping it stops every process it started", ctx do
    log =
      capture_log(fn ->
        {:ok, _} = start_supervised({Server, opts(ctx, :spec_a)})
        address = Server.address(:spec_a)
        assert address =~ ~r/^127\.0\.0\.1:\d+$/
        assert {:ok, :serving} = VllmBridge.Health.check(:spec_a)
        assert {:ok, 2} = Vllm.Distributed.divide(6, 3, __runtime__: [server: :spec_a])
        assert {:ok, [2]} = VllmBridge.collective("vllm.distributed.divide", [6, 3], __runtime__: [server: :spec_a])

        pids = tree(os_pid(:spec_a))
        assert length(pids) >= 2, "expected the server and its worker, got #{inspect(pids)}"
        :ok = stop_supervised({Server, :spec_a})
        assert gone?(pids, 10_000), "left running: #{inspect(Enum.filter(pids, &alive?/1))}"

        assert {:error, %Error{code: :unavailable, message: msg}} =
                 Vllm.Distributed.divide(6, 3, __runtime__: [server: :spec_a])

        assert msg =~ "is not serving"
      end)

    # its log lines reach Logger at their own level
    assert log =~ ~r/\[info\] .* INFO vllm_bridge.server: serving: plain/
    assert log =~ "vllm-bridge server :spec_a serving on 127.0.0.1:"
    assert log =~ "stopped (exit status 0)"
  end

  test "a server that dies is restarted by its supervisor, on a new port; calls work again", ctx do
    capture_log(fn ->
      {:ok, _} = start_supervised({Server, opts(ctx, :spec_b)})
      first = Server.address(:spec_b)
      pid = Server.whereis(:spec_b)
      pids = tree(os_pid(:spec_b))
      System.cmd("kill", ["-KILL", "#{os_pid(:spec_b)}"])
      # the workers follow their server (parent-death signal)
      assert gone?(pids, 10_000), "left running: #{inspect(Enum.filter(pids, &alive?/1))}"

      assert Enum.any?(1..600, fn _ ->
               Process.sleep(100)
               new = Server.whereis(:spec_b)
               new != nil and new != pid and Server.address(:spec_b) != nil
             end)

      assert Server.address(:spec_b) != first
      assert {:ok, 2} = Vllm.Distributed.divide(6, 3, __runtime__: [server: :spec_b])
    end)
  end

  test "a server that fails to start: start_link says why, with its last lines", ctx do
    Process.flag(:trap_exit, true)

    capture_log(fn ->
      assert {:error, {:exit_status, 2, lines}} = Server.start_link(opts(ctx, :spec_c, args: ["--no-such-flag"]))
      assert Enum.any?(lines, &(&1 =~ "unrecognized arguments: --no-such-flag"))
      bad = Path.join(ctx.dir, "bad.toml")
      File.write!(bad, "[[pools]]\nname = \"x\"\nworkers = -1\n")
      assert {:error, {:exit_status, 2, lines}} = Server.start_link(opts(ctx, :spec_c) |> Keyword.put(:config, bad))
      assert Enum.join(lines, "\n") =~ "workers"
    end)
  end

  if @stdin_watch do
    test "the BEAM killed (SIGKILL): nothing of the server remains", ctx do
      # another BEAM runs the server; it prints the server's os pid, then this test kills it
      paths = :code.get_path() |> Enum.map(&to_string/1) |> Enum.filter(&File.dir?/1)

      script = """
      {:ok, _} = Application.ensure_all_started(:vllm_bridge)
      {:ok, _} = Supervisor.start_link([{VllmBridge.Server, #{inspect(opts(ctx, :beam))}}], strategy: :one_for_one)
      IO.puts("SERVER " <> to_string(:sys.get_state(VllmBridge.Server.whereis(:beam)).os_pid) <> " BEAM " <> System.pid())
      Process.sleep(:infinity)
      """

      port =
        Port.open({:spawn_executable, System.find_executable("elixir")}, [
          :binary,
          :exit_status,
          :stderr_to_stdout,
          {:line, 65_536},
          args: Enum.flat_map(paths, &["-pa", &1]) ++ ["-e", script]
        ])

      {server, beam} = await_pids(port, System.monotonic_time(:millisecond) + 120_000)
      pids = tree(server)
      assert server in pids and length(pids) >= 2
      System.cmd("kill", ["-KILL", beam])
      assert gone?(pids, 30_000), "left running after the BEAM died: #{inspect(Enum.filter(pids, &alive?/1))}"
    end

    defp await_pids(port, deadline) do
      receive do
        {^port, {:data, {:eol, "SERVER " <> rest}}} ->
          [server, "BEAM", beam] = String.split(rest)
          {String.to_integer(server), beam}

        {^port, {:data, _}} ->
          await_pids(port, deadline)

        {^port, {:exit_status, status}} ->
          flunk("the other BEAM exited with status #{status}")
      after
        max(deadline - System.monotonic_time(:millisecond), 0) -> flunk("the other BEAM's server did not start")
      end
    end
  end
end
