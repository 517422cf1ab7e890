"""Joining an engine process to its tensor-parallel rank group, and what the ranks must agree on
before they serve.

Every engine process of a `--tp N` engine calls `join_ranks` while it starts: a TCP rendezvous on
127.0.0.1 at the port the launcher chose, over gloo on the CPU and NCCL on GPUs (where each rank
takes the GPU of its own index, and a gloo group beside it carries the host's step plans and
token ids). The KV pool's page count is agreed once: each rank plans its
own budget, and all take the smallest (on the CPU every rank plans the same count; on GPUs free
memory may differ by rank, and the scheduler's page count must fit every rank's pool).
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

from m3serve.model.parallel import RankGroup
from m3serve.runtime.messages import RankAddress

# A collective's timeout is also how long a follower may wait for rank 0's next plan, which on
# an idle server is forever: a dead rank is noticed by its closed sockets (and the supervisor),
# not by this timeout. Start-up is bounded by the supervisor's own start-up timeout.
COLLECTIVE_TIMEOUT = timedelta(days=365)


def rank_device(device: torch.device, address: RankAddress) -> torch.device:
    """This rank's device: its own GPU on CUDA (one rank per GPU), the CPU as it is."""
    if device.type == "cuda":
        return torch.device("cuda", address.rank)
    return device


def join_ranks(address: RankAddress, device: torch.device) -> RankGroup:
    """This process as rank `address.rank` of the default process group (returns once every
    rank has joined)."""
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group(
        "nccl" if cuda else "gloo",
        init_method=f"tcp://127.0.0.1:{address.port}",
        rank=address.rank,
        world_size=address.size,
        timeout=COLLECTIVE_TIMEOUT,
        # NCCL's communicator is made now, bound to this GPU, not lazily by the first
        # collective (which could fall inside a CUDA graph capture).
        device_id=device if cuda else None,
    )
    # Plans and token ids cross as CPU tensors (model/parallel.py RankGroup.host_group).
    host = dist.new_group(backend="gloo", timeout=COLLECTIVE_TIMEOUT) if cuda else None
    return RankGroup(address.rank, address.size, host_group=host)


def agree_on_pages(ranks: RankGroup, pages: int, device: torch.device) -> int:
    """The smallest of every rank's planned KV page count (`pages` itself with one rank)."""
    if ranks.size == 1:
        return pages
    count = torch.tensor([pages], dtype=torch.int64, device=device)
    dist.all_reduce(count, op=dist.ReduceOp.MIN, group=ranks.group)
    return int(count.item())


def leave_ranks() -> None:
    """Tear the process group down (after the last collective), if this process joined one."""
    if dist.is_initialized():
        dist.destroy_process_group()
