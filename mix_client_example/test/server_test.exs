defmodule VllmBridge.ServerTest do
  # No Python needed: the command line, option checks, log levels, and the lifecycle with stand-in
  # programs (a shell script that fails, one that never serves and ignores SIGTERM).
  use ExUnit.Case, async: false

  import ExUnit.CaptureLog

  alias VllmBridge.Server

  @fixture Path.expand("fixtures/serve_command.tsv", __DIR__)

  # start_link/1 fails the way GenServers do: {:error, reason} and an exit signal to the caller.
  setup do
    Process.flag(:trap_exit, true)
    :ok
  end

  # The options each case of the fixture is built from.
  @cases %{
    "default" => [venv: "/VENV"],
    "config" => [venv: "/VENV", config: "CONFIG", args: ["--workers", "1"]],
    "token" => [venv: "/VENV", config: "CONFIG", token_file: "TOKEN_FILE"],
    "tls" => [
      venv: "/VENV",
      config: "CONFIG",
      tls: [certfile: "CERT", keyfile: "KEY", client_cafile: "CLIENT_CA"]
    ],
    "insecure" => [venv: "/VENV", config: "CONFIG", listen: "0.0.0.0:0", insecure: true]
  }

  test "the command line is the one the Python side runs (test/fixtures/serve_command.tsv)" do
    lines = @fixture |> File.read!() |> String.split("\n", trim: true) |> Enum.reject(&String.starts_with?(&1, "#"))
    fixture = Map.new(lines, fn line -> line |> String.split("\t") |> then(fn [name | args] -> {name, args} end) end)
    assert Map.keys(fixture) |> Enum.sort() == Map.keys(@cases) |> Enum.sort()

    for {name, opts} <- @cases do
      assert Server.command(opts, "READY_FILE") == {"/VENV/bin/vllm-bridge", fixture[name]}, "case #{name}"
    end
  end

  test "command options" do
    sh = System.find_executable("sh")

    assert {^sh, ["-c", "x", "serve", "--listen", "unix:/tmp/s.sock", "--stdin-watch"]} =
             Server.command([command: ["sh", "-c", "x"], listen: "unix:/tmp/s.sock"], "R")

    assert {_, ["serve", "--listen", "127.0.0.1:7000"]} =
             Server.command([command: "/opt/vb/bin/vllm-bridge", listen: "127.0.0.1:7000", stdin_watch: false], "R")
  end

  test "malformed options raise ArgumentError naming them" do
    for {opts, pattern} <- [
          {[colour: 1], ~r/unknown options \[:colour\]/},
          {[venv: "/v", command: "x"], ~r/give :venv or :command, not both/},
          {[command: "no-such-program-here"], ~r/is not on PATH/},
          {[name: "x"], ~r/option :name: expected an atom/},
          {[listen: "nowhere"], ~r/option :listen: address "nowhere"/},
          {[args: "--workers 2"], ~r/option :args: expected a list of strings/},
          {[token: "t", token_file: "f"], ~r/give :token or :token_file/},
          {[tls: [certfile: "c"]], ~r/option :tls: expected both :certfile and :keyfile/},
          {[startup_timeout: 0], ~r/option :startup_timeout/},
          {[log: :loud], ~r/option :log/}
        ] do
      opts = if Keyword.has_key?(opts, :venv) or Keyword.has_key?(opts, :command), do: opts, else: [venv: "/v"] ++ opts
      assert_raise ArgumentError, pattern, fn -> Server.command(opts, "R") end
    end
  end

  test "log levels: as each line names them" do
    assert Server.line_level("2026-11-23 20:33:21,304 INFO vllm_bridge.worker: serving") == :info
    assert Server.line_level("2026-11-23 20:33:21,304 WARNING vllm_bridge.pool: slow") == :warning
    assert Server.line_level("2026-11-23 20:33:21,304 ERROR x: y") == :error
    assert Server.line_level("INFO 11-23 20:35:12 [importing.py:68] Triton not installed") == :info
    assert Server.line_level("W1123 20:35:12.391000 19178 torch/utils/cpp_extension.py:117] No CUDA") == :warning
    assert Server.line_level("  File \"x.py\", line 3, in f") == nil
    assert Server.line_level("Traceback (most recent call last):") == nil
  end

  test "a server that exits before serving: start_link fails with its last lines, logged" do
    script = "echo 'ERROR cannot load the model'; echo '  File \"m.py\", line 1'; exit 3"

    log =
      capture_log(fn ->
        assert {:error, {:exit_status, 3, lines}} =
                 Server.start_link(name: :failing, command: ["/bin/sh", "-c", script, "sh"], startup_timeout: 10_000)

        assert lines == ["ERROR cannot load the model", "  File \"m.py\", line 1"]
      end)

    assert log =~ "[error] ERROR cannot load the model"
    # a traceback line goes at the level of the line before it
    assert log =~ "[error]   File \"m.py\", line 1"
    assert log =~ "exited with status 3 before it served; its last lines:"
    assert {:error, %VllmBridge.Error{code: :unavailable}} = VllmBridge.Config.server(:failing)
  end

  test "a server that never serves is stopped after :startup_timeout, killed if it ignores SIGTERM" do
    dir = Path.join(System.tmp_dir!(), "vb-server-test-#{System.unique_integer([:positive])}")
    File.mkdir_p!(dir)
    pidfile = Path.join(dir, "pid")
    on_exit(fn -> File.rm_rf!(dir) end)
    # ignores SIGTERM; records its pid
    script = "trap '' TERM; echo $$ > #{pidfile}; echo 'INFO starting'; while :; do sleep 0.1; done"

    log =
      capture_log(fn ->
        assert {:error, {:startup_timeout, 1_000, ["INFO starting"]}} =
                 Server.start_link(
                   name: :stuck,
                   command: ["/bin/sh", "-c", script, "sh"],
                   startup_timeout: 1_000,
                   shutdown_timeout: 500
                 )
      end)

    assert log =~ "did not serve within 1000 ms"
    assert log =~ "ignored SIGTERM for 500 ms: killing it"
    os_pid = pidfile |> File.read!() |> String.trim()
    refute alive?(os_pid)
  end

  test "one server per name" do
    script = "while :; do sleep 0.1; done"
    test = self()

    capture_log(fn ->
      spawn_link(fn ->
        send(
          test,
          {:first, Server.start_link(name: :twice, command: ["/bin/sh", "-c", script, "sh"], startup_timeout: 2_000)}
        )
      end)

      Process.sleep(300)

      assert {:error, {:already_started, pid}} =
               Server.start_link(name: :twice, command: ["/bin/sh", "-c", script, "sh"], startup_timeout: 2_000)

      assert pid == Server.whereis(:twice)
      assert_receive {:first, {:error, {:startup_timeout, _, _}}}, 5_000
    end)
  end

  defp alive?(os_pid), do: match?({_, 0}, System.cmd("kill", ["-0", os_pid], stderr_to_stdout: true))
end
