defmodule VllmBridge.Mux do
  @moduledoc """
  Streaming calls share one `Bridge/Multiplex` stream per server address.

  Why: a gRPC call per generation costs the server a call set-up and a message per token; over one
  Multiplex stream a generation starts with one message, and the server sends whatever is ready at
  the same moment (one engine step's tokens for every running request) as one message. With many
  concurrent generations that is what lets the server keep up with the engine (`bench/README.md`).

  One process per address owns the shared stream: it writes the requests of every caller and hands
  each event to the process that started the call, as the raw bytes of its value. This process only
  reads call ids (`Wire` below decodes the events shallowly); the caller decodes its own values, so
  the work is spread over the callers. Each stream has a window of `@window` items; the caller gives
  credit back as it consumes, so a slow consumer holds up only its own call (the server's vLLM merges
  the outputs meanwhile) and no mailbox grows without bound.

  Failure modes: a caller that exits gets its calls cancelled; if the shared stream or the
  connection fails, every running call fails with that error and the next call opens a new stream;
  if this process dies, the callers' monitors tell them.
  """
  use GenServer

  alias VllmBridge.{Connection, Error}
  alias VllmBridge.V1, as: PB

  @path "/vllm_bridge.v1.Bridge/Multiplex"
  @window 32

  defmodule Wire do
    @moduledoc false
    # MuxReply / MuxEvent with the payloads left as bytes (the same wire format: a message field is
    # length-delimited), so the shared process never decodes a value.
    defmodule Event do
      @moduledoc false
      use Protobuf, syntax: :proto3
      oneof(:kind, 0)
      field(:id, 1, type: :uint64)
      field(:value, 2, type: :bytes, oneof: 0)
      field(:end, 3, type: :bytes, oneof: 0)
      field(:error, 4, type: :bytes, oneof: 0)
    end

    defmodule Reply do
      @moduledoc false
      use Protobuf, syntax: :proto3
      field(:events, 1, repeated: true, type: VllmBridge.Mux.Wire.Event)
    end
  end

  defstruct [:mux, :mon, :id, :idle, consumed: 0, done: false]

  @type handle :: %__MODULE__{}

  @doc false
  def start_link(address), do: GenServer.start_link(__MODULE__, address)

  @doc false
  def child_spec(address),
    do: %{id: {__MODULE__, address}, start: {__MODULE__, :start_link, [address]}, restart: :temporary}

  @doc """
  Starts a streaming call for the calling process: `{:ok, handle}` for `next/1` and `cancel/1`.
  `metadata` holds the call's `x-bridge-*` options; `idle` is how long `next/1` waits for an item.
  """
  @spec open(String.t(), PB.CallRequest.t(), map(), timeout()) :: {:ok, handle()} | {:error, Error.t()}
  def open(address, %PB.CallRequest{} = req, metadata, idle) do
    with {:ok, mux} <- whereis(address) do
      mon = Process.monitor(mux)

      case GenServer.call(mux, {:start, req, metadata, self()}, 30_000) do
        {:ok, id} ->
          {:ok, %__MODULE__{mux: mux, mon: mon, id: id, idle: idle}}

        {:error, _} = err ->
          Process.demonitor(mon, [:flush])
          err
      end
    end
  catch
    :exit, reason -> {:error, Error.local(:unavailable, "grpc_error", "multiplexer: #{inspect(reason)}")}
  end

  @doc "The next item's value: `{:ok, %VllmBridge.V1.Value{}, handle}`, `:done`, or `{:error, %VllmBridge.Error{}}`."
  @spec next(handle()) :: {:ok, PB.Value.t(), handle()} | :done | {:error, Error.t()}
  def next(%__MODULE__{done: true}), do: :done

  def next(%__MODULE__{mux: mux, mon: mon, id: id} = h) do
    receive do
      {__MODULE__, ^id, {:value, bin}} ->
        {:ok, PB.Value.decode(bin), credit(h)}

      {__MODULE__, ^id, {:end, _}} ->
        Process.demonitor(mon, [:flush])
        :done

      {__MODULE__, ^id, {:error, bin}} ->
        Process.demonitor(mon, [:flush])
        {:error, mux_error(bin)}

      {__MODULE__, ^id, {:failed, %Error{} = e}} ->
        Process.demonitor(mon, [:flush])
        {:error, e}

      {:DOWN, ^mon, :process, ^mux, reason} ->
        {:error, Error.local(:unavailable, "grpc_error", "multiplexer stopped: #{inspect(reason)}")}
    after
      h.idle ->
        cancel(h)
        {:error, Error.local(:deadline_exceeded, "timeout", "no item from the server in time")}
    end
  end

  @doc "Cancels a running call (the server aborts a vLLM request) and drops whatever it had sent."
  @spec cancel(handle()) :: :ok
  def cancel(%__MODULE__{mux: mux, mon: mon, id: id}) do
    GenServer.cast(mux, {:cancel, id})
    Process.demonitor(mon, [:flush])
    flush(id)
  end

  defp flush(id) do
    receive do
      {__MODULE__, ^id, _} -> flush(id)
    after
      0 -> :ok
    end
  end

  # Credit in batches of half the window: one message per 16 items, and the server never runs dry.
  defp credit(%__MODULE__{consumed: n} = h) when n + 1 >= div(@window, 2) do
    GenServer.cast(h.mux, {:credit, h.id, n + 1})
    %{h | consumed: 0}
  end

  defp credit(h), do: %{h | consumed: h.consumed + 1}

  defp mux_error(bin) do
    %PB.MuxError{code: code, message: message, detail: detail} = PB.MuxError.decode(bin)
    Error.from_detail(code, message, detail)
  end

  defp whereis(address) do
    case Registry.lookup(VllmBridge.MuxRegistry, address) do
      [{pid, _}] ->
        {:ok, pid}

      [] ->
        case DynamicSupervisor.start_child(VllmBridge.MuxSupervisor, {__MODULE__, address}) do
          {:ok, pid} -> {:ok, pid}
          {:error, {:already_started, pid}} -> {:ok, pid}
          {:error, reason} -> {:error, Error.local(:unavailable, "grpc_error", "multiplexer: #{inspect(reason)}")}
        end
    end
  end

  # ------------------------------------------------------------------------------- the shared process

  @impl true
  def init(address) do
    case Registry.register(VllmBridge.MuxRegistry, address, nil) do
      {:ok, _} ->
        {:ok, %{address: address, conn: nil, conn_mon: nil, ref: nil, buffer: <<>>, next_id: 1, calls: %{}, mons: %{}}}

      {:error, {:already_registered, pid}} ->
        {:stop, {:already_started, pid}}
    end
  end

  @impl true
  def handle_call({:start, req, metadata, pid}, _from, state) do
    case ensure_stream(state) do
      {:ok, state} ->
        id = state.next_id
        start = %PB.MuxStart{id: id, call: req, stream: true, metadata: metadata, window: @window}
        send_request(state, %PB.MuxRequest{kind: {:start, start}})
        mon = Process.monitor(pid)
        calls = Map.put(state.calls, id, {pid, mon})
        {:reply, {:ok, id}, %{state | next_id: id + 1, calls: calls, mons: Map.put(state.mons, mon, id)}}

      {:error, e} ->
        {:reply, {:error, e}, state}
    end
  end

  @impl true
  def handle_cast({:cancel, id}, state) do
    case Map.pop(state.calls, id) do
      {nil, _} ->
        {:noreply, state}

      {{_pid, mon}, calls} ->
        Process.demonitor(mon, [:flush])
        send_request(state, %PB.MuxRequest{kind: {:cancel, id}})
        {:noreply, %{state | calls: calls, mons: Map.delete(state.mons, mon)}}
    end
  end

  def handle_cast({:credit, id, n}, state) do
    if Map.has_key?(state.calls, id) and state.ref != nil do
      send_request(state, %PB.MuxRequest{kind: {:credit, %PB.MuxCredit{id: id, events: n}}})
    end

    {:noreply, state}
  end

  @impl true
  def handle_info({:gun_response, _conn, ref, :nofin, 200, _headers}, %{ref: ref} = state), do: {:noreply, state}

  def handle_info({:gun_response, _conn, ref, _fin, status, headers}, %{ref: ref} = state) do
    {:noreply, fail_all(state, response_error(status, headers))}
  end

  def handle_info({:gun_data, _conn, ref, fin, data}, %{ref: ref} = state) do
    state = dispatch(%{state | buffer: state.buffer <> data})

    if fin == :fin,
      do:
        {:noreply, fail_all(state, Error.local(:unavailable, "grpc_error", "the server ended the multiplexed stream"))},
      else: {:noreply, state}
  end

  def handle_info({:gun_trailers, _conn, ref, trailers}, %{ref: ref} = state) do
    {:noreply, fail_all(state, trailers_error(trailers))}
  end

  def handle_info({:gun_error, _conn, ref, reason}, %{ref: ref} = state) do
    {:noreply,
     fail_all(
       state,
       Error.local(:unavailable, "grpc_error", "the multiplexed stream to #{state.address} failed: #{inspect(reason)}")
     )}
  end

  def handle_info({:gun_error, conn, reason}, %{conn: conn} = state) do
    {:noreply, fail_all(state, Error.local(:unavailable, "grpc_error", "connection: #{inspect(reason)}"))}
  end

  def handle_info({:DOWN, mon, :process, _pid, _reason}, state) do
    case Map.pop(state.mons, mon) do
      {nil, _} ->
        if state.conn && mon == state.conn_mon,
          do: {:noreply, fail_all(state, Error.local(:unavailable, "grpc_error", "connection lost"))},
          else: {:noreply, state}

      {id, mons} ->
        # The caller is gone: nobody reads this call any more.
        if state.ref, do: send_request(state, %PB.MuxRequest{kind: {:cancel, id}})
        {:noreply, %{state | calls: Map.delete(state.calls, id), mons: mons}}
    end
  end

  def handle_info(_other, state), do: {:noreply, state}

  defp ensure_stream(%{ref: ref} = state) when ref != nil, do: {:ok, state}

  defp ensure_stream(state) do
    with {:ok, %{adapter_payload: %{conn_pid: conn}}} <- Connection.channel(state.address) do
      headers = [
        {"content-type", "application/grpc"},
        {"te", "trailers"},
        {"user-agent", "vllm-bridge-elixir"}
      ]

      ref = :gun.post(conn, @path, headers)
      {:ok, %{state | conn: conn, ref: ref, buffer: <<>>, conn_mon: Process.monitor(conn)}}
    end
  end

  defp send_request(%{conn: conn, ref: ref}, msg) do
    body = PB.MuxRequest.encode(msg)
    :gun.data(conn, ref, :nofin, <<0, byte_size(body)::32, body::binary>>)
  end

  defp dispatch(%{buffer: <<_flag, size::32, msg::binary-size(size), rest::binary>>} = state) do
    %Wire.Reply{events: events} = Wire.Reply.decode(msg)
    state = Enum.reduce(events, state, &deliver/2)
    dispatch(%{state | buffer: rest})
  end

  defp dispatch(state), do: state

  defp deliver(%Wire.Event{id: id, kind: kind}, state) do
    case Map.get(state.calls, id) do
      nil ->
        state

      {pid, mon} ->
        send(pid, {__MODULE__, id, kind})

        case kind do
          {:value, _} ->
            state

          _ ->
            Process.demonitor(mon, [:flush])
            %{state | calls: Map.delete(state.calls, id), mons: Map.delete(state.mons, mon)}
        end
    end
  end

  # The shared stream is over: every running call fails with `error`; the next call opens a new stream.
  defp fail_all(state, %Error{} = error) do
    for {id, {pid, mon}} <- state.calls do
      Process.demonitor(mon, [:flush])
      send(pid, {__MODULE__, id, {:failed, error}})
    end

    if state.ref && state.conn, do: :gun.cancel(state.conn, state.ref)
    if state.conn_mon, do: Process.demonitor(state.conn_mon, [:flush])
    %{state | ref: nil, conn: nil, buffer: <<>>, calls: %{}, mons: %{}, conn_mon: nil}
  end

  defp response_error(status, headers) do
    map = Map.new(headers)

    case map["grpc-status"] do
      nil -> Error.local(:internal, "grpc_error", "HTTP status #{status} on the multiplexed stream")
      _ -> trailers_error(headers)
    end
  end

  defp trailers_error(trailers) do
    map = Map.new(trailers)

    case map["grpc-status"] do
      code when code in [nil, "0"] ->
        Error.local(:unavailable, "grpc_error", "the server ended the multiplexed stream")

      code ->
        Error.from_status(String.to_integer(code), URI.decode(map["grpc-message"] || ""), nil)
    end
  end
end
