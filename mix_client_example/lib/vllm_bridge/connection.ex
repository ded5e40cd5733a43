defmodule VllmBridge.Application do
  @moduledoc false
  use Application

  @impl true
  def start(_type, _args) do
    :persistent_term.put({VllmBridge, :vm}, Base.url_encode64(:crypto.strong_rand_bytes(6), padding: false))

    children = [
      VllmBridge.Connection,
      VllmBridge.Sessions,
      {Registry, keys: :unique, name: VllmBridge.MuxRegistry},
      {DynamicSupervisor, name: VllmBridge.MuxSupervisor, strategy: :one_for_one}
    ]

    Supervisor.start_link(children, strategy: :one_for_one, name: VllmBridge.Supervisor)
  end
end

defmodule VllmBridge.Connection do
  @moduledoc """
  Owns the HTTP/2 connections (one per server address), shared by every process.

  gRPC multiplexes calls over one connection, and a gun connection dies with the process that
  opened it, so a long-lived process opens them; callers read the channel from `:persistent_term`
  without a message round trip. A connection that dies is reopened on the next call.
  """
  use GenServer

  alias VllmBridge.Error

  def start_link(_), do: GenServer.start_link(__MODULE__, %{}, name: __MODULE__)

  @doc "The channel for `address`, connecting first if needed."
  @spec channel(String.t()) :: {:ok, GRPC.Channel.t()} | {:error, Error.t()}
  def channel(address) do
    case :persistent_term.get({__MODULE__, address}, nil) do
      %{adapter_payload: %{conn_pid: pid}} = ch when is_pid(pid) ->
        if Process.alive?(pid), do: {:ok, ch}, else: GenServer.call(__MODULE__, {:connect, address}, 30_000)

      _ ->
        GenServer.call(__MODULE__, {:connect, address}, 30_000)
    end
  end

  @impl true
  def init(state), do: {:ok, state}

  @impl true
  def handle_call({:connect, address}, _from, state) do
    case :persistent_term.get({__MODULE__, address}, nil) do
      %{adapter_payload: %{conn_pid: pid}} = ch when is_pid(pid) ->
        if Process.alive?(pid), do: {:reply, {:ok, ch}, state}, else: connect(address, state)

      _ ->
        connect(address, state)
    end
  end

  @impl true
  def handle_info({:DOWN, _mon, :process, pid, _reason}, state) do
    {address, state} = Map.pop(state, pid)
    if address, do: :persistent_term.erase({__MODULE__, address})
    {:noreply, state}
  end

  def handle_info(_msg, state), do: {:noreply, state}

  defp connect(address, state) do
    opts = [adapter: VllmBridge.Transport, adapter_opts: [retry: 0, http2_opts: %{keepalive: 30_000}]]

    case GRPC.Stub.connect(address, opts) do
      {:ok, %{adapter_payload: %{conn_pid: pid}} = ch} ->
        Process.monitor(pid)
        :persistent_term.put({__MODULE__, address}, ch)
        {:reply, {:ok, ch}, Map.put(state, pid, address)}

      {:error, reason} ->
        {:reply, {:error, Error.local(:unavailable, "grpc_error", "cannot connect to #{address}: #{inspect(reason)}")},
         state}
    end
  rescue
    e ->
      {:reply,
       {:error, Error.local(:unavailable, "grpc_error", "cannot connect to #{address}: #{Exception.message(e)}")},
       state}
  end
end

defmodule VllmBridge.Sessions do
  @moduledoc """
  Releases a process's default session when the process exits.

  By default every Elixir process calls under its own session (`VllmBridge.session_id/0`), so the
  refs it makes live as long as it does, as the documents describe. Refs passed to other processes stay
  usable while their maker lives; to keep refs beyond that, call with an explicit
  `__runtime__: [session_id: ...]` (never released automatically) or set
  `config :vllm_bridge, release_sessions_on_exit: false`.
  """
  use GenServer

  def start_link(_), do: GenServer.start_link(__MODULE__, %{}, name: __MODULE__)

  @doc false
  def watch(pid, session), do: GenServer.cast(__MODULE__, {:watch, pid, session})

  @impl true
  def init(state), do: {:ok, state}

  @impl true
  def handle_cast({:watch, pid, session}, state) do
    Process.monitor(pid)
    {:noreply, Map.put(state, pid, session)}
  end

  @impl true
  def handle_info({:DOWN, _mon, :process, pid, _reason}, state) do
    {session, state} = Map.pop(state, pid)
    if session, do: spawn(fn -> VllmBridge.release_session(session) end)
    {:noreply, state}
  end
end
