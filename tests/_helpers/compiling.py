"""A ``torch.compile`` backend that keeps the graphs Dynamo hands it, for tests to inspect."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch._dynamo.backends.registry import lookup_backend


def aot_eager_keeping(graphs: list[torch.fx.GraphModule]) -> Callable[..., Any]:
    """``aot_eager`` (eager's kernels), appending each graph it compiles to ``graphs``."""

    def backend(gm: torch.fx.GraphModule, inputs: list[torch.Tensor]) -> Any:
        graphs.append(gm)
        return lookup_backend("aot_eager")(gm, inputs)

    return backend
