"""A test helper: what torch.compile traces of a function."""

from __future__ import annotations

import torch


def compiled_calls(fn, *args):
    """``fn(*args)`` compiled (``fullgraph=True``, static shapes) through a backend that runs the traced graph as
    it is and records its calls; -> (output, the graph's call targets as strings). Dynamo's caches are reset before
    and after, so that no graph of another test is reused or left behind."""
    seen: list[str] = []

    def backend(gm, inputs):
        seen.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm

    torch._dynamo.reset()
    try:
        return torch.compile(fn, backend=backend, fullgraph=True, dynamic=False)(*args), seen
    finally:
        torch._dynamo.reset()
