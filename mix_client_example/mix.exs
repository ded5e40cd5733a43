defmodule VllmBridge.MixProject do
  use Mix.Project

  @version "0.2.0"

  def project do
    [
      app: :vllm_bridge,
      version: @version,
      elixir: "~> 1.14",
      start_permanent: Mix.env() == :prod,
      elixirc_paths: ["lib"],
      deps: deps(),
      description:
        "Elixir client for vllm-bridge: the documented vLLM bindings over gRPC, and a child spec that runs the server",
      package: package(),
      docs: docs()
    ]
  end

  def application do
    [extra_applications: [:logger, :ssl, :public_key, :crypto], mod: {VllmBridge.Application, []}]
  end

  # What the client itself needs: an HTTP/2 client (gun, which the client owns and drives itself,
  # so any elixir-grpc version, or none, can sit beside it), protobuf for the messages, telemetry
  # for events. The ranges are those it was compiled and run with (README, "Requirements").
  @gun "~> 2.0"
  @protobuf ">= 0.12.0 and < 0.18.0"
  @telemetry "~> 0.4.3 or ~> 1.0"

  defp deps do
    case System.get_env("VLLM_BRIDGE_DEPS_DIR") do
      nil ->
        [
          {:gun, @gun},
          {:protobuf, @protobuf},
          {:telemetry, @telemetry},
          {:ex_doc, ">= 0.30.0", only: :dev, runtime: false}
        ]

      dir ->
        local_deps(dir)
    end
  end

  # Without access to Hex, the dependencies can come from a folder of source checkouts, one
  # sub-folder per package (at least gun, cowlib, protobuf and telemetry). Every package in the
  # folder becomes a path dependency, so putting grpc and its dependencies there too builds the
  # client beside that grpc version. A sub-folder counts when it is an Erlang package (rebar.config
  # or erlang.mk; built with rebar3) or a Mix project whose app is named like the folder (so a
  # monorepo checkout such as grpc 1.0's, linked beside its sub-projects, is skipped).
  # `override: true` makes these win over the requirements the packages declare themselves.
  defp local_deps(dir) do
    dir
    |> File.ls!()
    |> Enum.sort()
    |> Enum.flat_map(fn name ->
      path = Path.join(dir, name)

      cond do
        File.exists?(Path.join(path, "rebar.config")) or File.exists?(Path.join(path, "erlang.mk")) ->
          [{String.to_atom(name), path: path, override: true, manager: :rebar3}]

        mix_app?(path, name) ->
          [{String.to_atom(name), path: path, override: true}]

        true ->
          []
      end
    end)
  end

  defp mix_app?(path, name) do
    case File.read(Path.join(path, "mix.exs")) do
      {:ok, text} -> text =~ ~r/\bapp: :#{name}\b/
      _ -> false
    end
  end

  # The license matches vLLM's (Apache-2.0) and is for the maintainers to confirm before publishing,
  # with the project's own source link.
  defp package do
    [
      files: ~w(lib mix.exs README.md),
      licenses: ["Apache-2.0"],
      links: %{"vLLM" => "https://github.com/vllm-project/vllm"}
    ]
  end

  defp docs do
    [
      main: "readme",
      extras: ["README.md"],
      groups_for_modules: [
        Bindings: [Vllm.AsyncLLMEngine, Vllm.Distributed, Vllm.ForwardContext.DPMetadata, Vllm.ForwardContext.Module],
        Client: [
          VllmBridge,
          VllmBridge.Server,
          VllmBridge.Config,
          VllmBridge.Telemetry,
          VllmBridge.Health,
          VllmBridge.Sessions,
          VllmBridge.StreamState
        ],
        Values: [
          VllmBridge.Ref,
          VllmBridge.Tensor,
          VllmBridge.Record,
          VllmBridge.PyEnum,
          VllmBridge.Bytes,
          VllmBridge.FrozenSet,
          VllmBridge.Error,
          VllmBridge.Codec
        ]
      ]
    ]
  end
end
