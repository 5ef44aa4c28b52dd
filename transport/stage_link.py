"""Point-to-point link between pipeline stages: IntermediateTensors from stage i to stage i + 1.

No shape metadata travels: the receiver knows the token count from the ExecuteModelRequest it holds
too, and the tensor names, hidden size and dtype from the model.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class StageLink:
    def __init__(self, prev_rank: int | None, next_rank: int | None, device: torch.device) -> None:
        self.prev_rank = prev_rank
        self.next_rank = next_rank
        self.device = device
        self._pending: list[tuple[dist.Work, torch.Tensor]] = []

    def send(self, tensors: dict[str, torch.Tensor]) -> None:
        """Sends asynchronously so this stage can start its next batch; keeps the tensors alive."""
        assert self.next_rank is not None
        self.wait_sent()
        for name in sorted(tensors):
            t = tensors[name].contiguous()
            self._pending.append((dist.isend(t, dst=self.next_rank), t))

    def wait_sent(self) -> None:
        for work, _ in self._pending:
            work.wait()
        self._pending.clear()

    def recv(
        self, names: tuple[str, ...], num_tokens: int, hidden_size: int, dtype: torch.dtype
    ) -> dict[str, torch.Tensor]:
        assert self.prev_rank is not None
        out: dict[str, torch.Tensor] = {}
        for name in sorted(names):
            buf = torch.empty((num_tokens, hidden_size), dtype=dtype, device=self.device)
            dist.recv(buf, src=self.prev_rank)
            out[name] = buf
        return out
