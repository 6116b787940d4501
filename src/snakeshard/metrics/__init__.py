"""Meters and corpus metrics whose ``state()`` merges exactly across shards (see ``state.py``).

Additive (sums; exact for any sharding): ``AverageMeter``, ``AverageMeters``, ``MetricMeter`` (DanLing's
API), ``WordErrorRate``/``CharacterErrorRate``, ``ConfusionMatrix``, ``RegressionMetrics``.
All-data (computed once over every key's prediction): ``BinaryScores`` (AUROC, AUPRC, EER, minDCF).
"""

from snakeshard.metrics.classification import ConfusionMatrix
from snakeshard.metrics.meters import AverageMeter, AverageMeters, MetricMeter
from snakeshard.metrics.ranking import BinaryScores
from snakeshard.metrics.regression import RegressionMetrics
from snakeshard.metrics.state import Metric, MetricStateError
from snakeshard.metrics.text import CharacterErrorRate, ErrorRate, TextNormalization, WordErrorRate

__all__ = ["AverageMeter", "AverageMeters", "BinaryScores", "CharacterErrorRate", "ConfusionMatrix", "ErrorRate",
           "Metric", "MetricMeter", "MetricStateError", "RegressionMetrics", "TextNormalization", "WordErrorRate"]
