defmodule VllmBridge.Client do
  @moduledoc false
  # One call on the wire: the target, encoded arguments, runtime options as metadata, the decoded
  # reply or a `VllmBridge.Error`, and its telemetry events. The generated `Vllm.*` modules and
  # `VllmBridge` call this.
  #
  # Targets: `{:function, name}`, `{:module_attr, name}`, `{:constructor, name}`, and on a receiver
  # (a `VllmBridge.Ref`, or the name of an object the server published: `"engine"` or `:engine`)
  # `{:method, receiver, name}`, `{:get_attr, receiver, name}`, `{:set_attr, receiver, name}`,
  # `{:iterate, receiver}`.

  alias VllmBridge.{Codec, Config, Connection, Error, Mux, Ref, Runtime, Sessions, StreamState, Telemetry, Transport}
  alias VllmBridge.V1, as: PB
  alias VllmBridge.V1.Bridge.Service

  @type target :: tuple()
  @type result :: {:ok, term()} | {:error, Error.t()}

  # A prepared call: everything but the connection.
  defmodule Call do
    @moduledoc false
    defstruct [:rt, :server, :req, :md, :meta]
  end

  @doc "A unary call: `{:ok, value}` or `{:error, %VllmBridge.Error{}}`."
  @spec call(target(), list(), keyword()) :: result()
  def call(target, args, opts) do
    case prepare(target, args, opts) do
      {:ok, c} ->
        body = PB.CallRequest.encode(c.req)

        Telemetry.span(c.meta, fn ->
          with {:ok, %PB.CallReply{value: value}} <- unary(:Call, body, c), do: decoded(value, c)
        end)

      {:error, _} = err ->
        err
    end
  end

  @doc "Runs one call on every rank of a distributed pool (a lone worker is one rank): the results in rank order."
  @spec collective(target(), list(), keyword()) :: {:ok, [term()]} | {:error, Error.t()}
  def collective(target, args, opts) do
    case prepare(target, args, opts) do
      {:ok, c} ->
        c = %{c | meta: %{c.meta | operation: :collective}}

        Telemetry.span(c.meta, fn ->
          body = PB.CollectiveRequest.encode(%PB.CollectiveRequest{call: c.req})

          with {:ok, %PB.CollectiveReply{results: results}} <- unary(:Collective, body, c) do
            Enum.reduce_while(Enum.reverse(results), {:ok, []}, fn result, {:ok, acc} ->
              case decoded(result.value, c) do
                {:ok, term} -> {:cont, {:ok, [term | acc]}}
                {:error, _} = err -> {:halt, err}
              end
            end)
          end
        end)

      {:error, _} = err ->
        err
    end
  end

  @doc "Releases refs (by struct or id) and, with `session`, a whole session. Returns how many refs went."
  @spec release([Ref.t() | String.t()], String.t(), keyword()) :: {:ok, non_neg_integer()} | {:error, Error.t()}
  def release(refs, session, opts) do
    ids =
      Enum.map(refs, fn
        %Ref{id: id} -> id
        id when is_binary(id) -> id
        other -> raise ArgumentError, "release: expected refs or ref ids, got #{inspect(other)}"
      end)

    fallback = Enum.find_value(refs, fn r -> is_struct(r, Ref) && r.server end)
    req = %PB.ReleaseRequest{ref_ids: ids, session_id: session}
    rpc(:Release, "Release", :release, PB.ReleaseRequest.encode(req), opts, fallback, fn r -> r.released end)
  end

  @doc "The server's catalog (`vllm_bridge.v1.Catalog`), optionally only names starting with `prefix`."
  @spec describe(String.t(), keyword()) :: {:ok, PB.Catalog.t()} | {:error, Error.t()}
  def describe(prefix, opts) do
    body = PB.DescribeRequest.encode(%PB.DescribeRequest{prefix: prefix})
    rpc(:Describe, "Describe", :describe, body, opts, nil, & &1)
  end

  # Release and Describe: only `server` and `timeout` (default 30 s) mean anything.
  defp rpc(name, target, operation, body, opts, fallback, fun) do
    {runtime, rest} = Keyword.pop(opts, :__runtime__, [])
    if rest != [], do: raise(ArgumentError, "#{target}: unknown options #{inspect(Keyword.keys(rest))}")
    {rt, server} = Runtime.resolve!(runtime, fallback)
    rt = %{rt | timeout: rt.timeout || 30_000}

    with {:ok, s} <- server do
      c = %Call{rt: rt, server: s, md: %{}, meta: meta(target, operation, s, rt, nil)}

      Telemetry.span(c.meta, fn ->
        with {:ok, reply} <- unary(name, body, c), do: {:ok, fun.(reply)}
      end)
    end
  end

  @doc """
  A streaming call: `{:ok, stream}` where `stream` is a lazy `Stream` of decoded items.

  The call starts when the stream is first enumerated, in the enumerating process, and is
  cancelled on the server (the Python generator is closed, a vLLM request aborted) as soon as the
  consumer stops early (`Enum.take/2`, `Stream.take_while/2`, a `break` out of `for`, an exception).
  A failure while streaming raises `VllmBridge.Error`. Each enumeration runs the call again.
  Arguments are encoded right away, so unsendable values are reported as `{:error, _}`.

  Streams share the server's `Multiplex` stream (`VllmBridge.Mux`) unless `__runtime__` says
  `multiplex: false`. Their items travel as patches against the item before (`patch-v2`, or
  `patch-v1` from a server older than it; rebuilt by `VllmBridge.StreamState`) unless it says
  `stream_encoding: :full`; either way each item decodes to the same value.
  """
  @spec stream(target(), list(), keyword()) :: {:ok, Enumerable.t()} | {:error, Error.t()}
  def stream(target, args, opts) do
    with {:ok, c} <- prepare(target, args, opts) do
      c = %{c | md: Runtime.stream_metadata(c.rt, c.md), meta: Map.put(c.meta, :multiplex, c.rt.multiplex)}
      {:ok, Stream.resource(fn -> open(c) end, &pull/1, &close/1)}
    end
  end

  # The state of a stream being consumed.
  defmodule Running do
    @moduledoc false
    defstruct [:call, :handle, :start, :meta, first: nil, items: 0, done: false, state: %VllmBridge.StreamState{}]
  end

  defp open(%Call{rt: rt} = c) do
    {start, meta} = Telemetry.start(:stream, c.meta)
    # A backstop only (the server enforces both): the first item is bounded by the call's timeout,
    # each later one by the stream timeout, whose default on the server is 30 minutes.
    idle =
      if is_integer(rt.stream_timeout), do: Transport.wait_ms(max(rt.timeout || 0, rt.stream_timeout)), else: :infinity

    opened =
      with {:ok, server} <- Config.server(c.server.key) do
        if rt.multiplex do
          Mux.open(server, c.req, c.md, rt.timeout, idle)
        else
          with {:ok, conn} <- Connection.get(server) do
            %{path: path} = Service.__rpc__(:Stream)

            {:ok,
             Transport.open_stream(conn, path, PB.CallRequest.encode(c.req), PB.StreamItem, c.md, rt.timeout, idle)}
          end
        end
      end

    case opened do
      {:ok, handle} ->
        %Running{call: c, handle: handle, start: start, meta: meta}

      {:error, %Error{} = e} ->
        # Stream.resource runs no after-function when the start function raises.
        failed(%Running{call: c, start: start, meta: meta}, e, false)
    end
  end

  defp pull(%Running{handle: %Mux{} = h} = r) do
    case Mux.next(h) do
      {:ok, item, h} -> rebuild(%{r | handle: h}, item)
      :done -> {:halt, %{r | done: true}}
      {:error, e} -> failed(r, e)
    end
  end

  defp pull(%Running{handle: %Transport{} = h} = r) do
    case Transport.next(h) do
      {:ok, %PB.StreamItem{} = item, h} -> rebuild(%{r | handle: h}, item)
      :done -> {:halt, %{r | done: true}}
      {:error, e} -> failed(r, e)
    end
  end

  # The item's value (itself, or the item before with a patch applied), decoded as any value is.
  # A patch that does not fit fails the stream, which is cancelled on the server.
  defp rebuild(%Running{} = r, msg) do
    case StreamState.decoded_item(r.state, msg, &decode(&1, r.call)) do
      {:ok, term, state} ->
        {[term], item(%{r | state: state})}

      {:error, e} ->
        cancel(r.handle)
        failed(r, e)
    end
  end

  defp item(%Running{first: nil} = r), do: %{r | first: System.monotonic_time() - r.start, items: 1}
  defp item(r), do: %{r | items: r.items + 1}

  # The stream raises: its exception event now; `close/1` (which Stream.resource runs with the
  # state before this step) must not report it again.
  defp failed(%Running{} = r, %Error{} = e, closes? \\ true) do
    meta =
      Map.merge(r.meta, %{
        kind: :error,
        reason: e,
        stacktrace: [],
        status: :error,
        error: e,
        error_category: e.category,
        code: e.code
      })

    Telemetry.finish(:stream, :exception, r.start, measurements(r), meta)
    if closes?, do: Process.put({__MODULE__, r.meta.telemetry_span_context}, :reported)
    raise e
  end

  defp close(%Running{} = r) do
    case Process.delete({__MODULE__, r.meta.telemetry_span_context}) do
      :reported ->
        :ok

      nil ->
        unless r.done, do: cancel(r.handle)
        status = if r.done, do: :ok, else: :cancelled
        meta = Map.merge(r.meta, %{status: status, error: nil, error_category: nil, code: :ok})
        Telemetry.finish(:stream, :stop, r.start, measurements(r), meta)
    end
  end

  defp cancel(%Mux{} = h), do: Mux.cancel(h)
  defp cancel(%Transport{} = h), do: Transport.cancel(h)
  defp cancel(nil), do: :ok

  defp measurements(r), do: %{first_item: r.first, items: r.items}

  # ------------------------------------------------------------------------------------ plumbing

  # A connection that is closing refuses the request without sending it: once more on a new one.
  defp unary(rpc, body, %Call{rt: rt, md: md, server: server}) do
    %{path: path, reply: reply} = Service.__rpc__(rpc)

    with {:ok, {pid, _} = conn} <- Connection.get(server) do
      case Transport.unary(conn, path, body, reply, md, rt.timeout) do
        {:error, %Error{reason: "connection closing"}} ->
          Connection.forget(server, pid)
          with {:ok, conn} <- Connection.get(server), do: Transport.unary(conn, path, body, reply, md, rt.timeout)

        result ->
          result
      end
    end
  end

  defp decode(value, %Call{rt: %{tensors: :struct}, server: %{key: key}}), do: Codec.decode(value, server: key)
  defp decode(value, %Call{rt: rt, server: s}), do: Codec.decode(value, server: s.key, tensors: rt.tensors)

  defp decoded(value, %Call{rt: %{tensors: :struct}, server: %{key: key}}), do: Codec.decoded(value, server: key)
  defp decoded(value, %Call{rt: rt, server: s}), do: Codec.decoded(value, server: s.key, tensors: rt.tensors)

  @doc """
  The address calls go to when they name no server (see `VllmBridge.Config`).
  """
  @spec address() :: String.t()
  def address do
    {:ok, s} = Config.server(nil)
    s.address
  end

  @doc "The session this process calls under by default (its own, released when it exits)."
  @spec session_id() :: String.t()
  def session_id do
    case Process.get(:vllm_bridge_session) do
      nil ->
        pid = self() |> :erlang.pid_to_list() |> to_string() |> String.trim("<") |> String.trim(">")
        id = "ex-#{:persistent_term.get({VllmBridge, :vm}, "vm")}-#{pid}"
        Process.put(:vllm_bridge_session, id)
        id

      id ->
        id
    end
  end

  # The process's own session is used on `server` for the first time: release it there when the
  # process exits.
  defp watch_session(session, server) do
    if Application.get_env(:vllm_bridge, :release_sessions_on_exit, true) and
         Process.get({:vllm_bridge_watched, server}) == nil do
      Process.put({:vllm_bridge_watched, server}, true)
      Sessions.watch(self(), session, server)
    end
  end

  # Splits `opts` into Python kwargs and `__runtime__`, resolves the server, encodes everything,
  # builds the metadata. Malformed runtime options raise ArgumentError; unsendable values and a
  # server that is not serving are `{:error, _}`.
  defp prepare(target, args, opts) do
    {runtime, kwargs} = Keyword.pop(opts, :__runtime__, [])
    {rt, server} = Runtime.resolve!(runtime, receiver_server(target))

    with {:ok, s} <- server, {:ok, req, refs} <- encode(target, args, kwargs) do
      session =
        case rt.session_id do
          nil ->
            own = session_id()
            watch_session(own, s.key)
            own

          id ->
            id
        end

      md = Runtime.metadata(rt, session, refs)

      {:ok,
       %Call{rt: rt, server: s, req: req, md: md, meta: meta(target_name(target), operation(target), s, rt, session)}}
    end
  end

  defp encode(target, args, kwargs) do
    {target_msg, receiver_refs} = target(target)
    {args, arg_refs} = args |> Enum.map(&Codec.encode/1) |> Enum.unzip()
    {kw, kw_refs} = kwargs |> Enum.map(fn {k, v} -> {to_string(k), Codec.encode(v)} end) |> split_kwargs()
    refs = Enum.uniq(receiver_refs ++ List.flatten(arg_refs) ++ kw_refs)
    {:ok, %PB.CallRequest{target: target_msg, args: args, kwargs: kw}, refs}
  rescue
    e in [ArgumentError, FunctionClauseError, Protocol.UndefinedError] ->
      {:error, Error.local(:invalid_argument, "validation", "cannot encode the call: #{Exception.message(e)}")}
  end

  defp split_kwargs(pairs) do
    {Map.new(pairs, fn {k, {v, _}} -> {k, v} end), Enum.flat_map(pairs, fn {_, {_, refs}} -> refs end)}
  end

  defp meta(target, operation, %Config.Server{} = s, rt, session) do
    %{
      target: target,
      operation: operation,
      server: s.key,
      address: s.address,
      pool: rt.pool_name,
      session: session,
      affinity: rt.affinity
    }
  end

  defp receiver_server(target) when elem(target, 0) in [:method, :get_attr, :set_attr, :iterate] do
    case elem(target, 1) do
      %Ref{server: server} -> server
      _ -> nil
    end
  end

  defp receiver_server(_), do: nil

  defp operation(target), do: elem(target, 0)

  defp target_name({kind, name}) when kind in [:function, :module_attr, :constructor], do: name
  defp target_name({:iterate, receiver}), do: receiver_name(receiver)
  defp target_name({_kind, receiver, name}), do: "#{receiver_name(receiver)}.#{name}"

  defp receiver_name(%Ref{type_name: "", id: id}), do: id
  defp receiver_name(%Ref{type_name: type}), do: type
  defp receiver_name(name), do: to_string(name)

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

  defp on(kind, object, name) when is_binary(object) and object != "",
    do: {%PB.Target{kind: kind, name: name, receiver: {:object, object}}, []}

  defp on(kind, object, name) when is_atom(object) and object not in [nil, true, false] do
    case Atom.to_string(object) do
      "Elixir." <> _ -> bad_receiver(object, name)
      published -> on(kind, published, name)
    end
  end

  defp on(_kind, other, name), do: bad_receiver(other, name)

  defp bad_receiver(other, name) do
    raise ArgumentError,
          "#{name}: the receiver must be a VllmBridge.Ref or the name of a published object (\"engine\" or :engine), " <>
            "got #{inspect(other)}"
  end
end
