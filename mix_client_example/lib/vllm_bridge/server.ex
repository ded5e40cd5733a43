defmodule VllmBridge.Server do
  @moduledoc """
  Runs the vllm-bridge server (`vllm-bridge serve`) as a child of a supervision tree.

      children = [
        {VllmBridge.Server, venv: "/opt/vllm-bridge/.venv", config: "/etc/vllm-bridge/pools.toml"},
        MyApp.Generator   # may call Vllm.* at once: the server is serving when this starts
      ]

      Supervisor.start_link(children, strategy: :rest_for_one)

  `start_link/1` starts the server and returns once its health check (`grpc.health.v1`, the
  overall service) says SERVING, so the children after it can call it at once; calls that name no
  server go to it (it is the `:default` server unless `:name` says otherwise). If the server exits
  before that, or does not serve within `:startup_timeout`, `start_link/1` fails with
  `{:exit_status, status, last_lines}` or `{:startup_timeout, ms, last_lines}`: the server's own
  last log lines, also logged as an error.

  The server's log lines (its stdout and stderr) go to `Logger`, at the level each line names
  (`INFO`, `WARNING`, `ERROR`...; a line without one, such as a traceback's, at the level of the
  line before), with metadata `vllm_bridge_server: name` and `os_pid`.

  If the server dies, this process exits with `{:server_exited, status}` and its supervisor
  restarts it (on a new port when the port is chosen by the system); calls made meanwhile fail at
  once with category `grpc_error` / `:unavailable`. When the supervisor stops it (the application
  stops), the server gets SIGTERM, stops taking calls, lets the running ones finish within its
  grace period, and stops every worker and engine it started; after `:shutdown_timeout` it is
  killed (its workers follow it: each has the server as its parent-death signal). If the BEAM
  itself dies, even by SIGKILL, the server's stdin (a pipe from the BEAM) reaches end-of-file and
  the server stops the same way (`--stdin-watch`).

  ## Options

    * `:name` - the server's name for calls (`__runtime__: [server: name]`, `VllmBridge.Config`);
      default `:default`. Also the child's id.
    * `:venv` - the vllm-bridge project's `.venv` (or any environment where it is installed):
      runs `<venv>/bin/vllm-bridge`.
    * `:command` - what to run instead: an executable (a path, or a name looked up on `PATH`), or
      a list `[executable | args]` (`["python3", "-m", "bridge_server.cli"]`). Default
      `"vllm-bridge"`.
    * `:config` - the pool config file (`--config`); without it, the built-in default pool.
    * `:listen` - the address to listen on (`--listen`): `"host:port"` or `"unix:/path"`; default
      `"127.0.0.1:0"`, a free port the system picks (the server reports it when it is up).
    * `:args` - more arguments for `vllm-bridge serve` (`["--workers", "2", "--metrics-port", "0"]`).
    * `:env` - environment variables for the server, a map or list of `{name, value}`
      (`nil` unsets one); the rest is inherited. `PYTHONUNBUFFERED=1` is set unless given.
    * `:cd` - the server's working directory.
    * `:token` or `:token_file` - the bearer token the server requires (`--token-file`; a `:token`
      is written to a file only this user can read, removed when the server stops). The client
      sends it on every call to this server.
    * `:tls` - the server's certificate: `[certfile: path, keyfile: path]` (`--tls-cert`,
      `--tls-key`), plus `client_cafile: path` (`--tls-client-ca`) to require client certificates.
    * `:insecure` - `true` passes `--insecure`: the explicit opt-out the server requires to listen
      beyond the loopback interface without TLS and a token.
    * `:connect` - how the client connects to it, as for a configured server (`VllmBridge.Config`):
      `:tls` (default with a server `:tls`: `[cacertfile: certfile]`, which fits a self-signed
      certificate), `:keepalive`, `:connect_timeout`, `:runtime`.
    * `:startup_timeout` - ms to wait for SERVING (default 600,000: the first start of the
      default pool builds its model).
    * `:shutdown_timeout` - ms the server gets after SIGTERM before it is killed (default 30,000).
    * `:log` - the Logger level of lines that name none and follow none (default `:info`), or
      `false` to drop the server's lines.
    * `:stdin_watch` - pass `--stdin-watch` (default `true`; see above).

  The command line, for reference (`command/2` builds it):

      vllm-bridge serve --listen 127.0.0.1:0 --stdin-watch --ready-file FILE [--config FILE]
        [--token-file FILE] [--tls-cert FILE --tls-key FILE [--tls-client-ca FILE]] [--insecure] ARGS...
  """
  use GenServer

  require Logger

  alias VllmBridge.{Config, Connection, Health}

  @levels %{
    "DEBUG" => :debug,
    "INFO" => :info,
    "WARNING" => :warning,
    "WARN" => :warning,
    "ERROR" => :error,
    "CRITICAL" => :error,
    "FATAL" => :error
  }
  @keep_lines 40
  @poll_ms 250
  @known [
    :name,
    :venv,
    :command,
    :config,
    :listen,
    :args,
    :env,
    :cd,
    :token,
    :token_file,
    :tls,
    :insecure,
    :connect,
    :startup_timeout,
    :shutdown_timeout,
    :log,
    :stdin_watch
  ]

  @typedoc "Options of `start_link/1` (see the module doc)."
  @type option ::
          {:name, atom()}
          | {:venv, Path.t()}
          | {:command, String.t() | [String.t()]}
          | {:config, Path.t()}
          | {:listen, String.t()}
          | {:args, [String.t()]}
          | {:env, %{optional(String.t()) => String.t() | nil} | [{String.t(), String.t() | nil}]}
          | {:cd, Path.t()}
          | {:token, String.t()}
          | {:token_file, Path.t()}
          | {:tls, keyword()}
          | {:insecure, boolean()}
          | {:connect, keyword()}
          | {:startup_timeout, pos_integer()}
          | {:shutdown_timeout, pos_integer()}
          | {:log, Logger.level() | false}
          | {:stdin_watch, boolean()}

  @doc "A child spec: `{VllmBridge.Server, opts}` (the id is the server's name)."
  @spec child_spec([option()]) :: Supervisor.child_spec()
  def child_spec(opts) do
    name = Keyword.get(opts, :name, :default)

    %{
      id: {__MODULE__, name},
      start: {__MODULE__, :start_link, [opts]},
      # the server gets :shutdown_timeout after SIGTERM, then a moment to be killed and reaped
      shutdown: Keyword.get(opts, :shutdown_timeout, 30_000) + 5_000,
      type: :worker
    }
  end

  @doc """
  Starts the server; returns `{:ok, pid}` once it serves (see the module doc). One server per
  name: a second one gets `{:error, {:already_started, pid}}`.
  """
  @spec start_link([option()]) :: GenServer.on_start()
  def start_link(opts) do
    check!(opts)
    name = Keyword.get(opts, :name, :default)

    GenServer.start_link(__MODULE__, opts,
      name: {:via, Registry, {VllmBridge.ServerRegistry, name}},
      timeout: :infinity
    )
  end

  @doc "The process of the server named `name`, or nil."
  @spec whereis(atom()) :: pid() | nil
  def whereis(name \\ :default) do
    case Registry.lookup(VllmBridge.ServerRegistry, name) do
      [{pid, _}] -> pid
      [] -> nil
    end
  end

  @doc "The address the server named `name` serves, once it serves; `nil` before that."
  @spec address(atom()) :: String.t() | nil
  def address(name \\ :default) do
    case Config.server(name) do
      {:ok, %{address: address}} -> if registered?(name), do: address
      _ -> nil
    end
  rescue
    ArgumentError -> nil
  end

  defp registered?(name), do: match?([{_, :up, _}], :ets.lookup(:vllm_bridge_servers, name))

  @doc """
  The command line the server runs with: `{executable, args}`. `ready_file` is where the server
  writes its port once it serves (only used when the port is 0). Raises `ArgumentError` for
  malformed options.
  """
  @spec command([option()], Path.t() | nil) :: {String.t(), [String.t()]}
  def command(opts, ready_file \\ nil) do
    check!(opts)
    {exe, pre} = executable(opts)
    listen = Keyword.get(opts, :listen, "127.0.0.1:0")
    tls = Keyword.get(opts, :tls, [])

    args =
      pre ++
        ["serve", "--listen", listen] ++
        if(Keyword.get(opts, :stdin_watch, true), do: ["--stdin-watch"], else: []) ++
        if(ready_file && port_zero?(listen), do: ["--ready-file", ready_file], else: []) ++
        flag("--config", opts[:config]) ++
        flag("--token-file", opts[:token_file]) ++
        flag("--tls-cert", tls[:certfile]) ++
        flag("--tls-key", tls[:keyfile]) ++
        flag("--tls-client-ca", tls[:client_cafile]) ++
        if(opts[:insecure], do: ["--insecure"], else: []) ++
        Keyword.get(opts, :args, [])

    {exe, args}
  end

  defp flag(_name, nil), do: []
  defp flag(name, value), do: [name, to_string(value)]

  defp executable(opts) do
    case {opts[:venv], opts[:command]} do
      {nil, nil} -> {find!("vllm-bridge"), []}
      {venv, nil} -> {Path.join([Path.expand(venv), "bin", "vllm-bridge"]), []}
      {nil, [exe | pre]} -> {find!(exe), Enum.map(pre, &to_string/1)}
      {nil, exe} -> {find!(exe), []}
      _ -> raise ArgumentError, "VllmBridge.Server: give :venv or :command, not both"
    end
  end

  defp find!(exe) do
    cond do
      String.contains?(exe, "/") -> Path.expand(exe)
      path = System.find_executable(exe) -> path
      true -> raise ArgumentError, "VllmBridge.Server: #{exe} is not on PATH; give :venv or :command"
    end
  end

  defp port_zero?(listen), do: String.ends_with?(listen, ":0")

  defp check!(opts) do
    unless Keyword.keyword?(opts),
      do: raise(ArgumentError, "VllmBridge.Server: expected a keyword list, got #{inspect(opts)}")

    case Keyword.keys(opts) -- @known do
      [] -> :ok
      bad -> raise ArgumentError, "VllmBridge.Server: unknown options #{inspect(bad)}; known: #{inspect(@known)}"
    end

    name = Keyword.get(opts, :name, :default)
    if not is_atom(name) or name in [nil, true, false], do: bad!(:name, "an atom", name)

    for key <- [:config, :token_file, :cd, :venv], v = opts[key], v != nil, not is_binary(v), do: bad!(key, "a path", v)
    listen = Keyword.get(opts, :listen, "127.0.0.1:0")
    if not is_binary(listen), do: bad!(:listen, "an address string", listen)
    # port 0: the system picks one
    Config.endpoint!(String.replace_suffix(listen, ":0", ":1"), "VllmBridge.Server: option :listen")

    args = Keyword.get(opts, :args, [])
    if not (is_list(args) and Enum.all?(args, &is_binary/1)), do: bad!(:args, "a list of strings", args)

    if opts[:token] && opts[:token_file],
      do: raise(ArgumentError, "VllmBridge.Server: give :token or :token_file, not both")

    if opts[:token] && not (is_binary(opts[:token]) and opts[:token] != ""),
      do: bad!(:token, "a non-empty string", opts[:token])

    tls = Keyword.get(opts, :tls, [])

    if not (Keyword.keyword?(tls) and Keyword.keys(tls) -- [:certfile, :keyfile, :client_cafile] == []),
      do: bad!(:tls, "a keyword list of :certfile, :keyfile, :client_cafile", tls)

    if tls != [] and (tls[:certfile] == nil or tls[:keyfile] == nil),
      do: bad!(:tls, "both :certfile and :keyfile", tls)

    for key <- [:startup_timeout, :shutdown_timeout],
        v = opts[key],
        v != nil,
        not (is_integer(v) and v > 0),
        do: bad!(key, "a positive integer (ms)", v)

    for key <- [:insecure, :stdin_watch], v = opts[key], v != nil, not is_boolean(v), do: bad!(key, "a boolean", v)

    log = Keyword.get(opts, :log, :info)
    if log not in [false, :debug, :info, :notice, :warning, :error], do: bad!(:log, "a Logger level or false", log)

    connect = Keyword.get(opts, :connect, [])
    if not Keyword.keyword?(connect), do: bad!(:connect, "a keyword list", connect)
    :ok
  end

  defp bad!(key, expected, got),
    do: raise(ArgumentError, "VllmBridge.Server: option #{inspect(key)}: expected #{expected}, got #{inspect(got)}")

  # ------------------------------------------------------------------------------------ process

  @impl true
  def init(opts) do
    Process.flag(:trap_exit, true)
    name = Keyword.get(opts, :name, :default)
    Config.register(name, :starting)

    state = %{
      name: name,
      opts: opts,
      port: nil,
      os_pid: nil,
      lines: :queue.new(),
      count: 0,
      partial: "",
      level: Keyword.get(opts, :log, :info),
      last_level: Keyword.get(opts, :log, :info),
      tmp: [],
      ready_file: nil,
      address: nil,
      client: nil
    }

    try do
      case state |> prepare_files() |> open_port() |> await_serving() do
        {:ok, _} = ok ->
          ok

        {:stop, _} = stop ->
          Config.register(name, :failed)
          stop
      end
    rescue
      e ->
        Config.register(name, :failed)
        cleanup(state)
        reraise e, __STACKTRACE__
    end
  end

  defp prepare_files(state) do
    opts = state.opts
    dir = System.tmp_dir!()
    tag = "vllm-bridge-#{System.unique_integer([:positive])}-#{:os.getpid()}"

    {opts, tmp} =
      case opts[:token] do
        nil ->
          {opts, []}

        token ->
          path = Path.join(dir, tag <> ".token")
          write_private!(path, token)
          {opts |> Keyword.delete(:token) |> Keyword.put(:token_file, path), [path]}
      end

    listen = Keyword.get(opts, :listen, "127.0.0.1:0")
    ready = if port_zero?(listen), do: Path.join(dir, tag <> ".port")
    %{state | opts: opts, tmp: tmp ++ List.wrap(ready), ready_file: ready}
  end

  defp write_private!(path, contents) do
    File.rm(path)
    {:ok, file} = :file.open(String.to_charlist(path), [:write, :exclusive, :binary])
    :ok = File.chmod(path, 0o600)
    :ok = IO.binwrite(file, contents)
    :ok = File.close(file)
  end

  defp open_port(state) do
    {exe, args} = command(state.opts, state.ready_file)

    unless File.regular?(exe),
      do: raise(ArgumentError, "VllmBridge.Server #{inspect(state.name)}: #{exe} does not exist")

    env = env(Keyword.get(state.opts, :env, []))

    port_opts =
      [:binary, :exit_status, :stderr_to_stdout, {:line, 16_384}, :hide, args: args, env: env] ++
        if(state.opts[:cd], do: [cd: state.opts[:cd]], else: [])

    port = Port.open({:spawn_executable, exe}, port_opts)
    # nil when it has exited already (its exit status is on its way)
    os_pid = with {:os_pid, pid} <- Port.info(port, :os_pid), do: pid
    Logger.info("vllm-bridge server #{inspect(state.name)} started (os pid #{os_pid}): #{Enum.join([exe | args], " ")}")
    %{state | port: port, os_pid: os_pid}
  end

  defp env(env) do
    pairs = Enum.map(env, fn {k, v} -> {to_string(k), v && to_string(v)} end)
    pairs = if List.keymember?(pairs, "PYTHONUNBUFFERED", 0), do: pairs, else: [{"PYTHONUNBUFFERED", "1"} | pairs]
    Enum.map(pairs, fn {k, v} -> {String.to_charlist(k), if(v, do: String.to_charlist(v), else: false)} end)
  end

  # ------------------------------------------------------------------------------------ startup

  defp await_serving(state) do
    timeout = Keyword.get(state.opts, :startup_timeout, 600_000)
    deadline = System.monotonic_time(:millisecond) + timeout
    wait(state, deadline, timeout)
  end

  defp wait(%{port: port} = state, deadline, timeout) do
    receive do
      {^port, {:data, data}} ->
        wait(output(state, data), deadline, timeout)

      {^port, {:exit_status, status}} ->
        lines = last_lines(state)
        Logger.error(failure("exited with status #{status} before it served", state.name, lines))
        cleanup(%{state | port: nil})
        {:stop, {:exit_status, status, lines}}

      {:EXIT, _from, reason} ->
        stop_server(state)
        cleanup(state)
        {:stop, reason}
    after
      @poll_ms ->
        cond do
          serving?(state) ->
            {:ok, up(state)}

          System.monotonic_time(:millisecond) > deadline ->
            lines = last_lines(state)
            Logger.error(failure("did not serve within #{timeout} ms", state.name, lines))
            state = stop_server(state)
            cleanup(state)
            {:stop, {:startup_timeout, timeout, lines}}

          true ->
            wait(state, deadline, timeout)
        end
    end
  end

  defp failure(what, name, lines) do
    "vllm-bridge server #{inspect(name)} #{what}; its last lines:\n" <> Enum.join(lines, "\n")
  end

  defp serving?(state) do
    case client(state) do
      nil ->
        false

      client ->
        case Health.probe(client, timeout: 2_000) do
          {:ok, :serving} -> true
          _ -> false
        end
    end
  end

  # The client's view of the server: its address (the port from the ready file when the system
  # picks it), token and TLS, as a resolved Config.Server.
  defp client(state) do
    with address when address != nil <- served_address(state) do
      Config.build(state.name, client_opts(state, address), "VllmBridge.Server #{inspect(state.name)}")
    end
  end

  defp served_address(%{ready_file: nil, opts: opts}), do: opts |> Keyword.get(:listen, "127.0.0.1:0") |> local()

  defp served_address(%{ready_file: file, opts: opts}) do
    case File.read(file) do
      {:ok, text} ->
        case Integer.parse(String.trim(text)) do
          {port, ""} when port > 0 ->
            listen = Keyword.get(opts, :listen, "127.0.0.1:0")
            local(String.replace_suffix(listen, ":0", ":#{port}"))

          _ ->
            nil
        end

      _ ->
        nil
    end
  end

  # A server listening on every interface is reached over the loopback one.
  defp local("0.0.0.0:" <> port), do: "127.0.0.1:" <> port
  defp local("[::]:" <> port), do: "[::1]:" <> port
  defp local(address), do: address

  defp client_opts(state, address) do
    connect = Keyword.get(state.opts, :connect, [])
    tls = Keyword.get(state.opts, :tls, [])

    client_tls =
      case {Keyword.fetch(connect, :tls), tls} do
        {{:ok, given}, _} -> given
        {:error, []} -> false
        {:error, server_tls} -> [cacertfile: server_tls[:certfile]]
      end

    token = if f = state.opts[:token_file], do: [token_file: f], else: []
    [address: address, tls: client_tls] ++ token ++ Keyword.drop(connect, [:tls, :address])
  end

  defp up(state) do
    address = served_address(state)
    Config.register(state.name, :up, client_opts(state, address))
    Logger.info("vllm-bridge server #{inspect(state.name)} serving on #{address}")
    %{state | address: address}
  end

  # ------------------------------------------------------------------------------------ running

  @impl true
  def handle_info({port, {:data, data}}, %{port: port} = state), do: {:noreply, output(state, data)}

  def handle_info({port, {:exit_status, status}}, %{port: port} = state) do
    Logger.error(failure("exited with status #{status}", state.name, last_lines(state)))
    {:stop, {:server_exited, status}, %{state | port: nil}}
  end

  def handle_info({:EXIT, _from, reason}, state), do: {:stop, reason, state}
  def handle_info(_msg, state), do: {:noreply, state}

  @impl true
  def terminate(_reason, state) do
    Config.register(state.name, :stopped)
    Connection.close(state.name)
    state = stop_server(state)
    cleanup(state)
  end

  # SIGTERM, then the server's log until it exits; SIGKILL after :shutdown_timeout.
  defp stop_server(%{port: nil} = state), do: state

  defp stop_server(%{os_pid: nil} = state) do
    {_, state} = drain(state, System.monotonic_time(:millisecond) + 5_000)
    state
  end

  defp stop_server(%{port: port, os_pid: os_pid} = state) do
    grace = Keyword.get(state.opts, :shutdown_timeout, 30_000)
    signal("TERM", os_pid)
    deadline = System.monotonic_time(:millisecond) + grace

    case drain(state, deadline) do
      {:exited, state} ->
        state

      {:timeout, state} ->
        Logger.warning(
          "vllm-bridge server #{inspect(state.name)} (os pid #{os_pid}) ignored SIGTERM for #{grace} ms: killing it"
        )

        # A port's program leads its own process group: kill whatever of it is left there too.
        signal("KILL", -os_pid)
        {_, state} = drain(state, System.monotonic_time(:millisecond) + 5_000)
        if state.port, do: safe_close(port)
        %{state | port: nil}
    end
  end

  defp drain(%{port: port} = state, deadline) do
    receive do
      {^port, {:data, data}} ->
        drain(output(state, data), deadline)

      {^port, {:exit_status, status}} ->
        Logger.info("vllm-bridge server #{inspect(state.name)} stopped (exit status #{status})")
        {:exited, %{state | port: nil}}
    after
      max(deadline - System.monotonic_time(:millisecond), 0) -> {:timeout, state}
    end
  end

  defp signal(sig, os_pid) do
    case System.find_executable("kill") do
      nil -> :os.cmd(String.to_charlist("kill -#{sig} -- #{os_pid}"))
      kill -> System.cmd(kill, ["-#{sig}", "--", Integer.to_string(os_pid)], stderr_to_stdout: true)
    end
  end

  defp safe_close(port) do
    Port.close(port)
  rescue
    ArgumentError -> :ok
  end

  defp cleanup(state) do
    Enum.each(state.tmp, &File.rm/1)
    state
  end

  # ------------------------------------------------------------------------------------ log lines

  defp output(state, {:noeol, part}), do: %{state | partial: state.partial <> part}

  defp output(state, {:eol, part}) do
    line = state.partial <> part
    level = line_level(line) || state.last_level
    if state.level != false, do: Logger.log(level, line, vllm_bridge_server: state.name, os_pid: state.os_pid)
    lines = :queue.in(line, state.lines)

    {lines, count} =
      if state.count >= @keep_lines, do: {:queue.drop(lines), state.count}, else: {lines, state.count + 1}

    %{state | partial: "", lines: lines, count: count, last_level: level}
  end

  # The level a line names in its first words (`2026-01-01 12:00:00,001 INFO ...` as the server
  # logs, `INFO 01-01 12:00:00 [file.py:12] ...` as vLLM does, `W1123 20:35:12.391000 ...` as
  # torch's glog does), or nil.
  @glog %{?I => :info, ?W => :warning, ?E => :error, ?F => :error}
  @doc false
  @spec line_level(String.t()) :: Logger.level() | nil
  def line_level(<<c, d1, d2, d3, d4, " ", _::binary>>)
      when is_map_key(@glog, c) and d1 in ?0..?9 and d2 in ?0..?9 and d3 in ?0..?9 and d4 in ?0..?9,
      do: Map.fetch!(@glog, c)

  def line_level(line) do
    line |> String.split(" ", parts: 5) |> Enum.take(4) |> Enum.find_value(&Map.get(@levels, &1))
  end

  defp last_lines(state), do: :queue.to_list(state.lines)
end
