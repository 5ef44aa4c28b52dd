"""Running a kernel under several torch thread counts (the C kernels take torch.get_num_threads())."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch


def outputs_with_threads(
    fn: Callable[[], torch.Tensor], counts: Iterable[int] = (1, 2, 3, 7)
) -> list[torch.Tensor]:
    """fn() under each thread count in turn (more than the machine's cores included: a kernel that shares
    out work dynamically then hands items between threads), the caller's count restored after."""
    before = torch.get_num_threads()
    try:
        outs = []
        for threads in counts:
            torch.set_num_threads(threads)
            outs.append(fn())
        return outs
    finally:
        torch.set_num_threads(before)
