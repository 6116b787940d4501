"""Built-in runners: users of the core like any other (they go through the same hooks a user overrides).

fbank.FbankRunner                 Kaldi fbank features (kaldi-native-fbank) -> feats.ark/scp, utt2num_frames
vad.SileroVadRunner               silero-vad on padded batches -> speech segments, frame probabilities, trimmed wav
collect_stats.CollectStatsRunner  ESPnet2's collect_stats: feats_stats.npz, <input>_shape, batch_keys, stats_keys
scoring.ScoringRunner             WER/CER, classification, regression, AUROC/EER...: metrics.json/.txt/.png
command.CommandRunner             a shell command (Kaldi's binaries) over each shard's Kaldi data dir -> its files
"""

from snakeshard.stages.collect_stats import CollectStatsProvider, CollectStatsRunner
from snakeshard.stages.command import CommandProvider, CommandRunner
from snakeshard.stages.global_mvn import GlobalMVN
from snakeshard.stages.scoring import ScoringProvider, ScoringRunner

__all__ = ["CollectStatsProvider", "CollectStatsRunner", "CommandProvider", "CommandRunner", "GlobalMVN",
           "ScoringProvider", "ScoringRunner"]
