# lib/vllm (vllm-bridge gen-elixir) and lib/vllm_bridge/proto (protoc-gen-elixir) are generated.
[
  inputs: ["{mix,.formatter}.exs", "{test,examples}/**/*.{ex,exs}", "lib/*.ex", "lib/vllm_bridge/*.ex"],
  line_length: 120
]
