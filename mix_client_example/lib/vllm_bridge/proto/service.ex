defmodule VllmBridge.Proto.Service do
  @moduledoc false
  # What `use GRPC.Service` gives the service modules protoc-gen-elixir writes (`plugins=grpc`),
  # without depending on elixir-grpc: the table of RPCs the transport reads. The generated text
  # stays as protoc-gen-elixir writes it, except `use GRPC.Service` -> `use VllmBridge.Proto.Service`
  # and no `Stub` module (README, "Regenerating").
  #
  #     rpc :Call, VllmBridge.V1.CallRequest, VllmBridge.V1.CallReply
  #     VllmBridge.V1.Bridge.Service.__rpc__(:Call)
  #     #=> %{path: "/vllm_bridge.v1.Bridge/Call", request: VllmBridge.V1.CallRequest,
  #     #     reply: VllmBridge.V1.CallReply, client_stream: false, server_stream: false}

  defmacro __using__(opts) do
    name = Keyword.fetch!(opts, :name)

    quote do
      import VllmBridge.Proto.Service, only: [rpc: 3, stream: 1]
      Module.register_attribute(__MODULE__, :vllm_bridge_rpcs, accumulate: true)
      @vllm_bridge_service unquote(name)
      @before_compile VllmBridge.Proto.Service
    end
  end

  @doc false
  def stream(module), do: {:stream, module}

  @doc false
  defmacro rpc(name, request, reply) do
    quote do
      @vllm_bridge_rpcs {unquote(name), unquote(request), unquote(reply)}
    end
  end

  @doc false
  defmacro __before_compile__(env) do
    service = Module.get_attribute(env.module, :vllm_bridge_service)

    rpcs =
      for {name, request, reply} <- Module.get_attribute(env.module, :vllm_bridge_rpcs) do
        {name,
         %{
           path: "/#{service}/#{name}",
           request: unwrap(request),
           reply: unwrap(reply),
           client_stream: match?({:stream, _}, request),
           server_stream: match?({:stream, _}, reply)
         }}
      end

    quote do
      @doc false
      def __service__, do: unquote(service)

      @doc false
      def __rpc__(name), do: Map.fetch!(unquote(Macro.escape(Map.new(rpcs))), name)

      @doc false
      def __rpcs__, do: unquote(rpcs |> Keyword.keys() |> Enum.sort())
    end
  end

  defp unwrap({:stream, module}), do: module
  defp unwrap(module), do: module
end
