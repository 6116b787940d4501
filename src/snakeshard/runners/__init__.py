"""Built-in runners: users of the core like any other (they go through the same hooks a user overrides).

fbank.FbankRunner        Kaldi fbank features (kaldi-native-fbank) -> feats.ark/scp, utt2num_frames
vad.SileroVadRunner      silero-vad on padded batches -> speech segments, frame probabilities, trimmed wav
"""
