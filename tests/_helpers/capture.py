"""Warm-up before a CUDA graph capture, as PyTorch asks for it."""

from __future__ import annotations

from collections.abc import Callable

import torch


def warm_up(fn: Callable[[], object]) -> None:
    """Run ``fn`` on a side stream, ordered after the current stream's work and before its next.

    Capture requires its kernels compiled and its workspaces made beforehand, by work on a
    stream other than the one to capture on.
    """
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
