"""A Hugging Face Trainer job on spotrain: a tiny GPT-2 built from its config learns synthetic
sequences (no weights or data downloaded). Run by a spotrain runtime (examples/job_hf.yaml).

The spotrain parts are three lines: `wait_for_gang`, `training_arguments`, `ElasticTrainer`
(`spotrain.elastic.hf_trainer`). The elastic event saves and stops the Trainer at a step
boundary; the next generation resumes from that checkpoint at its own world size, with this
world size's scale_config (e.g. learning_rate) and its share of the global batch.

`--record DIR` appends, per rank and step, the dataset indices the rank trained on and the
logged loss as JSON lines (the tests check them).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
from transformers import GPT2Config, GPT2LMHeadModel, TrainerCallback

from spotrain import elastic
from spotrain.elastic import hf_trainer

VOCAB, LENGTH, SAMPLES = 32, 12, 4096


class Sequences(torch.utils.data.Dataset):
    """Sequence i counts up from a start in strides of a step, both fixed by i: learnable."""

    def __init__(self) -> None:
        self.taken: list[int] = []  # indices fetched since the last step (the recorder's)

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        self.taken.append(i)
        start, stride = i % VOCAB, 1 + (i // VOCAB) % 3
        ids = (start + stride * torch.arange(LENGTH)) % VOCAB
        return {"input_ids": ids, "labels": ids}


class Recorder(TrainerCallback):
    """One JSON line per step: what this rank trained on, and the loss the Trainer logged."""

    def __init__(self, path: Path, data: Sequences) -> None:
        self.file = path.open("a", buffering=1)  # line-buffered: a killed rank keeps its steps
        self.data = data

    def on_log(self, args, state, control, logs=None, **kwargs):  # type: ignore[no-untyped-def]
        if logs and "loss" in logs:
            s = elastic.settings()
            entry = {"step": state.global_step, "indices": self.data.taken, "world": s.world_size}
            self.file.write(
                json.dumps({**entry, "loss": logs["loss"], "lr": logs.get("learning_rate")}) + "\n"
            )
            self.data.taken = []


class Pace(TrainerCallback):
    """Sleeps after each step: stands in for a bigger model's step (tests)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def on_step_end(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
        time.sleep(self.seconds)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--record", type=Path, help="append consumed indices and losses here")
    parser.add_argument("--step-time", type=float, default=0.0, help="sleep per step (tests)")
    args = parser.parse_args()
    torch.set_num_threads(1)  # a tiny model: threads only fight over the cores

    s = elastic.wait_for_gang()
    training_args = hf_trainer.training_arguments(
        learning_rate=3e-3,
        save_steps=25,
        logging_steps=1,
        seed=0,
        use_cpu=not torch.cuda.is_available(),
    )
    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=VOCAB,
        n_positions=LENGTH,
        n_embd=32,
        n_layer=1,
        n_head=2,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    model = GPT2LMHeadModel(config)
    data = Sequences()
    trainer = hf_trainer.ElasticTrainer(model=model, args=training_args, train_dataset=data)
    if args.record:
        args.record.mkdir(parents=True, exist_ok=True)
        path = args.record / f"gen-{s.generation}-rank-{s.rank}.jsonl"
        trainer.add_callback(Recorder(path, data))
    if args.step_time:
        trainer.add_callback(Pace(args.step_time))
    print(
        f"gen {s.generation} rank {s.rank}/{s.world_size}: "
        f"batch {training_args.per_device_train_batch_size} lr {training_args.learning_rate} "
        f"from {hf_trainer.resume_checkpoint()}",
        flush=True,
    )
    trainer.train()
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    # As examples/train_ddp.py: skip gloo's teardown, which can deadlock at exit.
    os._exit(code)
