defmodule VllmBridge.V1.StreamEncoding do
  @moduledoc false

  use Protobuf, enum: true, protoc_gen_elixir_version: "0.12.0", syntax: :proto3

  field :STREAM_ENCODING_FULL, 0
  field :STREAM_ENCODING_PATCH_V1, 1
  field :STREAM_ENCODING_PATCH_V2, 2
end

defmodule VllmBridge.V1.Target.Kind do
  @moduledoc false

  use Protobuf, enum: true, protoc_gen_elixir_version: "0.12.0", syntax: :proto3

  field :KIND_UNSPECIFIED, 0
  field :FUNCTION, 1
  field :MODULE_ATTR, 2
  field :CONSTRUCTOR, 3
  field :METHOD, 4
  field :GET_ATTR, 5
  field :SET_ATTR, 6
  field :ITERATE, 7
end

defmodule VllmBridge.V1.Parameter.Kind do
  @moduledoc false

  use Protobuf, enum: true, protoc_gen_elixir_version: "0.12.0", syntax: :proto3

  field :KIND_UNSPECIFIED, 0
  field :POSITIONAL_ONLY, 1
  field :POSITIONAL_OR_KEYWORD, 2
  field :VAR_POSITIONAL, 3
  field :KEYWORD_ONLY, 4
  field :VAR_KEYWORD, 5
end

defmodule VllmBridge.V1.CatalogEntry.Kind do
  @moduledoc false

  use Protobuf, enum: true, protoc_gen_elixir_version: "0.12.0", syntax: :proto3

  field :KIND_UNSPECIFIED, 0
  field :FUNCTION, 1
  field :MODULE_ATTR, 2
  field :CONSTRUCTOR, 3
  field :CLASSMETHOD, 4
  field :METHOD, 5
  field :ATTRIBUTE, 6
end

defmodule VllmBridge.V1.Value do
  @moduledoc false

  use Protobuf, protoc_gen_elixir_version: "0.12.0", syntax: :proto3

  oneof :kind, 0

  field :null, 1, type: VllmBridge.V1.Null, oneof: 0
  field :bool, 2, type: :bool, oneof: 0
  field :int, 3, type: :sint64, oneof: 0
  field :big_int, 4, type: :string, json_name: "bigInt", oneof: 0
  field :float, 5, type: :double, oneof: 0
  field :str, 6, type: :string, oneof: 0
  field :bytes, 7, type: :bytes, oneof: 0
  field :list, 8, type: VllmBridge.V1.Items, oneof: 0
  field :tuple, 9, type: VllmBridge.V1.Items, oneof: 0
  field :set, 10, type: VllmBridge.V1.Items, oneof: 0
  field :frozenset, 11, type: VllmBridge.V1.Items, oneof: 0
  field :map, 12, type: VllmBridge.V1.Map, oneof: 0
  field :atom, 13, type: :string, oneof: 0
  field :tensor, 14, type: VllmBridge.V1.Tensor, oneof: 0
  field :ref, 15, type: VllmBridge.V1.Ref, oneof: 0
  field :record, 16, type: VllmBridge.V1.Record, oneof: 0
  field :enum, 17, type: VllmBridge.V1.Enum, oneof: 0
  field :ints, 18, type: VllmBridge.V1.Ints, oneof: 0
end

defmodule VllmBridge.V1.Null do
  @moduledoc false

  use Protobuf, protoc_gen_elixir_version: "0.12.0", syntax: :proto3
end

defmodule VllmBridge.V1.Items do
  @moduledoc false

  use Protobuf, protoc_gen_elixir_version: "0.12.0", syntax: :proto3

  field :items, 1, repeated: true, type: VllmBridge.V1.Value
end

defmodule VllmBridge.V1.Ints do
  @moduledoc false

  use Protobuf, protoc_gen_elixir_version: "0.12.0", syntax: :proto3

  field :values, 1, repeated: true, type: :sint64
end

defmodule VllmBridge.V1.Map do
  @moduledoc false

  use Protobuf, protoc_gen_elixir_version: "0.12.0", syntax: :proto3

  field :entries, 1, repeated: true, type: VllmBridge.V1.Entry
end

defmodule VllmBridge.V1.Entry do
  @moduledoc false

  use Protobuf, protoc_gen_elixir_version: "0.12.0", syntax: :proto3

  field :key, 1, type: VllmBridge.V1.Value
  field :value, 2, type: VllmBridge.V1.Value
end

defmodule VllmBridge.V1.Tensor do
  @moduledoc false

  use Protobuf, protoc_gen_elixir_version: "0.12.0", syntax: :proto3

  field :dtype, 1, type: :string
  field :shape, 2, repeated: true, type: :int64
  field :data, 3, type: :bytes
end

defmodule VllmBridge.V1.Ref do
  @moduledoc false

  use Protobuf, protoc_gen_elixir_version: "0.12.0", syntax: :proto3

  field :id, 1, type: :string
  field :session_id, 2, type: :string, json_name: "sessionId"
  field :worker_id, 3, type: :string, json_name: "workerId"
  field :type_name, 4, type: :string, json_name: "typeName"
  field :repr, 5, type: :string
end

defmodule VllmBridge.V1.Record do
  @moduledoc false

  use Protobuf, protoc_gen_elixir_version: "0.12.0", syntax: :proto3

  field :type_name, 1, type: :string, json_name: "typeName"
  field :fields, 2, repeated: true, type: VllmBridge.V1.Field
end

defmodule VllmBridge.V1.Field do
  @moduledoc false

  use Protobuf, protoc_gen_elixir_version: "0.12.0", syntax: :proto3

  field :name, 1, type: :string
  field :value, 2, type: VllmBridge.V1.Value
end

defmodule VllmBridge.V1.Enum do
  @moduledoc false

  use Protobuf, protoc_gen_elixir_version: "0.12.0", syntax: :proto3

  field :type_name, 1, type: :string, json_name: "typeName"
  field :name, 2, type: :string
  field :value, 3, type: VllmBridge.V1.Value
end

defmodule VllmBridge.V1.Target do
  @moduledoc false

  use Protobuf, protoc_gen_elixir_version: "0.12.0", syntax: :proto3

  oneof :receiver, 0

  field :kind, 1, type: VllmBridge.V1.Target.Kind, enum: true
  field :name, 2, type: :string
  field :ref, 3, type: VllmBridge.V1.Ref, oneof: 0
  field :object, 4, type: :string, oneof: 0
end

defmodule VllmBridge.V1.CallRequest.KwargsEntry do
  @moduledoc false

  use Protobuf, map: true, protoc_gen_elixir_version: "0.12.0", syntax: :proto3

  field :key, 1, type: :string
  field :value, 2, type: VllmBridge.V1.Value
end

defmodule VllmBridge.V1.CallRequest do
  @moduledoc false

  use Protobuf, protoc_gen_elixir_version: "0.12.0", syntax: :proto3

  field :target, 1, type: VllmBridge.V1.Target
  field :args, 2, repeated: true, type: VllmBridge.V1.Value
  field :kwargs, 3, repeated: true, type: VllmBridge.V1.CallRequest.KwargsEntry, map: true
end

defmodule VllmBridge.V1.CallReply do
  @moduledoc false

  use Protobuf, protoc_gen_elixir_version: "0.12.0", syntax: :proto3

  field :value, 1, type: VllmBridge.V1.Value
end

defmodule VllmBridge.V1.StreamItem do
  @moduledoc false

  use Protobuf, protoc_gen_elixir_version: "0.12.0", syntax: :proto3

  field :index, 1, type: :uint64
  field :value, 2, type: VllmBridge.V1.Value
  field :patch, 3, type: VllmBridge.V1.StreamPatch
end

defmodule VllmBridge.V1.StreamPatch do
  @moduledoc false

  use Protobuf, protoc_gen_elixir_version: "0.12.0", syntax: :proto3

  field :ops, 1, repeated: true, type: VllmBridge.V1.PatchOp
  field :row, 2, type: VllmBridge.V1.PatchRow
end

defmodule VllmBridge.V1.PatchRow do
  @moduledoc false

  use Protobuf, protoc_gen_elixir_version: "0.12.0", syntax: :proto3

  field :strs, 1, repeated: true, type: :string
  field :ints, 2, repeated: true, type: :sint64
  field :floats, 3, repeated: true, type: :double
end

defmodule VllmBridge.V1.PatchOp do
  @moduledoc false

  use Protobuf, protoc_gen_elixir_version: "0.12.0", syntax: :proto3

  oneof :op, 0

  field :path, 1, repeated: true, type: :uint32
  field :set, 2, type: VllmBridge.V1.Value, oneof: 0
  field :append_str, 3, type: :string, json_name: "appendStr", oneof: 0
  field :append_ints, 4, type: VllmBridge.V1.Ints, json_name: "appendInts", oneof: 0
  field :append_items, 5, type: VllmBridge.V1.Items, json_name: "appendItems", oneof: 0
end

defmodule VllmBridge.V1.CollectiveRequest do
  @moduledoc false

  use Protobuf, protoc_gen_elixir_version: "0.12.0", syntax: :proto3

  field :call, 1, type: VllmBridge.V1.CallRequest
  field :per_rank, 2, repeated: true, type: VllmBridge.V1.CallRequest, json_name: "perRank"
end

defmodule VllmBridge.V1.CollectiveReply do
  @moduledoc false

  use Protobuf, protoc_gen_elixir_version: "0.12.0", syntax: :proto3

  field :results, 1, repeated: true, type: VllmBridge.V1.CallReply
end

defmodule VllmBridge.V1.CollectiveRequestView do
  @moduledoc false

  use Protobuf, protoc_gen_elixir_version: "0.12.0", syntax: :proto3

  field :call, 1, type: :bytes
  field :per_rank, 2, repeated: true, type: :bytes, json_name: "perRank"
end

defmodule VllmBridge.V1.CollectiveReplyView do
  @moduledoc false

  use Protobuf, protoc_gen_elixir_version: "0.12.0", syntax: :proto3

  field :results, 1, repeated: true, type: :bytes
end

defmodule VllmBridge.V1.CallTargetView do
  @moduledoc false

  use Protobuf, protoc_gen_elixir_version: "0.12.0", syntax: :proto3

  field :target, 1, type: VllmBridge.V1.Target
end

defmodule VllmBridge.V1.ReleaseRequest do
  @moduledoc false

  use Protobuf, protoc_gen_elixir_version: "0.12.0", syntax: :proto3

  field :ref_ids, 1, repeated: true, type: :string, json_name: "refIds"
  field :session_id, 2, type: :string, json_name: "sessionId"
end

defmodule VllmBridge.V1.ReleaseReply do
  @moduledoc false

  use Protobuf, protoc_gen_elixir_version: "0.12.0", syntax: :proto3

  field :released, 1, type: :uint32
end

defmodule VllmBridge.V1.DescribeRequest do
  @moduledoc false

  use Protobuf, protoc_gen_elixir_version: "0.12.0", syntax: :proto3

  field :prefix, 1, type: :string
end

defmodule VllmBridge.V1.Parameter do
  @moduledoc false

  use Protobuf, protoc_gen_elixir_version: "0.12.0", syntax: :proto3

  field :name, 1, type: :string
  field :kind, 2, type: VllmBridge.V1.Parameter.Kind, enum: true
  field :has_default, 3, type: :bool, json_name: "hasDefault"
  field :default_repr, 4, type: :string, json_name: "defaultRepr"
  field :doc_type, 5, type: :string, json_name: "docType"
  field :annotation, 6, type: :string
end

defmodule VllmBridge.V1.CatalogEntry do
  @moduledoc false

  use Protobuf, protoc_gen_elixir_version: "0.12.0", syntax: :proto3

  field :name, 1, type: :string
  field :kind, 2, type: VllmBridge.V1.CatalogEntry.Kind, enum: true
  field :module, 3, type: :string
  field :class_name, 4, type: :string, json_name: "className"
  field :parameters, 5, repeated: true, type: VllmBridge.V1.Parameter
  field :return_type, 6, type: :string, json_name: "returnType"
  field :streams, 7, type: :bool
  field :is_async, 8, type: :bool, json_name: "isAsync"
  field :summary, 9, type: :string
  field :default_timeout_profile, 10, type: :string, json_name: "defaultTimeoutProfile"
  field :exclusive, 11, type: :bool
  field :documented_in, 12, type: :string, json_name: "documentedIn"
end

defmodule VllmBridge.V1.Catalog do
  @moduledoc false

  use Protobuf, protoc_gen_elixir_version: "0.12.0", syntax: :proto3

  field :entries, 1, repeated: true, type: VllmBridge.V1.CatalogEntry
  field :vllm_version, 2, type: :string, json_name: "vllmVersion"
  field :bridge_version, 3, type: :string, json_name: "bridgeVersion"
end

defmodule VllmBridge.V1.ErrorDetail do
  @moduledoc false

  use Protobuf, protoc_gen_elixir_version: "0.12.0", syntax: :proto3

  field :category, 1, type: :string
  field :python_type, 2, type: :string, json_name: "pythonType"
  field :message, 3, type: :string
  field :traceback, 4, type: :string
  field :target, 5, type: :string
  field :parameter, 6, type: :string
  field :reason, 7, type: :string
  field :suggestions, 8, repeated: true, type: :string
end

defmodule VllmBridge.V1.MuxRequest do
  @moduledoc false

  use Protobuf, protoc_gen_elixir_version: "0.12.0", syntax: :proto3

  oneof :kind, 0

  field :start, 1, type: VllmBridge.V1.MuxStart, oneof: 0
  field :cancel, 2, type: :uint64, oneof: 0
  field :credit, 3, type: VllmBridge.V1.MuxCredit, oneof: 0
  field :batch, 4, type: VllmBridge.V1.MuxBatch, oneof: 0
end

defmodule VllmBridge.V1.MuxBatch do
  @moduledoc false

  use Protobuf, protoc_gen_elixir_version: "0.12.0", syntax: :proto3

  field :requests, 1, repeated: true, type: VllmBridge.V1.MuxRequest
end

defmodule VllmBridge.V1.MuxCredit do
  @moduledoc false

  use Protobuf, protoc_gen_elixir_version: "0.12.0", syntax: :proto3

  field :id, 1, type: :uint64
  field :events, 2, type: :uint32
end

defmodule VllmBridge.V1.MuxStart.MetadataEntry do
  @moduledoc false

  use Protobuf, map: true, protoc_gen_elixir_version: "0.12.0", syntax: :proto3

  field :key, 1, type: :string
  field :value, 2, type: :string
end

defmodule VllmBridge.V1.MuxStart do
  @moduledoc false

  use Protobuf, protoc_gen_elixir_version: "0.12.0", syntax: :proto3

  field :id, 1, type: :uint64
  field :call, 2, type: VllmBridge.V1.CallRequest
  field :stream, 3, type: :bool
  field :metadata, 4, repeated: true, type: VllmBridge.V1.MuxStart.MetadataEntry, map: true
  field :window, 5, type: :uint32
  field :time_left_ms, 6, type: :double, json_name: "timeLeftMs"
end

defmodule VllmBridge.V1.MuxReply do
  @moduledoc false

  use Protobuf, protoc_gen_elixir_version: "0.12.0", syntax: :proto3

  field :events, 1, repeated: true, type: VllmBridge.V1.MuxEvent
  field :worker_refs, 2, type: :uint64, json_name: "workerRefs"
end

defmodule VllmBridge.V1.MuxEvent do
  @moduledoc false

  use Protobuf, protoc_gen_elixir_version: "0.12.0", syntax: :proto3

  oneof :kind, 0

  field :id, 1, type: :uint64
  field :value, 2, type: VllmBridge.V1.Value, oneof: 0
  field :end, 3, type: VllmBridge.V1.Null, oneof: 0
  field :error, 4, type: VllmBridge.V1.MuxError, oneof: 0
  field :patch, 5, type: VllmBridge.V1.StreamPatch, oneof: 0
end

defmodule VllmBridge.V1.MuxError do
  @moduledoc false

  use Protobuf, protoc_gen_elixir_version: "0.12.0", syntax: :proto3

  field :code, 1, type: :int32
  field :message, 2, type: :string
  field :detail, 3, type: VllmBridge.V1.ErrorDetail
end

defmodule VllmBridge.V1.MuxRequestView do
  @moduledoc false

  use Protobuf, protoc_gen_elixir_version: "0.12.0", syntax: :proto3

  oneof :kind, 0

  field :start, 1, type: VllmBridge.V1.MuxStartView, oneof: 0
  field :cancel, 2, type: :uint64, oneof: 0
  field :credit, 3, type: VllmBridge.V1.MuxCredit, oneof: 0
  field :batch, 4, type: VllmBridge.V1.MuxBatchView, oneof: 0
end

defmodule VllmBridge.V1.MuxBatchView do
  @moduledoc false

  use Protobuf, protoc_gen_elixir_version: "0.12.0", syntax: :proto3

  field :requests, 1, repeated: true, type: VllmBridge.V1.MuxRequestView
end

defmodule VllmBridge.V1.MuxStartView.MetadataEntry do
  @moduledoc false

  use Protobuf, map: true, protoc_gen_elixir_version: "0.12.0", syntax: :proto3

  field :key, 1, type: :string
  field :value, 2, type: :string
end

defmodule VllmBridge.V1.MuxStartView do
  @moduledoc false

  use Protobuf, protoc_gen_elixir_version: "0.12.0", syntax: :proto3

  field :id, 1, type: :uint64
  field :call, 2, type: :bytes
  field :stream, 3, type: :bool
  field :metadata, 4, repeated: true, type: VllmBridge.V1.MuxStartView.MetadataEntry, map: true
  field :window, 5, type: :uint32
  field :time_left_ms, 6, type: :double, json_name: "timeLeftMs"
end

defmodule VllmBridge.V1.MuxReplyView do
  @moduledoc false

  use Protobuf, protoc_gen_elixir_version: "0.12.0", syntax: :proto3

  field :events, 1, repeated: true, type: VllmBridge.V1.MuxEventView
  field :worker_refs, 2, type: :uint64, json_name: "workerRefs"
end

defmodule VllmBridge.V1.MuxEventView do
  @moduledoc false

  use Protobuf, protoc_gen_elixir_version: "0.12.0", syntax: :proto3

  oneof :kind, 0

  field :id, 1, type: :uint64
  field :value, 2, type: :bytes, oneof: 0
  field :end, 3, type: VllmBridge.V1.Null, oneof: 0
  field :error, 4, type: VllmBridge.V1.MuxError, oneof: 0
  field :patch, 5, type: :bytes, oneof: 0
end

defmodule VllmBridge.V1.CallReplyView do
  @moduledoc false

  use Protobuf, protoc_gen_elixir_version: "0.12.0", syntax: :proto3

  field :value, 1, type: :bytes
end

defmodule VllmBridge.V1.StreamItemView do
  @moduledoc false

  use Protobuf, protoc_gen_elixir_version: "0.12.0", syntax: :proto3

  field :index, 1, type: :uint64
  field :value, 2, type: :bytes
  field :patch, 3, type: :bytes
end

defmodule VllmBridge.V1.Bridge.Service do
  @moduledoc false

  use VllmBridge.Proto.Service, name: "vllm_bridge.v1.Bridge", protoc_gen_elixir_version: "0.12.0"

  rpc :Call, VllmBridge.V1.CallRequest, VllmBridge.V1.CallReply

  rpc :Stream, VllmBridge.V1.CallRequest, stream(VllmBridge.V1.StreamItem)

  rpc :Collective, VllmBridge.V1.CollectiveRequest, VllmBridge.V1.CollectiveReply

  rpc :Release, VllmBridge.V1.ReleaseRequest, VllmBridge.V1.ReleaseReply

  rpc :Describe, VllmBridge.V1.DescribeRequest, VllmBridge.V1.Catalog

  rpc :Multiplex, stream(VllmBridge.V1.MuxRequest), stream(VllmBridge.V1.MuxReply)
end
