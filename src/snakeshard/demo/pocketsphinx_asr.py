"""Tiny offline PocketSphinx (5.x) recogniser used by the demo shard jobs.

Only the US-English model bundled inside the ``pocketsphinx`` wheel is used,
so decoding needs no network and no downloads. Its files are not in the stage's
fingerprint (only files named in provider_config are): a pocketsphinx upgrade
that changes them reruns nothing unless a provider_config value is bumped.
"""

from __future__ import annotations

import numpy as np
import pocketsphinx

#: Defaults for every decoder: quiet (PocketSphinx logs every utterance at
#: INFO to stderr, which would swamp job logs) and 16 kHz, like data/demo.
DEFAULT_OPTIONS = {"loglevel": "FATAL", "samprate": 16000}

def _config(**options) -> pocketsphinx.Config:
    # Config() fills in hmm/lm/dict from pocketsphinx.get_model_path(), i.e.
    # the en-us model shipped in the wheel; options may override anything.
    return pocketsphinx.Config(**{**DEFAULT_OPTIONS, **options})


def make_decoder(**options) -> pocketsphinx.Decoder:
    """Return a Decoder on the bundled en-us model (acoustic model, LM, CMUdict).

    ``options`` are PocketSphinx config parameters (e.g. ``beam=1e-60``) and
    override :data:`DEFAULT_OPTIONS`. Loading takes about a second, so create
    one decoder per job and reuse it for every utterance.
    """
    return pocketsphinx.Decoder(_config(**options))


def decode(decoder: pocketsphinx.Decoder, samples: np.ndarray) -> str:
    """Recognise one whole utterance of 16-bit mono audio; return lowercase text.

    Each utterance is decoded as a fresh decoder would decode it: the decoder's
    live cepstral mean normalisation carries an estimate from one utterance into
    the next (``full_utt=True`` alone does not reset it), so the text of a key
    would depend on which keys the same job decoded before it, i.e. on the shard
    layout. ``reinit_feat()`` resets the feature pipeline (about 0.2 ms).
    Returns "" when nothing is recognised.
    """
    samples = np.asarray(samples)
    if samples.dtype != np.int16 or samples.ndim != 1:
        # float or stereo buffers would be silently misread as garbage PCM
        raise TypeError(f"need 1-D int16 samples, got {samples.dtype} {samples.shape}")
    if samples.size == 0:
        return ""  # process_raw raises IndexError on an empty buffer
    decoder.reinit_feat()
    decoder.start_utt()
    decoder.process_raw(np.ascontiguousarray(samples, dtype="<i2").tobytes(),
                        no_search=False, full_utt=True)
    decoder.end_utt()
    hyp = decoder.hyp()
    return " ".join(hyp.hypstr.lower().split()) if hyp is not None else ""
