"""What runs inside vLLM's engine core process, loaded there by `bridge_server/cli.py` (the module the
spawned core imports as its main) and by a worker whose engine runs in its own process.

Why: some of vLLM's CPU paths fail on requests that are valid, and a failure there kills the engine
core, which every client of the worker shares. What is fixed here is fixed where it happens; the
requests stay as they are.

- Structured outputs beside plain requests. When an engine step holds rows with a grammar and rows
  without, vLLM hands xgrammar the list of grammar rows as a tensor in pinned memory, which needs a
  CUDA driver: on a CPU engine every such step raised, and the core died (any structured request
  that shared a step with any other request did it, at will). A grammar-less row's mask allows
  every token, so the mask is applied to every row here: each row not in the grammar output gets a
  row of ones, and vLLM then takes its path for a mask that covers the whole batch, which pins
  nothing. Logits of those rows are unchanged.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
from collections.abc import Callable
from typing import Any

__all__ = ["install", "mask_every_row"]


def mask_every_row(apply: Callable[..., None]) -> Callable[..., None]:
    """vLLM's `apply_grammar_bitmask`, given a grammar output that covers every row of the step
    (rows of ones for the requests without a grammar), so that the bitmask spans the batch."""
    @functools.wraps(apply)
    def apply_to_every_row(scheduler_output: Any, grammar_output: Any, input_batch: Any, logits: Any) -> None:
        import numpy as np
        listed = set(grammar_output.structured_output_request_ids)
        others = [r for r in input_batch.req_ids if r is not None and r not in listed]
        if others:
            spec = scheduler_output.scheduled_spec_decode_tokens
            rows = len(input_batch.req_ids) + sum(len(spec.get(r, ())) for r in input_batch.req_ids if r is not None)
            if rows == logits.shape[0]:     # else the batch is not what we take it for: vLLM's own way
                mask = grammar_output.grammar_bitmask
                extra = sum(1 + len(spec.get(r, ())) for r in others)
                ones = np.full((extra, mask.shape[1]), -1, dtype=mask.dtype)
                grammar_output = dataclasses.replace(
                    grammar_output,
                    structured_output_request_ids=[*grammar_output.structured_output_request_ids, *others],
                    grammar_bitmask=np.concatenate([mask, ones]))
        apply(scheduler_output, grammar_output, input_batch, logits)
    return apply_to_every_row


def install() -> None:
    """Puts the fixes above in place of vLLM's functions, where vLLM's model runner looks them up
    (a module global, per step). Without a CUDA driver only: on a GPU vLLM's path works as it is."""
    import torch
    if torch.cuda.is_available():
        return
    runner = importlib.import_module("vllm.v1.worker.gpu_model_runner")
    current = getattr(runner, "apply_grammar_bitmask")     # noqa: B009 - a module global the runner looks up per step
    if getattr(current, "__wrapped__", None) is None:
        setattr(runner, "apply_grammar_bitmask", mask_every_row(current))   # noqa: B010
