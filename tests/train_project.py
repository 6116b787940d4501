"""A small training project for tests/test_train_stage.py: tones of 4 pitches (the class, in `text`) as wav files in
Kaldi dirs train/valid/test; stages fbank -> stats (collect-stats) -> train (a pooled-fbank MLP with dropout and
noise augmentation, so RNG state matters) -> infer (from_stage: train) -> score (classification accuracy)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import soundfile

RATE = 8000
PITCHES = (300.0, 700.0, 1200.0, 2000.0)
SPLITS = {"train": 24, "valid": 6, "test": 6}  # utterances per class

MODULE = '''
import time

import numpy as np
import torch

from snakeshard.train import TorchRunner, TrainProvider


class TonesProvider(TrainProvider):
    def build_env(self):
        torch.set_num_threads(int(self.config.get("threads", 1)))
        if self.config.get("no_rng_restore"):  # the negative control: a resume that forgets the RNG states
            import snakeshard.train.loop

            snakeshard.train.loop._RESTORE_RNG = False
        torch.manual_seed(0)  # the initial weights
        bins = int(self.config.get("num_mel_bins", 20))
        hidden = int(self.config.get("hidden", 32))
        model = torch.nn.Sequential(torch.nn.Linear(2 * bins, hidden), torch.nn.ReLU(), torch.nn.Dropout(0.2),
                                    torch.nn.Linear(hidden, 4)).to(self.config["devices"][0])  # cuda:0 with gpu: 1
        optimizer = torch.optim.Adam(model.parameters(), lr=float(self.config.get("lr", 0.01)))
        return {"model": model, "optimizer": optimizer, "step_delay": float(self.config.get("step_delay", 0)),
                "nan_on_key": self.config.get("nan_on_key"), "no_loss": bool(self.config.get("no_loss"))}


def pooled(batch, dataset, normalize, model):
    feats = [normalize(dataset.load_array(k, "feats")) for k in batch]
    x = torch.tensor(np.stack([np.concatenate([f.mean(0), f.std(0)]) for f in feats]), dtype=torch.float32)
    return x.to(device_of(model))


def labels(batch, dataset, model):
    return torch.tensor([int(dataset[k]["text"]) for k in batch], device=device_of(model))


def device_of(model):
    return next(model.parameters()).device


class TonesRunner(TorchRunner):
    @staticmethod
    def train_step(batch, *, model, dataset, normalize, step_delay, nan_on_key, no_loss):
        if step_delay:
            time.sleep(step_delay)
        x = pooled(batch, dataset, normalize, model)
        x = x + 0.3 * torch.randn_like(x)  # augmentation: draws from torch's RNG (the GPU's, on a GPU)
        y = labels(batch, dataset, model)
        logits = model(x)
        loss = torch.nn.functional.cross_entropy(logits, y)
        if nan_on_key in batch:
            loss = loss * float("nan")
        acc = (logits.argmax(1) == y).float().mean()
        return {"acc": acc} if no_loss else {"loss": loss, "acc": acc}

    @staticmethod
    def evaluate_step(batch, *, model, dataset, normalize):
        x = pooled(batch, dataset, normalize, model)
        y = labels(batch, dataset, model)
        logits = model(x)
        return {"loss": torch.nn.functional.cross_entropy(logits, y), "acc": (logits.argmax(1) == y).float().mean()}

    @staticmethod
    def infer_step(batch, *, model, dataset, normalize):
        predictions = model(pooled(batch, dataset, normalize, model)).argmax(1).tolist()
        return {k: {"label": str(p)} for k, p in zip(batch, predictions)}
'''


def write_tones(root: Path) -> None:
    """data/{train,valid,test}: wav.scp, text (the class: 0-3), utt2spk; one wav per key under data/wav/."""
    rng = np.random.default_rng(7)
    (root / "data/wav").mkdir(parents=True, exist_ok=True)
    for split, per_class in SPLITS.items():
        d = root / "data" / split
        d.mkdir(parents=True, exist_ok=True)
        wav, text, spk = [], [], []
        for i in range(per_class):
            for label, pitch in enumerate(PITCHES):
                key = f"{split}-{label}-{i:03d}"
                n = int(RATE * rng.uniform(0.25, 0.45))
                t = np.arange(n) / RATE
                samples = 0.3 * np.sin(2 * np.pi * pitch * rng.uniform(0.9, 1.1) * t) + rng.normal(0, 0.2, n)
                path = root / "data/wav" / f"{key}.wav"
                soundfile.write(path, np.clip(samples, -1, 1).astype(np.float32), RATE, subtype="PCM_16")
                wav.append(f"{key} data/wav/{key}.wav\n")
                text.append(f"{key} {label}\n")
                spk.append(f"{key} spk{i % 3}\n")
        for name, lines in (("wav.scp", wav), ("text", text), ("utt2spk", spk)):
            (d / name).write_text("".join(sorted(lines)))


def config(epochs: int = 4, step_delay: float = 0.0, **training) -> dict:
    """The project's config: fbank over the three splits, stats over train, the training stage, inference on test
    from the trained model, and its accuracy."""
    feats = {f"feats_{s}": {"from_stage": "fbank", "dataset": s} for s in SPLITS}
    return {
        "output_dir": "results",
        "canary": 0,
        "datasets": {**{s: {"path": f"data/{s}"} for s in SPLITS}, **feats,
                     "predicted": {"from_stage": "infer", "dataset": "feats_test"}},
        "stages": {
            "fbank": {"runner": "snakeshard.stages.fbank.FbankRunner",
                      "provider": "snakeshard.stages.fbank.FbankProvider",
                      "provider_config": {"num_mel_bins": 20},
                      "datasets": list(SPLITS), "sample_rate": RATE, "sharding": {"num_shards": 2},
                      "fingerprint": {"records": ["wav.scp", "segments"]}},  # fbank reads no label
            "stats": {"runner": "snakeshard.stages.CollectStatsRunner",
                      "provider": "snakeshard.stages.CollectStatsProvider",
                      "provider_config": {"frontend": "upstream"}, "datasets": ["feats_train"],
                      "sharding": {"num_shards": 1}},
            "train": {"runner": "tones.TonesRunner", "provider": "tones.TonesProvider",
                      "provider_config": {"num_mel_bins": 20, "hidden": 32, "lr": 0.01, "step_delay": step_delay},
                      "fingerprint_ignore": ["step_delay", "no_rng_restore"],
                      "train": "feats_train", "valid": "feats_valid", "stats": {"from_stage": "stats",
                                                                             "dataset": "feats_train"},
                      "labels": ["text"], "epochs": epochs, "seed": 3, "batch_size": 8,
                      "score": {"name": "acc", "mode": "max"},
                      "checkpoint": {"interval": 2}, "retries": 0, **training},
            "infer": {"from_stage": "train", "datasets": ["feats_test"], "batch_size": 8,
                      "sharding": {"num_shards": 2}},
            "score": {"runner": "snakeshard.stages.ScoringRunner", "provider": "snakeshard.stages.ScoringProvider",
                      "provider_config": {"metrics": ["classification"], "hypothesis": "label", "reference": "text"},
                      "datasets": ["predicted"], "sharding": {"num_shards": 1}},
        },
    }
