"""Which samples each rank trains on at each step, the same whatever the world size (torch).

Step s (0-based) consumes positions [s*G, (s+1)*G) of an endless stream over the dataset, G the
job's global batch size; epoch e of the stream is a fixed permutation of the dataset seeded by
(seed, e), so a position always names the same sample. Rank r takes its share of each global
batch (`Settings.batch_slice`: the uneven split). A generation at another world size that
resumes at step s therefore continues the very same stream: no sample is repeated or skipped
across a resize. Framework integrations (`hf_trainer`, `lightning_trainer`) hand this to their
DataLoader as its `batch_sampler`.
"""

from __future__ import annotations

from collections.abc import Iterator
from functools import lru_cache

import torch
from torch.utils.data import Sampler

from spotrain import elastic


@lru_cache(maxsize=4)
def _epoch_order(dataset_size: int, seed: int, epoch: int) -> torch.Tensor:
    return torch.randperm(
        dataset_size, generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    )


def stream_indices(start: int, count: int, dataset_size: int, seed: int = 0) -> list[int]:
    """Dataset indices at stream positions [start, start + count)."""
    return [
        int(_epoch_order(dataset_size, seed, p // dataset_size)[p % dataset_size])
        for p in range(start, start + count)
    ]


class ElasticBatchSampler(Sampler[list[int]]):
    """This rank's batch for every step from `start_step` to the job's `total_steps`. Its
    length is always total_steps (the whole job is one epoch): a loop that resumes at step k
    counts k batches as done (Lightning), or skips k of them itself (the HF Trainer, with
    start_step 0)."""

    def __init__(
        self,
        dataset_size: int,
        settings: elastic.Settings | None = None,
        *,
        start_step: int = 0,
        seed: int = 0,
    ) -> None:
        s = settings or elastic.settings()
        if s.global_batch_size is None:
            raise ValueError(
                "the job spec sets no global_batch_size: the elastic sampler splits it over ranks"
            )
        if dataset_size < 1:
            raise ValueError("the dataset is empty")
        self.dataset_size = dataset_size
        self.global_batch_size = s.global_batch_size
        self.slice = s.batch_slice()
        self.total_steps = s.total_steps
        self.start_step = start_step
        self.seed = seed

    def positions(self, step: int) -> range:
        """Stream positions this rank consumes at 0-based `step`."""
        first = step * self.global_batch_size
        return range(first + self.slice.start, first + self.slice.stop)

    def __len__(self) -> int:
        return self.total_steps

    def __iter__(self) -> Iterator[list[int]]:
        for step in range(self.start_step, self.total_steps):
            p = self.positions(step)
            yield stream_indices(p.start, len(p), self.dataset_size, self.seed)
