"""Data parallelism under torchrun (plumbing): the workers a batch is split among, injected into Algorithm 1 so that
arco.py reads the same in one process. Each worker rolls out, annotates and backpropagates its part of a batch; what
the equations need of the whole batch comes back whole (`map`), gradients and logged totals are summed (`total`,
`total_gradients`). One process (a plain `python arco.py`): one worker, and every method returns its input."""
from __future__ import annotations

import datetime
import os
import sys
from typing import Callable, Sequence

import torch
import torch.distributed as dist


class Workers:
    """torchrun's processes (WORLD_SIZE, RANK, LOCAL_RANK in the environment), or this process `alone`."""

    def __init__(self, alone: bool = False):
        self.count = 1 if alone else int(os.environ.get("WORLD_SIZE", 1))
        self.index = 0 if alone else int(os.environ.get("RANK", 0))
        self.main = self.index == 0                     # the one that writes files and prints
        self.device = torch.device("cpu")

    def start(self, args) -> None:
        """Join the process group: NCCL on CUDA (each worker its GPU, cuda:LOCAL_RANK), gloo on CPU."""
        if self.count == 1:
            return
        if args.sampling != "trajectory":
            sys.exit("error: a torchrun run needs --sampling trajectory (each trajectory its own random stream, so "
                     "the rollouts do not depend on how the batch is split across processes)")
        if args.device.startswith("cuda:"):
            sys.exit(f"error: under torchrun each process takes its own GPU (cuda:LOCAL_RANK): pass --device cuda or "
                     f"auto, not {args.device} (CUDA_VISIBLE_DEVICES chooses which GPUs)")
        cuda = torch.cuda.is_available() and args.device in ("auto", "cuda")
        if cuda:
            args.device = f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}"
            torch.cuda.set_device(args.device)
            self.device = torch.device(args.device)
        # a long timeout: the other workers wait at a barrier while the first makes the warmup
        dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(hours=12))

    def part(self, n: int) -> slice:
        """This worker's contiguous part of n items (the first n % count workers take one more)."""
        q, r = divmod(n, self.count)
        start = self.index * q + min(self.index, r)
        return slice(start, start + q + (self.index < r))

    def own(self, items: Sequence) -> list:
        """The items this worker computes: all of them in one process."""
        return list(items)[self.part(len(items))]

    def map(self, fn: Callable[[list], list], items: Sequence) -> list:
        """fn (a list → as many results) on this worker's part of `items`; every worker gets all the results, in
        the items' order. One process: fn(items)."""
        mine = fn(self.own(items)) if items else []
        if self.count == 1:
            return mine
        out: list = [None] * self.count
        dist.all_gather_object(out, mine)
        return [x for part in out for x in part]

    def total(self, *values: float) -> list[float]:
        """Each value summed over the workers."""
        if self.count == 1:
            return list(values)
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(t)
        return t.tolist()

    def any(self, flag: bool) -> bool:
        return bool(self.total(float(flag))[0]) if self.count > 1 else flag

    def total_gradients(self, params) -> None:
        """Each gradient summed over the workers (the losses already divide by the whole batch's |B|)."""
        if self.count == 1:
            return
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        flat = torch.cat([p.grad.reshape(-1) for p in params])          # one all-reduce for all of them
        dist.all_reduce(flat)
        for p, g in zip(params, flat.split([p.numel() for p in params])):
            p.grad.copy_(g.view_as(p.grad))

    def own_stream(self, seed: int) -> None:
        """After a step every worker took alike (a batch's rollouts), each its own random stream from `seed` (its
        LoRA dropout masks). One process: its stream goes on unchanged."""
        if self.count > 1:
            torch.manual_seed(seed * 64 + self.index)

    def first(self, fn: Callable):
        """A step that makes files once: the first worker runs it while the others wait, then they run it (finding
        what it made). One process: fn()."""
        if self.count == 1:
            return fn()
        out = fn() if self.main else None
        self.barrier()
        return out if self.main else fn()

    def barrier(self) -> None:
        if self.count > 1:
            dist.barrier()

    def end(self) -> None:
        """Leave the process group together (a worker that leaves alone can abort its peer's last call)."""
        if self.count > 1:
            dist.barrier()
            dist.destroy_process_group()


ALONE = Workers(alone=True)        # this process by itself: the default of every function that takes workers
