defmodule VllmBridge.MixProject do
  use Mix.Project

  def project do
    [
      app: :vllm_bridge,
      version: "0.1.0",
      elixir: "~> 1.14",
      start_permanent: Mix.env() == :prod,
      elixirc_paths: ["lib"],
      deps: deps(),
      description: "Elixir client for vllm-bridge: the documented vLLM bindings over gRPC"
    ]
  end

  def application do
    [extra_applications: [:logger], mod: {VllmBridge.Application, []}]
  end

  # The versions it was tried with (README, "Requirements").
  @grpc ">= 0.9.0 and < 0.11.0"
  @protobuf ">= 0.12.0 and < 0.15.0"

  defp deps do
    case System.get_env("VLLM_BRIDGE_DEPS_DIR") do
      nil -> [{:grpc, @grpc}, {:protobuf, @protobuf}]
      dir -> local_deps(dir)
    end
  end

  # Without access to Hex, every dependency can come from a folder of source checkouts, one
  # sub-folder per package (grpc, protobuf, gun, cowlib, cowboy, ranch, mint, hpax, telemetry, and
  # for grpc 0.10 flow and gen_stage). `override: true` makes these win over the Hex requirements
  # the packages declare themselves.
  defp local_deps(dir) do
    mix = ~w(grpc protobuf mint hpax flow gen_stage)a
    rebar = ~w(gun cowlib cowboy ranch telemetry)a
    here = &File.dir?(Path.join(dir, "#{&1}"))

    Enum.map(Enum.filter(mix, here), &{&1, path: Path.join(dir, "#{&1}"), override: true}) ++
      Enum.map(Enum.filter(rebar, here), &{&1, path: Path.join(dir, "#{&1}"), override: true, manager: :rebar3})
  end
end
