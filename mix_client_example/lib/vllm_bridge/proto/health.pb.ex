defmodule VllmBridge.Proto.Grpc.Health.V1.HealthCheckResponse.ServingStatus do
  @moduledoc false

  use Protobuf, enum: true, protoc_gen_elixir_version: "0.12.0", syntax: :proto3

  field :UNKNOWN, 0
  field :SERVING, 1
  field :NOT_SERVING, 2
  field :SERVICE_UNKNOWN, 3
end

defmodule VllmBridge.Proto.Grpc.Health.V1.HealthCheckRequest do
  @moduledoc false

  use Protobuf, protoc_gen_elixir_version: "0.12.0", syntax: :proto3

  field :service, 1, type: :string
end

defmodule VllmBridge.Proto.Grpc.Health.V1.HealthCheckResponse do
  @moduledoc false

  use Protobuf, protoc_gen_elixir_version: "0.12.0", syntax: :proto3

  field :status, 1,
    type: VllmBridge.Proto.Grpc.Health.V1.HealthCheckResponse.ServingStatus,
    enum: true
end

defmodule VllmBridge.Proto.Grpc.Health.V1.Health.Service do
  @moduledoc false

  use VllmBridge.Proto.Service, name: "grpc.health.v1.Health", protoc_gen_elixir_version: "0.12.0"

  rpc :Check,
      VllmBridge.Proto.Grpc.Health.V1.HealthCheckRequest,
      VllmBridge.Proto.Grpc.Health.V1.HealthCheckResponse

  rpc :Watch,
      VllmBridge.Proto.Grpc.Health.V1.HealthCheckRequest,
      stream(VllmBridge.Proto.Grpc.Health.V1.HealthCheckResponse)
end
