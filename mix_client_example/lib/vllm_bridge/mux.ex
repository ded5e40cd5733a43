defmodule VllmBridge.Mux do
  @moduledoc false
  # Streaming calls share one `Bridge/Multiplex` stream per server.
  #
  # Why: a gRPC call per generation costs the server a call set-up and a message per token; over one
  # Multiplex stream a generation starts with one message, and the server sends whatever is ready at
  # the same moment (one engine step's tokens for every running request) as one message. With many
  # concurrent generations that is what lets the server keep up with the engine (bench/README.md).
  #
  # One process per server owns the shared stream: it writes the requests of every caller and hands
  # each event to the process that started the call, as the raw bytes of its value or patch (a
  # stream's items travel as patches against the item before unless the call asked for `full`; see
  # `VllmBridge.StreamState`). This process only reads call ids (`Wire` below decodes the events
  # shallowly); the caller decodes its own values and applies its own patches, so the work is spread
  # over the callers. Each stream has a window of @window items; the caller gives credit back as it
  # consumes, so a slow consumer holds up only its own call (the server's vLLM merges the outputs
  # meanwhile) and no mailbox grows without bound.
  #
  # Requests leave in batches: what this process queues while handling the messages already in its
  # mailbox (a burst of starts from callers that began together, their credits, cancels) goes out as
  # one `MuxBatch` message, once the mailbox holds nothing more that came before the flush. That is
  # one write here and one read on the server instead of one per call, which is what a burst of
  # starts otherwise waits on; a lone request goes out as it is, with no added wait (the flush is the
  # next message this process handles). A batch holds at most @batch_requests requests and
  # @batch_bytes of them (a larger request goes alone); order is kept.
  #
  # Failure modes: a caller that exits gets its calls cancelled; if the shared stream or the
  # connection fails, every running call fails with that error and the next call opens a new stream;
  # if this process dies, the callers' monitors tell them. Call ids start at 1: the server reports a
  # request it could not read (one that names no call) as an error event for id 0; that, and events
  # for ids never started, are logged at debug level and dropped; what comes for a call this side
  # cancelled is dropped silently.
  use GenServer

  require Logger

  alias VllmBridge.{Config, Connection, Error}
  alias VllmBridge.V1, as: PB

  @path "/vllm_bridge.v1.Bridge/Multiplex"
  @window 32
  # Small beside any server's max_request_bytes (64 MiB unless an operator sets it lower, and a message
  # over it fails the whole stream): 64 KiB of requests (a hundred-odd starts) already makes one write
  # of a burst.
  @batch_requests 256
  @batch_bytes 65_536

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
      field(:patch, 5, type: :bytes, oneof: 0)
    end

    defmodule Reply do
      @moduledoc false
      use Protobuf, syntax: :proto3
      field(:events, 1, repeated: true, type: VllmBridge.Mux.Wire.Event)
    end

    # MuxRequest{batch: MuxBatch} with the requests already encoded (each was encoded once, when it
    # was queued, to know its size), so a batch is put together without encoding them again.
    defmodule Batch do
      @moduledoc false
      use Protobuf, syntax: :proto3
      field(:requests, 1, repeated: true, type: :bytes)
    end

    defmodule Request do
      @moduledoc false
      use Protobuf, syntax: :proto3
      oneof(:kind, 0)
      field(:batch, 4, type: VllmBridge.Mux.Wire.Batch, oneof: 0)
    end
  end

  defstruct [:mux, :mon, :id, :idle, consumed: 0, done: false]

  @type handle :: %__MODULE__{}

  @doc false
  def start_link(key), do: GenServer.start_link(__MODULE__, key, name: {:via, Registry, {VllmBridge.MuxRegistry, key}})

  @doc false
  def child_spec(key), do: %{id: {__MODULE__, key}, start: {__MODULE__, :start_link, [key]}, restart: :temporary}

  @doc """
  Starts a streaming call for the calling process: `{:ok, handle}` for `next/1` and `cancel/1`.
  `metadata` holds the call's `x-bridge-*` options; `timeout` (ms or nil) its deadline; `idle` is
  how long `next/1` waits for an item.
  """
  @spec open(Config.Server.t(), PB.CallRequest.t(), map(), pos_integer() | nil, timeout()) ::
          {:ok, handle()} | {:error, Error.t()}
  def open(%Config.Server{} = server, %PB.CallRequest{} = req, metadata, timeout, idle) do
    mux = whereis(server.key)
    mon = Process.monitor(mux)

    case GenServer.call(mux, {:start, server, req, metadata, timeout, self()}, server.connect_timeout + 30_000) do
      {:ok, id} ->
        {:ok, %__MODULE__{mux: mux, mon: mon, id: id, idle: idle}}

      {:error, _} = err ->
        Process.demonitor(mon, [:flush])
        err
    end
  catch
    :exit, reason -> {:error, Error.local(:unavailable, "grpc_error", "multiplexer: #{inspect(reason)}")}
  end

  @doc """
  The next item, as it arrived: `{:ok, {:value, %VllmBridge.V1.Value{}} | {:patch, %VllmBridge.V1.StreamPatch{}}, handle}`
  (for `VllmBridge.StreamState.item/2`), `:done`, or `{:error, %VllmBridge.Error{}}`.
  """
  @spec next(handle()) ::
          {:ok, {:value, PB.Value.t()} | {:patch, PB.StreamPatch.t()}, handle()} | :done | {:error, Error.t()}
  def next(%__MODULE__{done: true}), do: :done

  def next(%__MODULE__{mux: mux, mon: mon, id: id} = h) do
    receive do
      {__MODULE__, ^id, {:value, bin}} ->
        with {:ok, value} <- decode(h, PB.Value, bin), do: {:ok, {:value, value}, credit(h)}

      {__MODULE__, ^id, {:patch, bin}} ->
        with {:ok, patch} <- decode(h, PB.StreamPatch, bin), do: {:ok, {:patch, patch}, credit(h)}

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

  # An item that cannot be read fails its stream, which is then cancelled on the server.
  defp decode(h, mod, bin) do
    {:ok, mod.decode(bin)}
  rescue
    e ->
      cancel(h)
      {:error, Error.local(:internal, "grpc_error", "an unreadable #{inspect(mod)}: #{Exception.message(e)}")}
  end

  defp mux_error(bin) do
    %PB.MuxError{code: code, message: message, detail: detail} = PB.MuxError.decode(bin)
    Error.from_detail(code, message, detail)
  end

  defp whereis(key) do
    case Registry.lookup(VllmBridge.MuxRegistry, key) do
      [{pid, _}] ->
        pid

      [] ->
        case DynamicSupervisor.start_child(VllmBridge.MuxSupervisor, {__MODULE__, key}) do
          {:ok, pid} -> pid
          {:error, {:already_started, pid}} -> pid
        end
    end
  end

  # ------------------------------------------------------------------------------- the shared process

  @impl true
  def init(key) do
    {:ok,
     %{
       key: key,
       server: nil,
       conn: nil,
       conn_mon: nil,
       ref: nil,
       buffer: <<>>,
       next_id: 1,
       calls: %{},
       mons: %{},
       unanswered: %{},
       # encoded requests waiting for the flush, newest first; flushing: a :flush is on its way
       outgoing: [],
       flushing: false
     }}
  end

  @impl true
  def handle_call({:start, server, req, metadata, timeout, pid}, _from, state) do
    case ensure_stream(%{state | server: server}, server) do
      {:ok, state} ->
        id = state.next_id

        start = %PB.MuxStart{
          id: id,
          call: req,
          stream: true,
          metadata: metadata,
          window: @window,
          time_left_ms: if(timeout, do: timeout * 1.0, else: 0.0)
        }

        state = queue_request(state, %PB.MuxRequest{kind: {:start, start}})
        mon = Process.monitor(pid)
        calls = Map.put(state.calls, id, {pid, mon})
        # kept until the call's first event, to start it again if the connection refused it
        unanswered = Map.put(state.unanswered, id, start)

        {:reply, {:ok, id},
         %{state | next_id: id + 1, calls: calls, mons: Map.put(state.mons, mon, id), unanswered: unanswered}}

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
        state = queue_request(state, %PB.MuxRequest{kind: {:cancel, id}})

        {:noreply,
         %{state | calls: calls, mons: Map.delete(state.mons, mon), unanswered: Map.delete(state.unanswered, id)}}
    end
  end

  def handle_cast({:credit, id, n}, state) do
    if Map.has_key?(state.calls, id) and state.ref != nil,
      do: {:noreply, queue_request(state, %PB.MuxRequest{kind: {:credit, %PB.MuxCredit{id: id, events: n}}})},
      else: {:noreply, state}
  end

  @impl true
  def handle_info(:flush, state), do: {:noreply, flush_requests(%{state | flushing: false})}

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

  # The connection was closing (GOAWAY) when the stream was opened: gun refused it, so the server
  # saw none of its calls. Once, on a new connection, they start again (what was still queued for
  # the refused stream is dropped: its starts are among these, its cancels were for calls the server
  # never saw).
  def handle_info({:gun_error, conn, ref, :closing}, %{ref: ref} = state)
      when map_size(state.unanswered) == map_size(state.calls) do
    Connection.forget(state.server, conn)
    Process.demonitor(state.conn_mon, [:flush])
    state = %{state | ref: nil, conn: nil, conn_mon: nil, buffer: <<>>, outgoing: []}

    with {:ok, %{conn: new} = state} when new != conn <- ensure_stream(state, state.server) do
      state =
        state.unanswered
        |> Enum.sort()
        |> Enum.reduce(state, fn {_id, start}, state -> queue_request(state, %PB.MuxRequest{kind: {:start, start}}) end)

      {:noreply, state}
    else
      {:ok, state} -> {:noreply, fail_all(state, VllmBridge.Transport.closing())}
      {:error, e} -> {:noreply, fail_all(state, e)}
    end
  end

  def handle_info({:gun_error, _conn, ref, reason}, %{ref: ref} = state) do
    {:noreply,
     fail_all(
       state,
       Error.local(:unavailable, "grpc_error", "the multiplexed stream failed: #{inspect(reason)}")
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
        state = if state.ref, do: queue_request(state, %PB.MuxRequest{kind: {:cancel, id}}), else: state

        {:noreply,
         %{state | calls: Map.delete(state.calls, id), mons: mons, unanswered: Map.delete(state.unanswered, id)}}
    end
  end

  def handle_info(_other, state), do: {:noreply, state}

  defp ensure_stream(%{ref: ref} = state, _server) when ref != nil, do: {:ok, state}

  defp ensure_stream(state, server) do
    with {:ok, {conn, headers}} <- Connection.get(server) do
      ref = :gun.post(conn, @path, headers)
      {:ok, %{state | conn: conn, ref: ref, buffer: <<>>, conn_mon: Process.monitor(conn)}}
    end
  end

  # A request for the current stream waits for the flush. The first one queued asks for it: the
  # :flush lands behind every message already in the mailbox, so whatever those add (the other
  # starts of a burst) leaves with it, and a lone request leaves as soon as this message is handled.
  defp queue_request(state, %PB.MuxRequest{} = request) do
    state = %{state | outgoing: [IO.iodata_to_binary(PB.MuxRequest.encode(request)) | state.outgoing]}

    if state.flushing do
      state
    else
      send(self(), :flush)
      %{state | flushing: true}
    end
  end

  # Writes what is queued, in order, as one piece of data (several messages when it is more than a
  # batch holds). Nothing is queued without a stream: a stream that ends drops its queue.
  defp flush_requests(%{outgoing: []} = state), do: state

  defp flush_requests(%{conn: conn, ref: ref, outgoing: outgoing} = state) when ref != nil do
    frames = for body <- batches(Enum.reverse(outgoing)), do: [<<0, IO.iodata_length(body)::32>>, body]
    :gun.data(conn, ref, :nofin, frames)
    %{state | outgoing: []}
  end

  defp flush_requests(state), do: %{state | outgoing: []}

  @doc false
  # The messages that carry `requests` (encoded MuxRequests, in order): consecutive requests gathered
  # into MuxBatch messages of at most @batch_requests requests and @batch_bytes of requests, a
  # request alone as it is (public for the tests).
  @spec batches([binary()]) :: [binary()]
  def batches(requests), do: requests |> group([], 0, 0, []) |> Enum.map(&batch_message/1)

  # group(requests, current batch (reversed), its count, its bytes, batches so far (reversed))
  defp group([], [], _n, _bytes, acc), do: Enum.reverse(acc)
  defp group([], batch, _n, _bytes, acc), do: Enum.reverse([Enum.reverse(batch) | acc])

  defp group([req | rest], batch, n, bytes, acc)
       when batch != [] and (n >= @batch_requests or bytes + byte_size(req) > @batch_bytes),
       do: group(rest, [req], 1, byte_size(req), [Enum.reverse(batch) | acc])

  defp group([req | rest], batch, n, bytes, acc), do: group(rest, [req | batch], n + 1, bytes + byte_size(req), acc)

  defp batch_message([request]), do: request

  defp batch_message(requests),
    do: IO.iodata_to_binary(Wire.Request.encode(%Wire.Request{kind: {:batch, %Wire.Batch{requests: requests}}}))

  @doc false
  # Splits the buffer into whole messages and hands their events out (public for the tests).
  def dispatch(%{buffer: <<_flag, size::32, msg::binary-size(size), rest::binary>>} = state) do
    %Wire.Reply{events: events} = Wire.Reply.decode(msg)
    state = Enum.reduce(events, state, &deliver/2)
    dispatch(%{state | buffer: rest})
  end

  def dispatch(state), do: state

  defp deliver(%Wire.Event{id: id, kind: kind}, state) do
    case Map.get(state.calls, id) do
      nil when id > 0 and id < state.next_id ->
        # a call this side cancelled (its caller stopped or exited): what the server still sent
        state

      nil ->
        Logger.debug(fn ->
          "vllm_bridge multiplexer #{inspect(state.key)}: dropped an event for #{unknown(id, kind)}"
        end)

        state

      {pid, mon} ->
        send(pid, {__MODULE__, id, kind})

        state =
          if Map.has_key?(state.unanswered, id),
            do: %{state | unanswered: Map.delete(state.unanswered, id)},
            else: state

        case kind do
          {item, _} when item in [:value, :patch] ->
            state

          _ ->
            Process.demonitor(mon, [:flush])
            %{state | calls: Map.delete(state.calls, id), mons: Map.delete(state.mons, mon)}
        end
    end
  end

  defp unknown(0, {:error, bin}) do
    "no call (id 0): #{Exception.message(mux_error(bin))}"
  rescue
    _ -> "no call (id 0): an unreadable error"
  end

  defp unknown(id, {tag, _}), do: "call #{id}, which was never started (#{tag})"
  defp unknown(id, nil), do: "call #{id}, which was never started (empty)"

  # The shared stream is over: every running call fails with `error`; the next call opens a new stream.
  defp fail_all(state, %Error{} = error) do
    for {id, {pid, mon}} <- state.calls do
      Process.demonitor(mon, [:flush])
      send(pid, {__MODULE__, id, {:failed, error}})
    end

    if state.ref && state.conn, do: :gun.cancel(state.conn, state.ref)
    if state.conn_mon, do: Process.demonitor(state.conn_mon, [:flush])

    %{
      state
      | ref: nil,
        conn: nil,
        buffer: <<>>,
        calls: %{},
        mons: %{},
        conn_mon: nil,
        unanswered: %{},
        outgoing: []
    }
  end

  defp response_error(status, headers) do
    map = Map.new(headers)

    case map["grpc-status"] do
      nil -> Error.local(:internal, "grpc_error", "HTTP status #{status} on the multiplexed stream")
      _ -> trailers_error(headers)
    end
  end

  defp trailers_error(trailers) do
    case VllmBridge.Transport.status(trailers) do
      :ok -> Error.local(:unavailable, "grpc_error", "the server ended the multiplexed stream")
      {:error, e} -> e
    end
  end
end
