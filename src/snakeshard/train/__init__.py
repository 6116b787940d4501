"""Resumable training (issue 26's foundation): a ``TorchRunner`` with DanLing-style step methods, a loop that
checkpoints atomically and resumes to exactly the result an uninterrupted run gives.

``train(runner_cls, env, train_keys, valid_keys, config, run_dir)`` is the entry point (``loop.py``);
``TrainingInterrupted.exit_code`` (75) is what a caller exits with after SIGTERM/SIGUSR1/SIGINT.
"""

from snakeshard.train.checkpoint import CheckpointManager, CheckpointWarning
from snakeshard.train.loop import (NonFiniteLoss, ResumeRefused, TrainingInterrupted, TrainResult, train)
from snakeshard.train.runner import TorchRunner, TrainProvider
from snakeshard.train.schedule import lr_lambda, make_scheduler

__all__ = ["CheckpointManager", "CheckpointWarning", "NonFiniteLoss", "ResumeRefused", "TorchRunner",
           "TrainProvider", "TrainResult", "TrainingInterrupted", "lr_lambda", "make_scheduler", "train"]
