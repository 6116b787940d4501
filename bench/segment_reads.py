"""Reading every segment of one long recording, as a shard job's ``dataset.load_audio`` does: a plain file and a
``wav.scp`` pipe that resamples it (``sox -D in.wav -r 16000 -t wav - |``, Kaldi's usual form).

A Kaldi user's trial: 1,015 s cut into 338 segments of 3 s took 189 s through such a pipe in the fbank stage, against
4.4 s from the 16 kHz file. Run it with the snakeshard to measure first on ``PYTHONPATH`` (e.g. an older checkout's
``src``) to compare two versions in one session:

    python bench/segment_reads.py --seconds 1015 --segment 3
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np
import soundfile as sf


def make_dir(root: Path, seconds: float, segment: float, pipe: bool) -> Path:
    d = root / ("pipe" if pipe else "plain")
    d.mkdir()
    if pipe:
        (d / "wav.scp").write_text(f"rec sox -D {root / 'rec_22k.wav'} -r 16000 -t wav - |\n")
    else:
        (d / "wav.scp").write_text(f"rec {root / 'rec_16k.wav'}\n")
    count = int(seconds // segment)
    (d / "segments").write_text("".join(f"rec-{i:05d} rec {i * segment:.2f} {(i + 1) * segment:.2f}\n"
                                        for i in range(count)))
    return d


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=1015.0)
    parser.add_argument("--segment", type=float, default=3.0)
    args = parser.parse_args()
    if shutil.which("sox") is None:
        raise SystemExit("needs sox (apt-get install sox)")
    import snakeshard
    from snakeshard import load_dataset

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        noise = (np.random.default_rng(0).standard_normal(int(args.seconds * 22050)) * 0.1).astype(np.float32)
        sf.write(root / "rec_22k.wav", noise, 22050, subtype="PCM_16")
        subprocess.run(["sox", "-D", root / "rec_22k.wav", "-r", "16000", root / "rec_16k.wav"], check=True)
        print(f"snakeshard from {Path(snakeshard.__file__).parent}")
        for pipe in (False, True):
            dataset = load_dataset({"path": str(make_dir(root, args.seconds, args.segment, pipe)), "format": "kaldi"})
            start, read = time.perf_counter(), 0
            for key in dataset.keys:
                read += len(dataset.load_audio(key)[0])
            took = time.perf_counter() - start
            print(f"{'pipe' if pipe else 'file'}: {len(dataset.keys)} segments, {read / 16000:.1f} s of audio "
                  f"read in {took:.2f} s")


if __name__ == "__main__":
    main()
