defmodule VllmBridge.Application do
  @moduledoc false
  use Application

  @impl true
  def start(_type, _args) do
    :persistent_term.put({VllmBridge, :vm}, Base.url_encode64(:crypto.strong_rand_bytes(6), padding: false))

    children = [
      VllmBridge.Config,
      {Registry, keys: :unique, name: VllmBridge.ConnectionRegistry},
      {DynamicSupervisor, name: VllmBridge.ConnectionSupervisor, strategy: :one_for_one},
      VllmBridge.Sessions,
      {Registry, keys: :unique, name: VllmBridge.ServerRegistry},
      {Registry, keys: :unique, name: VllmBridge.MuxRegistry},
      {DynamicSupervisor, name: VllmBridge.MuxSupervisor, strategy: :one_for_one}
    ]

    # The ETS tables live in VllmBridge.Config's process: if it goes, everything after it restarts.
    Supervisor.start_link(children, strategy: :rest_for_one, name: VllmBridge.Supervisor)
  end
end

defmodule VllmBridge.Sessions do
  @moduledoc """
  Releases a process's default session when the process exits.

  By default every Elixir process calls under its own session (`VllmBridge.session_id/0`), so the
  refs it makes live as long as it does, as the documents describe. Refs passed to other processes
  stay usable while their maker lives; to keep refs beyond that, call with an explicit
  `__runtime__: [session_id: ...]` (never released automatically) or set
  `config :vllm_bridge, release_sessions_on_exit: false`. The session is released on every server
  the process called.
  """
  use GenServer

  @doc false
  def start_link(_), do: GenServer.start_link(__MODULE__, %{}, name: __MODULE__)

  @doc false
  # The calling process's default session was used on `server`: release it there when it exits.
  @spec watch(pid(), String.t(), VllmBridge.Config.server()) :: :ok
  def watch(pid, session, server), do: GenServer.cast(__MODULE__, {:watch, pid, session, server})

  @impl true
  def init(state), do: {:ok, state}

  @impl true
  def handle_cast({:watch, pid, session, server}, state) do
    state =
      case state do
        %{^pid => {s, servers}} -> %{state | pid => {s, MapSet.put(servers, server)}}
        _ -> Process.monitor(pid) && Map.put(state, pid, {session, MapSet.new([server])})
      end

    {:noreply, state}
  end

  @impl true
  def handle_info({:DOWN, _mon, :process, pid, _reason}, state) do
    {entry, state} = Map.pop(state, pid)

    with {session, servers} <- entry do
      for server <- servers, do: spawn(fn -> release(session, server) end)
    end

    {:noreply, state}
  end

  # Best effort: a server that is gone (or no longer configured) has dropped the session anyway.
  defp release(session, server) do
    VllmBridge.release_session(session, __runtime__: [server: server])
  rescue
    ArgumentError -> :ok
  end
end
