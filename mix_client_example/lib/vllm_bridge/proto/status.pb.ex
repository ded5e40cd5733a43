defmodule VllmBridge.Proto.Google.Rpc.Status do
  @moduledoc false

  use Protobuf, protoc_gen_elixir_version: "0.12.0", syntax: :proto3

  field :code, 1, type: :int32
  field :message, 2, type: :string
  field :details, 3, repeated: true, type: VllmBridge.Proto.Google.Protobuf.Any
end