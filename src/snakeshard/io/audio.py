"""Reading one item's audio with every check a silent wrong result would need.

libsndfile quietly returns what a file holds: a WAV cut short by a failed copy
reads as a shorter recording, an empty file as zero samples, a segment past the
end of its recording as a shorter segment. Each of those is an error here that
names the key, the file and the line that declared it.
"""

from __future__ import annotations

import io
import os
import struct
import subprocess
from collections import OrderedDict

from snakeshard.errors import AudioError, DataError

PIPE_STDERR_LINES = 5


def wav_shortfall(f, size: int) -> tuple[float, float] | None:
    """(declared, present) seconds if the RIFF WAV in ``f`` (``size`` bytes) ends before its data chunk does.

    None for a complete file, a non-WAV stream, or a streamed WAV whose header leaves the length
    open (size 0 or 0xFFFFFFFF, as ``sox ... -t wav -`` writes it).
    """
    head = f.read(12)
    if len(head) < 12 or head[:4] != b"RIFF" or head[8:12] != b"WAVE":
        return None
    offset, byte_rate = 12, None
    while offset + 8 <= size:
        f.seek(offset)
        chunk_id, chunk_size = struct.unpack("<4sI", f.read(8))
        if chunk_id == b"fmt ":
            fmt = f.read(16)
            if len(fmt) == 16:
                byte_rate = struct.unpack("<HHIIH", fmt[:14])[3]
        elif chunk_id == b"data":
            if chunk_size in (0, 0xFFFFFFFF) or not byte_rate:
                return None
            present = size - (offset + 8)
            if present < chunk_size:
                return chunk_size / byte_rate, max(present, 0) / byte_rate
            return None
        offset += 8 + chunk_size + (chunk_size & 1)  # chunks are padded to even sizes
    return None


def _check_complete(source, size: int, where: str, name: str, key: str | None) -> None:
    short = wav_shortfall(source, size)
    if short is not None:
        raise AudioError(f"{where}: {name} is truncated: its header says {short[0]:.3f} s, the file holds "
                         f"{short[1]:.3f} s (an interrupted copy or write?)", key)


def _check_file_complete(path: str, where: str, key: str | None) -> None:
    try:
        with open(path, "rb") as f:
            _check_complete(f, os.fstat(f.fileno()).st_size, where, path, key)
    except OSError as e:
        raise AudioError(f"{where}: cannot read audio {path}: {e.strerror}", key) from None


def audio_header(path: str, where: str, key: str | None = None):
    """soundfile's info of the audio file ``path`` (rate, channels, frames), after the truncation check."""
    import soundfile

    _check_file_complete(path, where, key)
    try:
        return soundfile.info(path)
    except Exception as e:  # soundfile raises several types for unreadable headers
        raise AudioError(f"{where}: cannot read audio header of {path}: {e}", key) from None


def audio_duration(path: str, where: str) -> float:
    """Seconds of audio in ``path`` from its header (soundfile), after the truncation check."""
    info = audio_header(path, where)
    if info.frames == 0:
        raise AudioError(f"{where}: {path} holds no samples (0 frames)")
    return info.duration


def _run_pipe(command: str, where: str) -> bytes:
    """stdout of a Kaldi ``wav.scp`` pipe; a failure names the command and ends with its own stderr."""
    done = subprocess.run(command, shell=True, capture_output=True)
    if done.returncode != 0:
        tail = done.stderr.decode("utf-8", "replace").strip().splitlines()[-PIPE_STDERR_LINES:]
        said = "; its stderr: " + " | ".join(tail) if tail else " (nothing on its stderr)"
        raise DataError(f"{where}: audio pipe {command!r} exited with status {done.returncode}{said}")
    if not done.stdout:
        raise DataError(f"{where}: audio pipe {command!r} wrote no bytes")
    return done.stdout


# Seconds a segment may end past its recording, cut off there: Kaldi's extract-segments --max-overshoot default, so
# that a Kaldi data dir whose segment times were rounded reads as Kaldi reads it (a user trial met 1-5 ms overshoots).
KALDI_MAX_OVERSHOOT = 0.5


# Decoded outputs of the wav.scp pipes a process read last, up to this many bytes (always the last one): a Kaldi dir
# with segments names one recording's pipe on many lines, and Kaldi reads it once for them all. Running it per
# segment cost a trial 189 s against 4.4 s for the same 1,015 s recording as a plain file (338 segments). Several
# recordings, not one: batches sorted by length interleave the segments of different recordings.
PIPE_CACHE_BYTES = 256 << 20
_pipe_cache: OrderedDict[tuple[str, str], tuple] = OrderedDict()


def _pipe_audio(command: str, dtype: str, where: str, key: str, keep: bool):
    """(samples, rate) of a pipe's whole output, checked complete; with ``keep`` (a segment, whose recording's
    other segments may follow), run once while it stays in the cache."""
    import soundfile

    cached = _pipe_cache.get((command, dtype))
    if cached is not None:
        _pipe_cache.move_to_end((command, dtype))
        return cached
    name = f"the output of {command!r}"
    try:
        data = _run_pipe(command, where)
    except DataError as e:
        raise AudioError(str(e), key) from None
    source = io.BytesIO(data)
    _check_complete(source, len(data), where, name, key)
    source.seek(0)
    try:
        decoded = soundfile.read(source, dtype=dtype)
    except Exception as e:
        raise AudioError(f"{where}: cannot read audio {name}: {e}", key) from None
    if not keep:
        return decoded
    _pipe_cache[(command, dtype)] = decoded
    while len(_pipe_cache) > 1 and sum(s.nbytes for s, _ in _pipe_cache.values()) > PIPE_CACHE_BYTES:
        _pipe_cache.popitem(last=False)
    return decoded


def _segment(item, rate: int) -> tuple[int, int | None] | None:
    """The item's first and end sample at ``rate`` (as Kaldi's extract-segments cuts), or None: the whole file."""
    if "start" not in item.fields:
        return None
    end = item.fields["end"]
    return int(item.fields["start"] * rate), (None if end == -1 else int(end * rate))  # -1 (data.OPEN_END): to its end


def read_item_audio(item, *, dtype: str = "float32", sample_rate: int | None = None,
                    max_overshoot: float = KALDI_MAX_OVERSHOOT, dataset: str | None = None):
    """(samples, rate) of a dataset item (``snakeshard.core.data.Item``): a file or a pipe, cut to its segment.
    A file's segment is read alone (libsndfile seeks to its first sample); a pipe runs once for the segments of
    its recording (``PIPE_CACHE_BYTES``). ``dataset``: the name of the item's dataset in the config (the one its
    ``max_segment_overshoot`` is set in)."""
    import soundfile

    where = f"key {item.key!r} ({item.source})"
    if item.audio.endswith("|"):  # a Kaldi pipe (data.is_pipe): the command's stdout is the audio
        command = item.audio[:-1].strip()
        segment = "start" in item.fields
        samples, rate = _pipe_audio(command, dtype, where, item.key, keep=segment)
        _check_usable(item, where, f"the output of {command!r}", rate, len(samples), sample_rate, max_overshoot,
                      dataset)
        if not segment:  # a whole recording, read once: neither kept nor copied
            return samples, rate
        start, end = _segment(item, rate)
        # a copy: the caller may write into what it gets, and the cache serves the recording's other segments
        return samples[start:end].copy(), rate
    _check_file_complete(item.audio, where, item.key)
    try:
        with soundfile.SoundFile(item.audio) as f:
            rate = f.samplerate
            _check_usable(item, where, item.audio, rate, f.frames, sample_rate, max_overshoot, dataset)
            cut = _segment(item, rate)
            if cut:
                f.seek(cut[0])
            samples = f.read(frames=cut[1] - cut[0] if cut and cut[1] is not None else -1, dtype=dtype)
    except AudioError:
        raise
    except Exception as e:
        raise AudioError(f"{where}: cannot read audio {item.audio}: {e}", item.key) from None
    return samples, rate


def check_item_audio_header(item, *, sample_rate: int | None = None, max_overshoot: float = KALDI_MAX_OVERSHOOT,
                            dataset: str | None = None) -> bool:
    """Raise the AudioError ``read_item_audio`` would, from the file's header alone (no samples decoded); a pipe
    is not run: False for one (not checked), True for a file that passed."""
    if item.audio.endswith("|"):
        return False
    where = f"key {item.key!r} ({item.source})"
    info = audio_header(item.audio, where, item.key)
    _check_usable(item, where, item.audio, info.samplerate, info.frames, sample_rate, max_overshoot, dataset)
    return True


def _check_usable(item, where: str, name: str, rate: int, frames: int, sample_rate: int | None,
                  max_overshoot: float, dataset: str | None) -> None:
    """The checks on a recording's rate and length (decoded or from its header), and on the item's segment."""
    if sample_rate and rate != sample_rate:
        raise AudioError(f"{where}: {name} is {rate} Hz, the stage expects {sample_rate} Hz "
                         f"(stages.<stage>.sample_rate); resample the data (e.g. sox -D in.wav -r {sample_rate} "
                         "out.wav) or change the stage", item.key)
    if frames == 0:
        raise AudioError(f"{where}: {name} holds no samples (0 frames)", item.key)
    if "start" in item.fields:
        start, end = item.fields["start"], item.fields["end"]
        length = frames / rate
        if end == -1:  # to the end of the recording
            end = length
        if end > length + max_overshoot:
            allowed = f" by more than max_segment_overshoot={max_overshoot} s" if max_overshoot else ""
            setting = f"datasets.{dataset}.max_segment_overshoot" if dataset else "max_segment_overshoot in the dataset spec"
            raise AudioError(f"{where}: segment {start}-{end} s ends past the end of {name} ({length:.3f} s){allowed}; "
                             f"fix the segment or set {setting}", item.key)
        if min(int(end * rate), frames) <= int(start * rate):  # what the cut samples[start:end] would hold
            raise AudioError(f"{where}: segment {start}-{end} s of {name} holds no samples at {rate} Hz", item.key)
