"""PyTorch Lightning on spotrain (`pip install spotrain[lightning]`).

    from spotrain import elastic
    from spotrain.elastic import lightning_trainer

    elastic.wait_for_gang()
    trainer = lightning.Trainer(**lightning_trainer.trainer_kwargs())
    trainer.fit(module, ckpt_path=lightning_trainer.resume_checkpoint())

    # in the LightningModule:
    def train_dataloader(self):
        return lightning_trainer.dataloader(self.dataset, self.trainer)

- `SpotrainCallback`: on the elastic event every rank agrees at the step boundary
  (`reduce_boolean_decision`), the trainer saves a checkpoint (recorded as the job's latest,
  then acked) and stops; it also saves every `ckpt_every` steps (scale_config, default 50).
  Progress, the completion marker, and MLflow metrics (`mlflow_metrics`) as for the HF Trainer.
  After a resume, the optimizers keep the learning rates `configure_optimizers` set for this
  world size (scale_config), not the ones restored from the checkpoint.
- `trainer_kwargs`: max_steps, DDP over this generation's nodes and processes, the callback,
  and no distributed sampler of Lightning's own (the elastic one replaces it).
- `dataloader`: this rank's uneven share of each global batch, continuing the job's sample
  stream at the restored step (`spotrain.elastic.sampler`). The loss must be a global
  mean: sum over the local batch times world_size / global_batch_size (DDP averages).

Restart mode: a resize ends the generation; the next resumes from the checkpoint.
"""

from __future__ import annotations

import os
from typing import Any
from urllib.parse import urlparse

import lightning.pytorch as pl
from torch.utils.data import DataLoader, Dataset

from spotrain import elastic
from spotrain.elastic import mlflow_metrics
from spotrain.elastic.sampler import ElasticBatchSampler


def checkpoint_dir(s: elastic.Settings) -> str:
    """Checkpoints under the job's file:// location (Lightning's own I/O handles no s3:// here)."""
    parsed = urlparse(s.checkpoint)
    if parsed.scheme != "file":
        raise ValueError(
            f"the Lightning integration checkpoints to file:// only, not {s.checkpoint!r}"
        )
    return os.path.join(parsed.path, "lightning")


def resume_checkpoint() -> str | None:
    """The job's latest complete checkpoint, for `trainer.fit(ckpt_path=...)`."""
    latest = elastic.latest_checkpoint()
    return latest["path"] if latest else None


class SpotrainCallback(pl.Callback):
    """The rank contract inside Lightning's fit loop (every rank runs it)."""

    def __init__(self) -> None:
        self.stopping = False
        self.lrs: list[list[float]] = []

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Optimizers exist, the checkpoint's states are not loaded yet: this size's rates.
        self.lrs = [[g["lr"] for g in opt.param_groups] for opt in trainer.optimizers]

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        for opt, lrs in zip(trainer.optimizers, self.lrs, strict=True):
            for group, lr in zip(opt.param_groups, lrs, strict=True):
                group["lr"] = lr
        for config in trainer.lr_scheduler_configs:
            if hasattr(config.scheduler, "base_lrs"):
                config.scheduler.base_lrs = [
                    g["lr"] for g in config.scheduler.optimizer.param_groups
                ]
        mlflow_metrics.generation_started(trainer.global_step)

    def save(self, trainer: pl.Trainer) -> None:
        """Collective: every rank calls it; rank 0 records the checkpoint once it is written."""
        step = trainer.global_step
        path = os.path.join(checkpoint_dir(elastic.settings()), f"step-{step:07d}.ckpt")
        trainer.save_checkpoint(path)  # all ranks; ends with a barrier
        elastic.mark_checkpoint(step, path)
        trainer.strategy.barrier("spotrain-latest")  # nobody acks before it is the latest

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, *args: Any
    ) -> None:
        step = trainer.global_step
        elastic.report_progress(step)
        if os.environ.get(mlflow_metrics.TRACKING_URI) and isinstance(outputs, dict):
            # The mean of the ranks' losses: the global mean when each rank scaled its sum as
            # the docstring says. Collective, so every rank decides alike (the job's env);
            # on a copy, as all-reduce works in place.
            total = trainer.strategy.reduce(outputs["loss"].detach().clone(), reduce_op="sum")
            loss = float(total) / trainer.world_size
            lr = trainer.optimizers[0].param_groups[0]["lr"]
            mlflow_metrics.log_metrics(step, loss=loss, learning_rate=lr)
        event = trainer.strategy.reduce_boolean_decision(
            elastic.elastic_event_detected(), all=False
        )
        every = int(elastic.settings().scale_config.get("ckpt_every", 50))
        if event or step % every == 0 or step == trainer.max_steps:
            self.save(trainer)
        if event:
            self.stopping = True
            elastic.ack_checkpoint(step)
            mlflow_metrics.generation_ended(step, "elastic event")
            trainer.should_stop = True

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self.stopping:
            elastic.mark_done(trainer.global_step)
            mlflow_metrics.generation_ended(trainer.global_step, "done")
            trainer.strategy.barrier("spotrain-done")  # no rank exits before the marker


def trainer_kwargs(**overrides: Any) -> dict[str, Any]:
    """Keyword arguments for `lightning.Trainer` in this generation; `overrides` win, and
    callbacks given there are kept beside spotrain's."""
    s = elastic.settings()
    procs = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    kwargs: dict[str, Any] = {
        "max_steps": s.total_steps,
        "devices": procs,
        "num_nodes": s.world_size // procs,
        "strategy": "ddp" if s.world_size > 1 else "auto",
        "use_distributed_sampler": False,
        "enable_checkpointing": False,  # spotrain's callback saves
        "enable_progress_bar": False,
        "logger": False,
        "num_sanity_val_steps": 0,
    }
    callbacks = [SpotrainCallback(), *overrides.pop("callbacks", [])]
    return {**kwargs, **overrides, "callbacks": callbacks}


def dataloader(dataset: Dataset, trainer: pl.Trainer, seed: int = 0, **kwargs: Any) -> DataLoader:
    """This rank's batches from the trainer's (restored) global step on; `kwargs` go to the
    DataLoader (num_workers, collate_fn, ...)."""
    sampler = ElasticBatchSampler(len(dataset), start_step=trainer.global_step, seed=seed)  # type: ignore[arg-type]
    return DataLoader(dataset, batch_sampler=sampler, **kwargs)
