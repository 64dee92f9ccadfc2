"""Hugging Face `transformers.Trainer` on spotrain (`pip install spotrain[hf]`).

    from spotrain import elastic
    from spotrain.elastic import hf_trainer

    elastic.wait_for_gang()
    args = hf_trainer.training_arguments(learning_rate=1e-3)   # job settings filled in
    trainer = hf_trainer.ElasticTrainer(model=model, args=args, train_dataset=data)
    trainer.train()                                 # resumes from the job's latest checkpoint

- `SpotrainCallback` (works with any Trainer): on the elastic event every rank agrees at the
  step boundary, the Trainer saves a checkpoint and stops; the checkpoint is recorded as the
  job's latest, then acked. Progress goes to the job every step (throttled), and a finished
  run leaves the completion marker. With a tracking location, the Trainer's logs (loss,
  learning rate, throughput) and the generation's start and end go to the job's MLflow run
  (`spotrain.elastic.mlflow_metrics`).
- `training_arguments`: max_steps from the job's total_steps, the per-device batch size from
  this rank's share of global_batch_size, and the scale_config of this world size applied on
  top (keys named like TrainingArguments fields, plus `lr` for learning_rate).
- `ElasticTrainer`: a Trainer with the callback and the elastic sampler
  (`spotrain.elastic.sampler`): ranks take uneven shares of each global batch, the loss
  is normalised over the global batch (`average_tokens_across_devices`), and a resumed
  generation at any world size continues the same sample stream. A plain Trainer with only the
  callback shards batches evenly (accelerate's sampler), and repeats part of an epoch's data
  after a resize at another world size.

Restart mode: a resize ends the generation and the next one resumes from the checkpoint (the
Trainer cannot change its world size in place). DDP checkpoints reload at any world size.
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any
from urllib.parse import urlparse

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader
from transformers import Trainer, TrainerCallback, TrainingArguments

from spotrain import elastic
from spotrain.elastic import mlflow_metrics
from spotrain.elastic.sampler import ElasticBatchSampler

ALIASES = {"lr": "learning_rate"}


def _fields() -> set[str]:
    return {f.name for f in dataclasses.fields(TrainingArguments) if f.init}


def scale_overrides(scale_config: dict[str, Any]) -> dict[str, Any]:
    """The scale_config entries that are TrainingArguments fields (others are ignored)."""
    named = {ALIASES.get(k, k): v for k, v in scale_config.items()}
    return {k: v for k, v in named.items() if k in _fields()}


def default_output_dir(s: elastic.Settings) -> str:
    """Checkpoints under the job's file:// location; other schemes need a shared filesystem."""
    parsed = urlparse(s.checkpoint)
    if parsed.scheme != "file":
        raise ValueError(
            f"the Trainer saves to a filesystem, not {s.checkpoint!r}: pass output_dir (a "
            "directory every node shares)"
        )
    return os.path.join(parsed.path, "hf")


def training_arguments(output_dir: str | None = None, **kwargs: Any) -> TrainingArguments:
    """TrainingArguments for this generation: spotrain's defaults < `kwargs` < scale_config."""
    s = elastic.settings()
    params: dict[str, Any] = {
        "output_dir": output_dir or default_output_dir(s),
        "max_steps": s.total_steps,
        "save_strategy": "steps",
        "logging_steps": 10,
        "average_tokens_across_devices": True,
        "disable_tqdm": True,
        "report_to": "none",
    }
    if s.local_batch_size is not None:
        params["per_device_train_batch_size"] = s.local_batch_size
    params.update(kwargs)
    params.update(scale_overrides(s.scale_config))
    return TrainingArguments(**params)


def resume_checkpoint() -> str | None:
    """The job's latest complete checkpoint directory, if any: `train(resume_from_checkpoint=)`."""
    latest = elastic.latest_checkpoint()
    return latest["path"] if latest else None


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _any_rank(flag: bool, device: torch.device) -> bool:
    """True on every rank if it is True on any (one small all-reduce)."""
    if not _distributed():
        return flag
    t = torch.tensor([float(flag)], device=device)
    dist.all_reduce(t)
    return t.item() > 0


def _barrier() -> None:
    if _distributed():
        dist.barrier()


class SpotrainCallback(TrainerCallback):
    """The rank contract inside the Trainer's loop (every rank runs it)."""

    def __init__(self) -> None:
        self.stopping = False
        self.last_log: tuple[float, int] | None = None  # (time, step) of the last on_log

    def on_train_begin(self, args, state, control, optimizer=None, lr_scheduler=None, **kwargs):  # type: ignore[no-untyped-def]
        """A resumed optimizer and schedule carry the learning rate of the world size that saved
        them: rescale them to this one's (scale_config), keeping the groups' ratios."""
        mlflow_metrics.generation_started(state.global_step)
        self.last_log = (time.monotonic(), state.global_step)
        base = getattr(lr_scheduler, "base_lrs", None)
        if optimizer is None or not base or max(base) in (0, args.learning_rate):
            return
        ratio = args.learning_rate / max(base)
        lr_scheduler.base_lrs = [lr * ratio for lr in base]
        for group in optimizer.param_groups:
            group["lr"] *= ratio
            if "initial_lr" in group:
                group["initial_lr"] *= ratio
        if hasattr(lr_scheduler, "_last_lr"):  # what get_last_lr() (the logged rate) reports
            lr_scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]

    def on_step_end(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
        elastic.report_progress(state.global_step)
        if _any_rank(elastic.elastic_event_detected(), args.device):
            self.stopping = True
            control.should_save = True
            control.should_training_stop = True

    def on_save(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
        _barrier()  # every rank's share of the checkpoint (its RNG state) is written
        path = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
        elastic.mark_checkpoint(state.global_step, path)
        _barrier()  # nobody acks a checkpoint before it is the latest
        if self.stopping:
            elastic.ack_checkpoint(state.global_step)
            mlflow_metrics.generation_ended(state.global_step, "elastic event")

    def on_log(self, args, state, control, logs=None, **kwargs):  # type: ignore[no-untyped-def]
        """Loss, learning rate and throughput (samples/s since the last log) to MLflow."""
        if not logs or "loss" not in logs:
            return
        now, rate = time.monotonic(), None
        if self.last_log is not None and now > self.last_log[0]:
            s = elastic.settings()
            batch = s.global_batch_size or args.per_device_train_batch_size * s.world_size
            rate = batch * (state.global_step - self.last_log[1]) / (now - self.last_log[0])
        self.last_log = (now, state.global_step)
        mlflow_metrics.log_metrics(
            state.global_step,
            loss=logs["loss"],
            learning_rate=logs.get("learning_rate"),
            grad_norm=logs.get("grad_norm"),
            samples_per_second=rate,
        )

    def on_train_end(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
        if not self.stopping:
            elastic.mark_done(state.global_step)
            mlflow_metrics.generation_ended(state.global_step, "done")
            _barrier()  # no rank exits before the completion marker is on record


class ElasticTrainer(Trainer):
    """A Trainer with `SpotrainCallback`, the elastic sampler, and resume by default."""

    def __init__(self, *args: Any, sampler_seed: int = 0, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.sampler_seed = sampler_seed
        self.add_callback(SpotrainCallback())

    def get_train_dataloader(self) -> DataLoader:
        """This rank's uneven share of each global batch, in stream order. Not handed to
        accelerate's `prepare`: its sampler would shard the batches over ranks a second time.
        On resume the Trainer skips the batches of the steps already done."""
        if self.train_dataset is None:
            raise ValueError("ElasticTrainer: training requires a train_dataset")
        if self.args.gradient_accumulation_steps != 1:
            raise ValueError("ElasticTrainer: one batch per step; raise global_batch_size instead")
        sampler = ElasticBatchSampler(len(self.train_dataset), seed=self.sampler_seed)
        return DataLoader(
            self.train_dataset,
            batch_sampler=sampler,
            collate_fn=self._get_collator_with_removed_columns(self.data_collator, "training"),
            num_workers=self.args.dataloader_num_workers,
            pin_memory=self.args.dataloader_pin_memory,
        )

    def train(self, resume_from_checkpoint: str | bool | None = None, **kwargs: Any):  # type: ignore[no-untyped-def]
        """As Trainer.train; with no explicit checkpoint, the job's latest one."""
        if resume_from_checkpoint is None:
            resume_from_checkpoint = resume_checkpoint()
        return super().train(resume_from_checkpoint=resume_from_checkpoint, **kwargs)
