defmodule VllmBridge.Client do
  @moduledoc """
  One call on the wire: the target, encoded arguments, runtime options as metadata, and the
  decoded reply or a `VllmBridge.Error`. The generated `Vllm.*` modules and `VllmBridge` call this.

  Targets: `{:function, name}`, `{:module_attr, name}`, `{:constructor, name}`, and on a receiver
  (a `VllmBridge.Ref`, or the name of an object the server published, such as `"engine"`)
  `{:method, receiver, name}`, `{:get_attr, receiver, name}`, `{:set_attr, receiver, name}`,
  `{:iterate, receiver}`.
  """

  alias VllmBridge.{Codec, Connection, Error, Mux, Ref, Transport}
  alias VllmBridge.V1, as: PB
  alias VllmBridge.V1.Bridge.Stub

  # `__runtime__` option -> metadata key (bridge_server/wire/protocol.py). `timeout` is the gRPC deadline.
  @metadata %{
    session_id: "x-bridge-session",
    timeout_profile: "x-bridge-timeout-profile",
    stream_timeout: "x-bridge-stream-timeout-ms",
    pool_name: "x-bridge-pool",
    affinity: "x-bridge-affinity"
  }
  @runtime_keys [:timeout, :multiplex | Map.keys(@metadata)]

  @type target :: tuple()
  @type result :: {:ok, term()} | {:error, Error.t()}

  @doc "A unary call: `{:ok, value}` or `{:error, %VllmBridge.Error{}}`."
  @spec call(target(), list(), keyword()) :: result()
  def call(target, args, opts) do
    with {:ok, req, md, runtime} <- prepare(target, args, opts),
         {:ok, channel} <- Connection.channel(address()),
         {:ok, %PB.CallReply{value: value}} <- Stub.call(channel, req, grpc_opts(md, runtime)) do
      {:ok, Codec.decode(value)}
    end
  end

  @doc """
  A streaming call: `{:ok, stream}` where `stream` is a lazy `Stream` of decoded items.

  The call starts when the stream is first enumerated, in the enumerating process, and is
  cancelled on the server (the Python generator is closed, a vLLM request aborted) as soon as the
  consumer stops early (`Enum.take/2`, `Stream.take_while/2`, a `break` out of `for`, an exception).
  A failure while streaming raises `VllmBridge.Error`. Each enumeration runs the call again.
  Arguments are encoded right away, so unsendable values are reported as `{:error, _}`.

  Streams share the address's `Multiplex` stream (`VllmBridge.Mux`) unless `__runtime__` says
  `multiplex: false`.
  """
  @spec stream(target(), list(), keyword()) :: {:ok, Enumerable.t()} | {:error, Error.t()}
  def stream(target, args, opts) do
    with {:ok, req, md, runtime} <- prepare(target, args, opts) do
      idle = Transport.wait_ms(Enum.max([runtime[:timeout], runtime[:stream_timeout]], fn -> nil end))

      if Keyword.get(runtime, :multiplex, true) do
        {:ok, Stream.resource(fn -> open_shared(req, md, runtime, idle) end, &pull/1, &close/1)}
      else
        {:ok, Stream.resource(fn -> open(req, md, runtime, idle) end, &pull/1, &close/1)}
      end
    end
  end

  # Over the address's shared Multiplex stream (`VllmBridge.Mux`); the call's deadline travels as
  # an option of the call, since the shared stream has none.
  defp open_shared(req, md, runtime, idle) do
    md =
      case runtime[:timeout] do
        ms when is_integer(ms) and ms >= 0 -> Map.put(md, "x-bridge-timeout-ms", Integer.to_string(ms))
        _ -> md
      end

    case Mux.open(address(), req, md, idle) do
      {:ok, handle} -> handle
      {:error, %Error{} = e} -> raise e
    end
  end

  defp open(req, md, runtime, idle) do
    with {:ok, channel} <- Connection.channel(address()),
         {:ok, handle} <- Stub.stream(channel, req, grpc_opts(md, runtime)) do
      %{handle | wait: idle}
    else
      {:error, %Error{} = e} -> raise e
    end
  end

  defp pull(%Mux{} = h) do
    case Mux.next(h) do
      {:ok, value, h} -> {[Codec.decode(value)], h}
      :done -> {:halt, %{h | done: true}}
      {:error, e} -> raise e
    end
  end

  defp pull(%Transport{} = h) do
    case Transport.next(h) do
      {:ok, %PB.StreamItem{value: value}, h} -> {[Codec.decode(value)], h}
      :done -> {:halt, %{h | ref: nil}}
      {:error, e} -> raise e
    end
  end

  defp close(%Mux{done: true}), do: :ok
  defp close(%Mux{} = h), do: Mux.cancel(h)
  defp close(%Transport{ref: nil}), do: :ok
  defp close(h), do: Transport.cancel_handle(h)

  @doc "Runs one call on every rank of a distributed pool (a lone worker is one rank): the results in rank order."
  @spec collective(target(), list(), keyword()) :: {:ok, [term()]} | {:error, Error.t()}
  def collective(target, args, opts) do
    with {:ok, req, md, runtime} <- prepare(target, args, opts),
         {:ok, channel} <- Connection.channel(address()),
         {:ok, %PB.CollectiveReply{results: results}} <-
           Stub.collective(channel, %PB.CollectiveRequest{call: req}, grpc_opts(md, runtime)) do
      {:ok, Enum.map(results, &Codec.decode(&1.value))}
    end
  end

  @doc "Releases refs (by struct or id) and, with `session`, a whole session. Returns how many refs went."
  @spec release([Ref.t() | String.t()], String.t()) :: {:ok, non_neg_integer()} | {:error, Error.t()}
  def release(refs, session) do
    ids =
      Enum.map(refs, fn
        %Ref{id: id} -> id
        id when is_binary(id) -> id
      end)

    with {:ok, channel} <- Connection.channel(address()),
         {:ok, %PB.ReleaseReply{released: n}} <-
           Stub.release(channel, %PB.ReleaseRequest{ref_ids: ids, session_id: session}, timeout: 30_000) do
      {:ok, n}
    end
  end

  @doc "The server's catalog (`vllm_bridge.v1.Catalog`), optionally only names starting with `prefix`."
  @spec describe(String.t()) :: {:ok, PB.Catalog.t()} | {:error, Error.t()}
  def describe(prefix) do
    with {:ok, channel} <- Connection.channel(address()) do
      Stub.describe(channel, %PB.DescribeRequest{prefix: prefix}, timeout: 30_000)
    end
  end

  @doc "The server address: `config :vllm_bridge, address:`, else `$VLLM_BRIDGE_ADDRESS`, else 127.0.0.1:50051."
  @spec address() :: String.t()
  def address do
    Application.get_env(:vllm_bridge, :address) || System.get_env("VLLM_BRIDGE_ADDRESS") || "127.0.0.1:50051"
  end

  @doc "The session this process calls under by default (its own, released when it exits)."
  @spec session_id() :: String.t()
  def session_id do
    case Process.get(:vllm_bridge_session) do
      nil ->
        pid = self() |> :erlang.pid_to_list() |> to_string() |> String.trim("<") |> String.trim(">")
        id = "ex-#{:persistent_term.get({VllmBridge, :vm}, "vm")}-#{pid}"
        Process.put(:vllm_bridge_session, id)
        if Application.get_env(:vllm_bridge, :release_sessions_on_exit, true), do: VllmBridge.Sessions.watch(self(), id)
        id

      id ->
        id
    end
  end

  # Splits `opts` into Python kwargs and `__runtime__`, encodes everything, builds the metadata.
  defp prepare(target, args, opts) do
    {runtime, kwargs} = Keyword.pop(opts, :__runtime__, [])

    with :ok <- check_runtime(runtime) do
      {target_msg, receiver_refs} = target(target)
      {args, arg_refs} = args |> Enum.map(&Codec.encode/1) |> Enum.unzip()
      {kw, kw_refs} = kwargs |> Enum.map(fn {k, v} -> {to_string(k), Codec.encode(v)} end) |> split_kwargs()
      refs = Enum.uniq(receiver_refs ++ List.flatten(arg_refs) ++ kw_refs)
      req = %PB.CallRequest{target: target_msg, args: args, kwargs: kw}
      {:ok, req, metadata(runtime, refs), runtime}
    end
  rescue
    e in [ArgumentError, FunctionClauseError, Protocol.UndefinedError] ->
      {:error, Error.local(:invalid_argument, "validation", "cannot encode the call: #{Exception.message(e)}")}
  end

  defp split_kwargs(pairs) do
    {Map.new(pairs, fn {k, {v, _}} -> {k, v} end), Enum.flat_map(pairs, fn {_, {_, refs}} -> refs end)}
  end

  defp check_runtime(runtime) when is_list(runtime) do
    case Keyword.keys(runtime) -- @runtime_keys do
      [] ->
        :ok

      bad ->
        {:error,
         Error.local(
           :invalid_argument,
           "validation",
           "unknown __runtime__ options #{inspect(bad)}; known: #{inspect(@runtime_keys)}"
         )}
    end
  end

  defp check_runtime(other),
    do:
      {:error,
       Error.local(:invalid_argument, "validation", "__runtime__ must be a keyword list, got #{inspect(other)}")}

  defp metadata(runtime, refs) do
    md = %{"x-bridge-session" => to_string(runtime[:session_id] || session_id())}

    md =
      Enum.reduce(Map.delete(@metadata, :session_id), md, fn {opt, key}, md ->
        case runtime[opt] do
          nil -> md
          :infinity -> Map.put(md, key, "inf")
          value -> Map.put(md, key, to_string(value))
        end
      end)

    if refs == [], do: md, else: Map.put(md, "x-bridge-refs", Enum.join(refs, ","))
  end

  # No `timeout`: no deadline, so the server applies the call's timeout profile.
  defp grpc_opts(md, runtime) do
    timeout =
      case runtime[:timeout],
        do:
          (
            ms when is_integer(ms) and ms >= 0 -> ms
            _ -> :infinity
          )

    [metadata: md, timeout: timeout]
  end

  defp target({:function, name}), do: {%PB.Target{kind: :FUNCTION, name: name}, []}
  defp target({:module_attr, name}), do: {%PB.Target{kind: :MODULE_ATTR, name: name}, []}
  defp target({:constructor, name}), do: {%PB.Target{kind: :CONSTRUCTOR, name: name}, []}
  defp target({:method, receiver, name}), do: on(:METHOD, receiver, name)
  defp target({:get_attr, receiver, name}), do: on(:GET_ATTR, receiver, name)
  defp target({:set_attr, receiver, name}), do: on(:SET_ATTR, receiver, name)
  defp target({:iterate, receiver}), do: on(:ITERATE, receiver, "")

  defp on(kind, %Ref{} = r, name) do
    {%PB.Value{kind: {:ref, ref}}, _} = Codec.encode(r)
    {%PB.Target{kind: kind, name: name, receiver: {:ref, ref}}, [r.id]}
  end

  defp on(kind, object, name) when is_binary(object),
    do: {%PB.Target{kind: kind, name: name, receiver: {:object, object}}, []}

  defp on(_kind, other, name),
    do:
      raise(
        ArgumentError,
        "#{name}: the receiver must be a VllmBridge.Ref or a published object name, got #{inspect(other)}"
      )
end
