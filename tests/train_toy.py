"""A small deterministic training job for tests/test_train_loop.py: an MLP classifier with dropout and
noise augmentation (so RNG state matters) on synthetic numpy data held in the env.

As a script: ``train_toy.py RUN_DIR CONFIG_JSON [--threads N] [--delay S] [--no-rng-restore] [--restart]
[--nan-key KEY]`` trains, prints the result as JSON and exits 75 when a signal interrupted it. Under torchrun
(RANK in the environment) each rank joins a gloo process group first and prints its weights' digest too.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time

import numpy as np
import torch

from snakeshard.train import TorchRunner, TrainProvider, TrainingInterrupted, train

N_TRAIN, N_VALID, DIM, CLASSES = 240, 48, 16, 4


class ToyProvider(TrainProvider):
    def build_env(self):
        torch.set_num_threads(int(self.config.get("threads", 1)))
        data = np.random.default_rng(1234)
        centers = data.normal(size=(CLASSES, DIM)).astype(np.float32)
        labels = data.integers(0, CLASSES, size=N_TRAIN + N_VALID)
        x = centers[labels] + data.normal(scale=1.5, size=(len(labels), DIM)).astype(np.float32)
        keys = [f"utt{i:04d}" for i in range(len(labels))]
        table = {k: (torch.from_numpy(x[i]), int(labels[i])) for i, k in enumerate(keys)}
        torch.manual_seed(0)  # the initial weights
        model = torch.nn.Sequential(torch.nn.Linear(DIM, 32), torch.nn.ReLU(), torch.nn.Dropout(0.3),
                                    torch.nn.Linear(32, CLASSES))
        optimizer = torch.optim.Adam(model.parameters(), lr=float(self.config.get("lr", 0.01)))
        return {"model": model, "optimizer": optimizer, "table": table, "delay": float(self.config.get("delay", 0)),
                "nan_key": self.config.get("nan_key"), "train_keys": keys[:N_TRAIN], "valid_keys": keys[N_TRAIN:]}


def _tensors(batch, table):
    x = torch.stack([table[k][0] for k in batch])
    y = torch.tensor([table[k][1] for k in batch])
    return x, y


class ToyRunner(TorchRunner):
    @staticmethod
    def train_step(batch, *, model, table, delay, nan_key):
        if delay:
            time.sleep(delay)
        x, y = _tensors(batch, table)
        x = x + 0.1 * torch.randn_like(x)  # augmentation: draws from torch's RNG
        logits = model(x)
        loss = torch.nn.functional.cross_entropy(logits, y)
        if nan_key in batch:
            loss = loss * float("nan")
        return {"loss": loss, "acc": (logits.argmax(1) == y).float().mean()}

    @staticmethod
    def evaluate_step(batch, *, model, table):
        x, y = _tensors(batch, table)
        logits = model(x)
        return {"loss": torch.nn.functional.cross_entropy(logits, y), "acc": (logits.argmax(1) == y).float().mean()}


def main(argv):
    run_dir, config = argv[0], json.loads(argv[1])
    opts = argv[2:]
    threads = int(opts[opts.index("--threads") + 1]) if "--threads" in opts else 1
    delay = float(opts[opts.index("--delay") + 1]) if "--delay" in opts else 0.0
    if "--no-rng-restore" in opts:
        import snakeshard.train.loop as loop
        loop._RESTORE_RNG = False
    provider_config = {"threads": threads, "delay": delay, "lr": config.pop("lr", 0.01),
                       "nan_key": opts[opts.index("--nan-key") + 1] if "--nan-key" in opts else None}
    if "RANK" in os.environ:
        import torch.distributed as dist

        dist.init_process_group("gloo")
    env = ToyProvider(provider_config).build_env_local()
    train_keys, valid_keys = env.pop("train_keys"), env.pop("valid_keys")
    fingerprint = json.dumps({"lr": provider_config["lr"]})
    try:
        result = train(ToyRunner, env, train_keys, valid_keys, config, run_dir, fingerprint=fingerprint,
                       restart="--restart" in opts)
    except TrainingInterrupted as e:
        print(e, file=sys.stderr)
        return e.exit_code
    weights = hashlib.sha256(b"".join(t.numpy().tobytes() for t in env["model"].state_dict().values())).hexdigest()
    sys.stdout.write(json.dumps({"step": result.step, "epoch": result.epoch, "best_epoch": result.best_epoch,
                                 "resumed_from": str(result.resumed_from) if result.resumed_from else None,
                                 "weights": weights}) + "\n")  # one write: ranks share the stdout
    if "RANK" in os.environ:
        # both ranks past their last collective before either leaves: a rank that tore gloo down while its
        # peer still used the pair aborted once in a full parallel suite ("terminate called without an
        # active exception"); then destroy, as gloo's threads abort the exit otherwise
        dist.barrier()
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
