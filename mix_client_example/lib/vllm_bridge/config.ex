defmodule VllmBridge.Config do
  @moduledoc """
  Configuration: the servers calls go to, how to connect to them, and default runtime options.

      # config/runtime.exs
      config :vllm_bridge,
        # the :default server (else $VLLM_BRIDGE_ADDRESS, else 127.0.0.1:50051)
        address: "127.0.0.1:50051",
        # app-wide default runtime options, under every call's own `__runtime__`
        runtime: [timeout_profile: :ml_inference],
        # connection options: defaults for every server
        token_file: "/run/secrets/vllm-bridge-token",
        keepalive: 30_000,
        # more servers; a call picks one with `__runtime__: [server: :gpu]`
        servers: [
          gpu: [
            address: "gpu-host:50051",
            tls: [cacertfile: "/etc/vllm-bridge/ca.pem"],
            runtime: [pool_name: "llm"]
          ]
        ]

  ## Servers

  A call goes to the server its `__runtime__: [server: ...]` names, else to the server of the ref
  it is called on (a ref remembers the server that made it), else to `config :vllm_bridge,
  default_server:` (`:default`). A server is:

    * the name of a running `VllmBridge.Server` child: the address it serves, with its token and
      TLS settings;
    * a name under `servers:` (a keyword list of options, below);
    * `:default`, when neither names it: `address:`, else `$VLLM_BRIDGE_ADDRESS`, else
      `127.0.0.1:50051`;
    * or an address itself: `server: "10.0.0.7:50051"`, `server: "unix:/run/vllm-bridge.sock"`.

  ## Connection options

  Per server under `servers:`, or at the top level as defaults for every server:

    * `:address` - `"host:port"`, `"[::1]:port"` or `"unix:/path"` (per server only).
    * `:token` - a bearer token, sent as `authorization: Bearer <token>` with every call; or
      `:token_file` - a file holding it (read when connecting). Without either, `$VLLM_BRIDGE_TOKEN`
      if set. Servers started with `--token-file` refuse calls without it.
    * `:tls` - `false` (default: plaintext HTTP/2), `true` (TLS, the server's certificate checked
      against the system's CA store), or a keyword list: `:cacertfile` (the CA that signed the
      server's certificate), `:certfile` and `:keyfile` (a client certificate, for servers started
      with `--tls-client-ca`), `:server_name_indication` (the name to check the certificate
      against, when it differs from the address's host), plus any other `:ssl` client option.
    * `:keepalive` - ms between HTTP/2 pings on the connection, or `:infinity` for none (default
      30,000). The servers accept a ping every 10,000 ms at most
      (`MIN_PING_INTERVAL_S` in `bridge_server/wire/protocol.py`) and close connections that
      ping more often, so smaller values are refused.
    * `:connect_timeout` - ms to wait for a connection (default 10,000).
    * `:runtime` - default runtime options for calls to this server (per server only), between
      the app-wide `runtime:` and the call's own.

  ## Runtime options

  The `__runtime__` keyword list of a call (see `VllmBridge`) is merged over the server's
  `runtime:`, which is merged over the app-wide `config :vllm_bridge, runtime:`. Every source is
  validated: a malformed option raises `ArgumentError` naming it.

  ## Other keys

    * `:default_server` - the server of calls that name none (default `:default`).
    * `:release_sessions_on_exit` - release each process's own session when it exits (default
      `true`, see `VllmBridge.session_id/0`).
  """

  alias VllmBridge.Error

  @default_address "127.0.0.1:50051"
  @min_keepalive 10_000
  @conn_keys [:tls, :token, :token_file, :keepalive, :connect_timeout]
  @server_keys [:address, :runtime | @conn_keys]

  @servers :vllm_bridge_servers

  defmodule Server do
    @moduledoc false
    # A resolved server: where to connect and how. Two equal structs share one connection.
    @enforce_keys [:key, :address, :endpoint]
    defstruct [
      :key,
      :address,
      :endpoint,
      tls: false,
      token: nil,
      keepalive: 30_000,
      connect_timeout: 10_000,
      runtime: []
    ]

    @type t :: %__MODULE__{
            key: atom() | String.t(),
            address: String.t(),
            endpoint: {:tcp, charlist(), :inet.port_number()} | {:unix, String.t()},
            tls: false | true | keyword(),
            token: nil | {:token, String.t()} | {:file, String.t()},
            keepalive: pos_integer() | :infinity,
            connect_timeout: pos_integer(),
            runtime: keyword()
          }
  end

  @typedoc "A server: a configured or registered name, or an address."
  @type server :: atom() | String.t()

  @doc "The smallest `:keepalive` the servers accept, in ms (`MIN_PING_INTERVAL_S` of the protocol)."
  @spec min_keepalive() :: pos_integer()
  def min_keepalive, do: @min_keepalive

  @doc "The server calls go to when they name none (`config :vllm_bridge, default_server:`)."
  @spec default_server() :: atom()
  def default_server, do: Application.get_env(:vllm_bridge, :default_server, :default)

  @doc false
  # A server name or address resolved into where and how to connect: {:ok, server}, or
  # {:error, %VllmBridge.Error{}} when it names a VllmBridge.Server that is not serving. Raises
  # ArgumentError for an unknown name or malformed options. (VllmBridge.address/1 is the public view.)
  @spec server(server() | nil) :: {:ok, Server.t()} | {:error, Error.t()}
  def server(nil), do: server(default_server())

  def server(address) when is_binary(address),
    do: {:ok, build(address, [address: address], "server #{inspect(address)}")}

  def server(name) when is_atom(name) do
    case registered(name) do
      {:up, opts} ->
        {:ok, build(name, opts, "VllmBridge.Server #{inspect(name)}")}

      {status, _} ->
        {:error,
         Error.local(
           :unavailable,
           "grpc_error",
           "server #{inspect(name)} is not serving: its VllmBridge.Server is #{status}"
         )}

      nil ->
        {:ok, build(name, configured(name), "config :vllm_bridge, servers: [#{name}: ...]")}
    end
  end

  def server(other), do: raise(ArgumentError, "a server is a name (atom) or an address (string), got #{inspect(other)}")

  @doc "App-wide default runtime options (`config :vllm_bridge, runtime:`)."
  @spec runtime_defaults() :: keyword()
  def runtime_defaults, do: Application.get_env(:vllm_bridge, :runtime, [])

  defp configured(name) do
    servers = Application.get_env(:vllm_bridge, :servers, [])

    unless Keyword.keyword?(servers),
      do: raise(ArgumentError, "config :vllm_bridge, servers: expected a keyword list, got #{inspect(servers)}")

    case Keyword.fetch(servers, name) do
      {:ok, opts} ->
        opts

      :error when name == :default ->
        [
          address:
            Application.get_env(:vllm_bridge, :address) || System.get_env("VLLM_BRIDGE_ADDRESS") || @default_address
        ]

      :error ->
        known = Enum.uniq([:default | Keyword.keys(servers)] ++ registered_names())

        raise ArgumentError,
              "unknown server #{inspect(name)}: configure it (config :vllm_bridge, servers: [#{name}: [address: ...]]) " <>
                "or start a VllmBridge.Server named so; known: #{inspect(known)}"
    end
  end

  @doc false
  # A server from its options (as under `servers:`), merged over the top-level connection options.
  @spec build(atom() | String.t(), keyword(), String.t()) :: Server.t()
  def build(key, opts, where) do
    unless Keyword.keyword?(opts), do: raise(ArgumentError, "#{where}: expected a keyword list, got #{inspect(opts)}")

    case Keyword.keys(opts) -- @server_keys do
      [] -> :ok
      bad -> raise ArgumentError, "#{where}: unknown options #{inspect(bad)}; known: #{inspect(@server_keys)}"
    end

    top = for k <- @conn_keys, (v = Application.get_env(:vllm_bridge, k)) != nil, do: {k, v}
    # a server's own token source replaces the top-level one
    top =
      if Keyword.has_key?(opts, :token) or Keyword.has_key?(opts, :token_file),
        do: Keyword.drop(top, [:token, :token_file]),
        else: top

    opts = Keyword.merge(top, opts)
    address = Keyword.get(opts, :address) || raise(ArgumentError, "#{where}: no :address")

    %Server{
      key: key,
      address: address,
      endpoint: endpoint!(address, where),
      tls: tls!(Keyword.get(opts, :tls, false), where),
      token: token!(opts, where),
      keepalive: keepalive!(Keyword.get(opts, :keepalive, 30_000), where),
      connect_timeout: positive!(Keyword.get(opts, :connect_timeout, 10_000), :connect_timeout, where),
      runtime: Keyword.get(opts, :runtime, [])
    }
  end

  @doc false
  # "host:port", "[v6]:port", "unix:/path" (also "unix:///path", "dns:///host:port", "ipv4:host:port").
  @spec endpoint!(String.t(), String.t()) :: {:tcp, charlist(), :inet.port_number()} | {:unix, String.t()}
  def endpoint!(address, where \\ "address")

  def endpoint!("unix://" <> path, where), do: endpoint!("unix:" <> path, where)
  def endpoint!("unix:" <> path, _where) when path != "", do: {:unix, path}
  def endpoint!("dns:///" <> rest, where), do: endpoint!(rest, where)
  def endpoint!("ipv4:" <> rest, where), do: endpoint!(rest, where)
  def endpoint!("ipv6:" <> rest, where), do: endpoint!(rest, where)

  def endpoint!(address, where) when is_binary(address) do
    # parsed by hand, not with a regex: this runs on every call
    {host, port} =
      case address do
        "[" <> rest ->
          case :binary.split(rest, "]:") do
            [host, port] when host != "" -> {host, port}
            _ -> bad_address!(address, where)
          end

        _ ->
          case :binary.split(address, ":", [:global]) do
            [host, port] when host != "" -> {host, port}
            _ -> bad_address!(address, where)
          end
      end

    case Integer.parse(port) do
      {n, ""} when n in 1..65_535 -> {:tcp, String.to_charlist(host), n}
      {_, ""} -> raise ArgumentError, "#{where}: address #{inspect(address)}: bad port"
      _ -> bad_address!(address, where)
    end
  end

  def endpoint!(other, where), do: raise(ArgumentError, "#{where}: address: expected a string, got #{inspect(other)}")

  defp bad_address!(address, where),
    do: raise(ArgumentError, "#{where}: address #{inspect(address)} is not host:port, [ipv6]:port or unix:/path")

  defp tls!(tls, _where) when is_boolean(tls), do: tls

  defp tls!(tls, where) when is_list(tls) do
    unless Keyword.keyword?(tls),
      do: raise(ArgumentError, "#{where}: tls: expected a keyword list, got #{inspect(tls)}")

    for k <- [:cacertfile, :certfile, :keyfile], path = tls[k], path != nil do
      unless is_binary(path) or is_list(path),
        do: raise(ArgumentError, "#{where}: tls: #{k}: expected a path, got #{inspect(path)}")
    end

    if tls[:certfile] == nil != (tls[:keyfile] == nil),
      do: raise(ArgumentError, "#{where}: tls: a client certificate needs both :certfile and :keyfile")

    tls
  end

  defp tls!(tls, where),
    do: raise(ArgumentError, "#{where}: tls: expected true, false or a keyword list, got #{inspect(tls)}")

  defp token!(opts, where) do
    case {Keyword.get(opts, :token), Keyword.get(opts, :token_file)} do
      {nil, nil} ->
        case System.get_env("VLLM_BRIDGE_TOKEN") do
          nil -> nil
          "" -> nil
          token -> {:token, token}
        end

      {token, nil} when is_binary(token) and token != "" ->
        {:token, token}

      {nil, file} when is_binary(file) and file != "" ->
        {:file, file}

      {token, nil} ->
        raise ArgumentError, "#{where}: token: expected a non-empty string, got #{inspect(token)}"

      {nil, file} ->
        raise ArgumentError, "#{where}: token_file: expected a path, got #{inspect(file)}"

      _ ->
        raise ArgumentError, "#{where}: give :token or :token_file, not both"
    end
  end

  defp keepalive!(:infinity, _where), do: :infinity
  defp keepalive!(ms, _where) when is_integer(ms) and ms >= @min_keepalive, do: ms

  defp keepalive!(other, where) do
    raise ArgumentError,
          "#{where}: keepalive: expected ms >= #{@min_keepalive} (the servers close connections that ping more " <>
            "often) or :infinity, got #{inspect(other)}"
  end

  defp positive!(ms, _key, _where) when is_integer(ms) and ms > 0, do: ms

  defp positive!(other, key, where),
    do: raise(ArgumentError, "#{where}: #{key}: expected a positive integer (ms), got #{inspect(other)}")

  # ------------------------------------------------------------------ servers run by VllmBridge.Server

  @doc false
  # Called by VllmBridge.Server: `status` is :up (serving, `opts` say how to reach it), or
  # :starting / :stopped / :failed (to start; calls fail at once instead of going elsewhere).
  @spec register(atom(), :up | :starting | :stopped | :failed, keyword()) :: :ok
  def register(name, status, opts \\ []) do
    :ets.insert(@servers, {name, status, opts})
    :ok
  end

  @doc false
  @spec unregister(atom()) :: :ok
  def unregister(name) do
    :ets.delete(@servers, name)
    :ok
  end

  defp registered(name) do
    case :ets.lookup(@servers, name) do
      [{^name, status, opts}] -> {status, opts}
      [] -> nil
    end
  rescue
    ArgumentError -> nil
  end

  defp registered_names do
    :ets.select(@servers, [{{:"$1", :_, :_}, [], [:"$1"]}])
  rescue
    ArgumentError -> []
  end

  # This module's process owns the client's ETS tables, so they outlive the processes that write them.
  use GenServer

  @doc false
  def start_link(_), do: GenServer.start_link(__MODULE__, nil, name: __MODULE__)

  @impl true
  def init(nil) do
    :ets.new(@servers, [:named_table, :public, :set, read_concurrency: true])
    :ets.new(:vllm_bridge_connections, [:named_table, :public, :set, read_concurrency: true])
    {:ok, nil}
  end
end
