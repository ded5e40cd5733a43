defmodule VllmBridge.Connection do
  @moduledoc false
  # The HTTP/2 connection to each server, shared by every process of the VM.
  #
  # gRPC multiplexes calls over one connection, and a gun connection closes when the process that
  # opened it exits, so one long-lived process per server opens it (started on first use, under
  # VllmBridge.ConnectionSupervisor). Callers read the connection from an ETS table, without a
  # message round trip; requests are made by the caller itself. A connection that dies is removed
  # and reopened by the next call; a server whose address or options changed (a restarted
  # VllmBridge.Server on a new port, say) gets a new connection.

  use GenServer

  alias VllmBridge.{Config, Error, Transport}

  @table :vllm_bridge_connections
  # A failed attempt answers the callers that waited for it (and those that come just after) with
  # its error, instead of each trying again in turn behind it.
  @failure_ms 500

  @typedoc "What a request needs: the gun connection and the headers every request carries."
  @type t :: {pid(), [{String.t(), String.t()}]}

  @doc "The connection to `server`, connecting first if needed."
  @spec get(Config.Server.t()) :: {:ok, t()} | {:error, Error.t()}
  def get(%Config.Server{key: key} = server) do
    case :ets.lookup(@table, key) do
      [{^key, ^server, pid, headers}] ->
        if Process.alive?(pid), do: {:ok, {pid, headers}}, else: connect(server)

      _ ->
        connect(server)
    end
  end

  @doc """
  Stops handing out `pid` for `server` (it is closing: the server sent GOAWAY); the next call
  opens a new connection. Calls still running on it finish there.
  """
  @spec forget(Config.Server.t(), pid()) :: :ok
  def forget(%Config.Server{key: key}, pid) do
    :ets.match_delete(@table, {key, :_, pid, :_})

    case Registry.lookup(VllmBridge.ConnectionRegistry, key) do
      [{owner, _}] -> GenServer.call(owner, {:forget, pid})
      [] -> :ok
    end
  catch
    :exit, _ -> :ok
  end

  @doc "Closes the connection to the server named `key`, if any (calls on it fail as `unavailable`)."
  @spec close(Config.server()) :: :ok
  def close(key) do
    case Registry.lookup(VllmBridge.ConnectionRegistry, key) do
      [{pid, _}] -> GenServer.cast(pid, :close)
      [] -> :ok
    end
  end

  defp connect(%Config.Server{key: key} = server) do
    owner =
      case DynamicSupervisor.start_child(VllmBridge.ConnectionSupervisor, {__MODULE__, key}) do
        {:ok, pid} -> pid
        {:error, {:already_started, pid}} -> pid
      end

    GenServer.call(owner, {:connect, server}, server.connect_timeout + 5_000)
  catch
    :exit, reason ->
      {:error, Error.local(:unavailable, "grpc_error", "cannot connect to #{server.address}: #{inspect(reason)}")}
  end

  @doc false
  def child_spec(key), do: %{id: {__MODULE__, key}, start: {__MODULE__, :start_link, [key]}, restart: :temporary}

  @doc false
  def start_link(key),
    do: GenServer.start_link(__MODULE__, key, name: {:via, Registry, {VllmBridge.ConnectionRegistry, key}})

  @impl true
  def init(key), do: {:ok, %{key: key, server: nil, pid: nil, mon: nil, failed: nil}}

  @impl true
  def handle_call({:connect, server}, _from, state) do
    case state do
      %{server: ^server, pid: pid} when is_pid(pid) ->
        # Another caller connected while this one waited.
        [{_, _, _, headers}] = :ets.lookup(@table, state.key)
        {:reply, {:ok, {pid, headers}}, state}

      %{failed: {^server, at, err}} ->
        if System.monotonic_time(:millisecond) - at < @failure_ms,
          do: {:reply, err, state},
          else: connect_now(server, %{state | failed: nil})

      _ ->
        connect_now(server, state)
    end
  end

  def handle_call({:forget, pid}, _from, %{pid: pid} = state) do
    Process.demonitor(state.mon, [:flush])
    :ets.match_delete(@table, {state.key, :_, pid, :_})
    # gun finishes what runs on it, then closes and exits on its own
    {:reply, :ok, %{state | server: nil, pid: nil, mon: nil}}
  end

  def handle_call({:forget, _pid}, _from, state), do: {:reply, :ok, state}

  @impl true
  def handle_cast(:close, state), do: {:noreply, disconnect(state)}

  @impl true
  def handle_info({:DOWN, mon, :process, _pid, _reason}, %{mon: mon} = state) do
    :ets.delete(@table, state.key)
    {:noreply, %{state | server: nil, pid: nil, mon: nil}}
  end

  # gun_up / gun_down of our connection (with retry: 0 a connection that goes down exits).
  def handle_info({:gun_down, pid, _proto, _reason, _killed}, %{pid: pid} = state), do: {:noreply, disconnect(state)}
  def handle_info(_msg, state), do: {:noreply, state}

  defp connect_now(server, state) do
    state = disconnect(state)

    case Transport.open(server) do
      {:ok, pid, headers} ->
        :ets.insert(@table, {state.key, server, pid, headers})
        {:reply, {:ok, {pid, headers}}, %{state | server: server, pid: pid, mon: Process.monitor(pid), failed: nil}}

      {:error, _} = err ->
        {:reply, err, %{state | failed: {server, System.monotonic_time(:millisecond), err}}}
    end
  end

  defp disconnect(%{pid: nil} = state), do: state

  defp disconnect(state) do
    Process.demonitor(state.mon, [:flush])
    :ets.delete(@table, state.key)
    :gun.close(state.pid)
    %{state | server: nil, pid: nil, mon: nil}
  end
end
