"""Every surface the worker serves, in the order the catalog lists them."""

from adapters.async_llm import ASYNC_LLM
from adapters.distributed import DISTRIBUTED
from adapters.forward_context import DP_METADATA, FORWARD_CONTEXT
from adapters.spec import AdapterSpec

SPECS: tuple[AdapterSpec, ...] = (FORWARD_CONTEXT, DP_METADATA, DISTRIBUTED, ASYNC_LLM)
