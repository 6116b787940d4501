"""The digits recipe's model: a small 1-D conv classifier over GlobalMVN-normalized 40-bin fbank.

Three convolutions over time, then the mean and the max over each utterance's own frames (padding is masked
out), then a linear layer to the 10 digits. The stage gives every step ``dataset`` (its split's fbank and
labels) and ``normalize`` (the collect-stats stage's GlobalMVN over the train set).
"""

import numpy as np
import torch
from torch import nn

from snakeshard.train import TorchRunner, TrainProvider

DIGITS = 10


class ConvClassifier(nn.Module):
    def __init__(self, bins: int, channels: int, dropout: float):
        super().__init__()
        self.convs = nn.Sequential(
            nn.Conv1d(bins, channels, 5, padding=2), nn.ReLU(),
            nn.Conv1d(channels, channels, 5, padding=4, dilation=2), nn.ReLU(),
            nn.Conv1d(channels, 2 * channels, 3, padding=2, dilation=2), nn.ReLU())
        self.dropout = nn.Dropout(dropout)
        self.out = nn.Linear(4 * channels, DIGITS)

    def forward(self, feats, lengths):
        h = self.convs(feats.transpose(1, 2))                      # (batch, channels, frames)
        mask = (torch.arange(h.shape[2], device=h.device)[None, :] < lengths[:, None]).unsqueeze(1)
        mean = (h * mask).sum(2) / lengths[:, None]
        peak = h.masked_fill(~mask, float("-inf")).amax(2)
        return self.out(self.dropout(torch.cat([mean, peak], 1)))


class DigitsProvider(TrainProvider):
    """Built once per job: the model and its optimizer (config: bins, channels, dropout, lr, threads)."""

    def build_env(self):
        c = self.config
        torch.set_num_threads(int(c.get("threads", 1)))  # fixed, so results do not depend on the machine's cores
        torch.manual_seed(int(c.get("init_seed", 0)))     # the initial weights
        model = ConvClassifier(int(c.get("bins", 40)), int(c.get("channels", 64)), float(c.get("dropout", 0.2)))
        model.to(c["devices"][0])  # "cpu", or "cuda:0" with resources: {gpu: 1}
        optimizer = torch.optim.AdamW(model.parameters(), lr=float(c.get("lr", 0.002)),
                                      weight_decay=float(c.get("weight_decay", 0.01)))
        return {"model": model, "optimizer": optimizer}


def padded(batch, dataset, normalize, model):
    """(feats: batch x frames x bins, lengths) of the batch's keys, zero-padded to the longest, on the model's
    device."""
    feats = [torch.from_numpy(np.ascontiguousarray(normalize(dataset.load_array(k, "feats")), dtype=np.float32))
             for k in batch]
    lengths = torch.tensor([len(f) for f in feats])
    device = device_of(model)
    return nn.utils.rnn.pad_sequence(feats, batch_first=True).to(device), lengths.to(device)


def labels(batch, dataset, model):
    return torch.tensor([int(dataset[k]["text"]) for k in batch], device=device_of(model))


def device_of(model):
    return next(model.parameters()).device


class DigitsRunner(TorchRunner):
    @staticmethod
    def train_step(batch, *, model, dataset, normalize):
        feats, lengths = padded(batch, dataset, normalize, model)
        y = labels(batch, dataset, model)
        logits = model(feats, lengths)
        return {"loss": nn.functional.cross_entropy(logits, y), "acc": (logits.argmax(1) == y).float().mean()}

    @staticmethod
    def evaluate_step(batch, *, model, dataset, normalize):
        feats, lengths = padded(batch, dataset, normalize, model)
        y = labels(batch, dataset, model)
        logits = model(feats, lengths)
        return {"loss": nn.functional.cross_entropy(logits, y), "acc": (logits.argmax(1) == y).float().mean()}

    @staticmethod
    def infer_step(batch, *, model, dataset, normalize):
        """The inference stage's forward: one predicted digit per key."""
        feats, lengths = padded(batch, dataset, normalize, model)
        predicted = model(feats, lengths).argmax(1).tolist()
        return {k: {"label": str(p)} for k, p in zip(batch, predicted)}
