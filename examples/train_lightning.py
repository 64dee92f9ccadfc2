"""A PyTorch Lightning job on spotrain: a small MLP regression on synthetic data, DDP on CPU
(gloo) or GPU. Run by a spotrain runtime (examples/job_lightning.yaml).

The spotrain parts: `wait_for_gang`, `trainer_kwargs` (Trainer settings for this generation
plus spotrain's callback), `dataloader` (this rank's uneven share of the global batch, from
the restored step on), and `resume_checkpoint` for `fit`. scale_config keys: lr, ckpt_every.

`--record DIR` appends per rank and step the dataset indices trained on and the global loss.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import lightning.pytorch as pl
import torch
from torch import nn

from spotrain import elastic
from spotrain.elastic import lightning_trainer

SAMPLES, FEATURES = 4096, 8


class Regression(torch.utils.data.Dataset):
    def __init__(self) -> None:
        g = torch.Generator().manual_seed(11)
        self.x = torch.randn(SAMPLES, FEATURES, generator=g)
        self.y = torch.tanh(self.x @ torch.randn(FEATURES, 1, generator=g) / FEATURES**0.5)

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        return self.x[i], self.y[i], i


class Module(pl.LightningModule):
    def __init__(self, record: Path | None, step_time: float) -> None:
        super().__init__()
        self.step_time = step_time
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(FEATURES, 32), nn.Tanh(), nn.Linear(32, 1))
        self.data = Regression()
        self.s = elastic.settings()
        self.record = None
        if record:
            record.mkdir(parents=True, exist_ok=True)
            name = f"gen-{self.s.generation}-rank-{self.s.rank}.jsonl"
            self.record = (record / name).open("a", buffering=1)

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        return lightning_trainer.dataloader(self.data, self.trainer)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        lr = float(self.s.scale_config.get("lr", 0.02))
        return torch.optim.SGD(self.parameters(), lr=lr, momentum=0.9)

    def training_step(self, batch: tuple[torch.Tensor, ...], batch_idx: int) -> torch.Tensor:
        x, y, idx = batch
        time.sleep(self.step_time)  # stands in for a bigger model's step
        sse = ((self.net(x) - y) ** 2).sum()
        if self.record:  # the global loss: one all-reduce of the sums
            total = self.trainer.strategy.reduce(sse.detach().clone(), reduce_op="sum")
            row = {"step": self.trainer.global_step + 1, "indices": idx.tolist()}
            row |= {"world": self.s.world_size, "loss": float(total) / self.s.global_batch_size}
            row["lr"] = self.trainer.optimizers[0].param_groups[0]["lr"]
            self.record.write(json.dumps(row) + "\n")
        return sse * self.s.world_size / self.s.global_batch_size  # DDP averages: global mean


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--record", type=Path)
    parser.add_argument("--step-time", type=float, default=0.0, help="sleep per step (tests)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    elastic.wait_for_gang()
    trainer = pl.Trainer(**lightning_trainer.trainer_kwargs())
    trainer.fit(
        Module(args.record, args.step_time), ckpt_path=lightning_trainer.resume_checkpoint()
    )
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    os._exit(code)  # as examples/train_ddp.py: skip gloo's teardown, which can hang at exit
