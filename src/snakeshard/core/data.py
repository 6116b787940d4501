"""Reading datasets: Kaldi data dirs and JSON Lines manifests.

Planning needs only keys, durations and what each key stands for (its records),
so ``read_items`` is cheap and stdlib-only. ``load_dataset`` gives providers a
key -> item mapping with audio loading (``snakeshard.io.audio``, soundfile imported lazily).

A dataset spec is a dict: ``{"path": "data/demo", "format": "kaldi"}`` or
``{"path": "x.jsonl", "format": "jsonl", "key_field": "id", "audio_field": "audio",
"duration_field": "duration"}``. Relative paths are relative to the working
directory (the workflow directory), as in Kaldi and ESPnet recipes. The shard
job's spec adds ``sample_rate`` (the stage's) and ``max_segment_overshoot``.

A chained dataset is another stage's merged output (``format: stage``, made by
workflow.parse.run_spec from ``{from_stage: fbank, dataset: demo}``): its keys, durations
and audio are those of the upstream stage's dataset (``source``), and
``load_dataset`` gives providers the upstream's fields as well (``load_array``,
``load_audio(key, field)``, ``load_field``), after checking the merged output is
current (``upstream_inputs``; a stale or missing one is refused).
"""

from __future__ import annotations

import json
import math
import os

from snakeshard.errors import MAX_LISTED, AudioError, DataError

# pathlib where the planner uses it: a shard job's slice reader does without (5 ms of a one-key job's 29 ms CPU,
# bench/RESULTS.md section 16). Type checkers read a module-level TYPE_CHECKING = False as typing's.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from pathlib import Path

# The per-key Kaldi files a stage's forward can see through the dataset (text and utt2spk as fields).
KALDI_RECORD_FILES = ("wav.scp", "segments", "text", "utt2spk", "feats.scp")
FEATS_SCP, FEATS = "feats.scp", "feats"  # Kaldi's features of a data dir, and the field they are read as
KALDI_FRAME_SHIFT = 0.01  # seconds: a data dir's frame_shift when it has none (Kaldi's utils/data/get_frame_shift.sh)
JSONL_RECORD = "jsonl"
_NEW_DICT = object()  # Item's default for records: a new dict (None is a value: "not read")


class Item:
    """One dataset entry: its key, where it was declared, and what planning may need.

    A plain class with slots, not a dataclass: importing dataclasses (and with it inspect) costs a
    shard job ~12 ms before its first item, and a job holds one Item per key of its slice.
    """

    __slots__ = ("key", "source", "audio", "seconds", "fields", "records")

    def __init__(self, key: str, source: str, audio: str | None = None, seconds: float | None = None,
                 fields: dict | None = None, records: dict | None = _NEW_DICT):
        self.key = key
        self.source = source  # "file:line" where the key was declared
        self.audio = audio  # a path, or a Kaldi pipe command ending in "|"
        self.seconds = seconds
        self.fields = {} if fields is None else fields  # text, spk, start, end, or jsonl fields
        # What the key stands for, per source file, as written there: the wav.scp value, the segments
        # line, the text and utt2spk values; for JSON Lines, the record. Shard fingerprints cover these.
        # None when read for a job (load_dataset), which never digests them.
        self.records = {} if records is _NEW_DICT else records

    def _values(self) -> tuple:
        return tuple(getattr(self, name) for name in self.__slots__)

    def __eq__(self, other):
        return self._values() == other._values() if type(other) is Item else NotImplemented

    __hash__ = None  # mutable, compared by value

    def __repr__(self) -> str:
        return "Item(" + ", ".join(f"{name}={value!r}" for name, value in zip(self.__slots__, self._values())) + ")"


def read_text_lines(path: Path) -> list[str]:
    """The lines of a UTF-8 text file, without newlines; a byte that is not UTF-8 names file and line."""
    with open(path, "rb") as f:
        raw = f.read()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise utf8_error(path, raw, e) from None
    lines = text.split("\n")
    if lines[-1] == "":
        lines.pop()
    return lines


def utf8_error(path, raw: bytes, e: UnicodeDecodeError, first_line: int = 1) -> DataError:
    """The error for ``raw`` (the bytes of ``path`` from line ``first_line`` on) failing to decode as UTF-8."""
    line_no = first_line + raw.count(b"\n", 0, e.start)
    column = e.start - (raw.rfind(b"\n", 0, e.start) + 1) + 1
    return DataError(f"{path}:{line_no}: not UTF-8 (byte {raw[e.start:e.start + 1]!r} at column {column}); "
                     "convert the file, e.g. iconv -f latin1 -t utf-8")


def _stream_lines(path: Path):
    """The lines of a UTF-8 text file (one this package wrote), one at a time, without newlines."""
    with open(path, encoding="utf-8", newline="\n") as f:  # split on "\n" only, as read_text_lines does
        for line in f:
            yield line[:-1] if line.endswith("\n") else line


def read_kaldi_table(path: Path):
    """``key value`` lines -> (key, value, line_no), one at a time; blank lines are an error, not skipped."""
    for line_no, line in enumerate(read_text_lines(path), 1):
        if line_no == 1 and line.startswith("\ufeff"):
            raise DataError(f"{path}:1: starts with a UTF-8 byte-order mark (U+FEFF), which would be part of its "
                            "first key: save the file without it")
        if not line.strip():
            raise DataError(f"{path}:{line_no}: empty line (Kaldi tables have one 'key value' per line)")
        if line[0].isspace():
            raise DataError(f"{path}:{line_no}: line starts with whitespace, so its key is empty: {line!r}")
        key, _, value = line.partition(" ")
        if "\t" in key:  # tab-separated line
            key, _, rest = key.partition("\t")
            value = rest + (" " + value if value else "")
        yield key, value.strip(), line_no


def is_pipe(value: str) -> bool:
    return value.endswith("|")


def _seconds(value, where: str, what: str) -> float:
    """A duration or time in seconds: a finite number, else an error naming ``where``."""
    try:
        if isinstance(value, bool):  # JSON's true would read as 1 s
            raise TypeError
        seconds = float(value)
    except (TypeError, ValueError):
        raise DataError(f"{where}: {what} {value!r} is not a number of seconds") from None
    if not math.isfinite(seconds):
        raise DataError(f"{where}: {what} {value!r} is not a finite number of seconds")
    return seconds


def duration_seconds(value, where: str, what: str) -> float:
    seconds = _seconds(value, where, what)
    if seconds <= 0:
        raise DataError(f"{where}: {what} is {value!r}; a duration must be > 0 (an empty recording cannot be processed)")
    return seconds


def unique_kaldi_table(path: Path):
    """``read_kaldi_table`` with each key once: a key on a second line is refused, naming both lines, as Kaldi's
    validate_data_dir.sh refuses it (a trial's wav.scp, text and utt2spk each took a repeated key's last line
    silently: another recording cut, another speaker, another WER)."""
    first_at: dict[str, int] = {}
    dupes = []
    for key, value, line_no in read_kaldi_table(path):
        if key in first_at:
            dupes.append(f"{key!r} ({path}:{line_no}, first at {path}:{first_at[key]})")
            continue
        first_at[key] = line_no
        yield key, value, line_no
    if dupes:
        raise duplicate_keys_error(dupes)


OPEN_END = -1  # a segments line's end time meaning "the end of the recording", as Kaldi's extract-segments reads it


def _durations(path: Path) -> dict[str, float]:
    """An utt2dur or reco2dur table (empty when the file is absent)."""
    if not path.is_file():
        return {}
    return {k: duration_seconds(v, f"{path}:{n}", f"duration of {k!r}") for k, v, n in unique_kaldi_table(path)}


def _read_kaldi_dir(path: Path, with_records: bool = True, notes: list | None = None) -> list[Item]:
    wav_scp = path / "wav.scp"
    if not wav_scp.is_file():
        if (path / FEATS_SCP).is_file():
            return _read_features_dir(path, with_records, notes)
        hint = "; a JSON Lines manifest needs format: jsonl in its datasets entry" if path.is_file() else ""
        raise DataError(f"{path}: not a Kaldi data dir (no wav.scp, no feats.scp){hint}")
    wavs = {}
    items = []
    for key, value, line_no in unique_kaldi_table(wav_scp):
        if not value:
            raise DataError(f"{wav_scp}:{line_no}: key {key!r} has no audio path")
        if not is_pipe(value) and len(value.split()) > 1:
            # Kaldi paths cannot hold whitespace, so extra fields mean the key had some.
            raise DataError(
                f"{wav_scp}:{line_no}: {key + ' ' + value!r} has more than two fields; "
                "keys and paths must be free of whitespace"
            )
        wavs[key] = (value, line_no)
        items.append(Item(key, f"{wav_scp}:{line_no}", audio=value, records={"wav.scp": value} if with_records else None))

    segments = path / "segments"
    if segments.is_file():
        # With segments, the items are utterances cut from the recordings in wav.scp.
        items = []
        reco2dur = None  # read at the first segment that ends with its recording (end -1)
        for key, value, line_no in read_kaldi_table(segments):
            parts = value.split()
            where = f"{segments}:{line_no}"
            if len(parts) == 4:
                raise DataError(f"{where}: {key + ' ' + value!r} has a 5th column (a channel), which snakeshard does "
                                "not read: give each channel its own wav.scp entry (e.g. 'rec-A sox rec.wav -t wav - "
                                "remix 1 |') and name it here")
            if len(parts) != 3:
                raise DataError(f"{where}: expected 'utt rec start end', got {key + ' ' + value!r}")
            rec = parts[0]
            start = _seconds(parts[1], where, f"start of {key!r}")
            end = _seconds(parts[2], where, f"end of {key!r}")
            if start < 0:
                raise DataError(f"{where}: segment {key!r} starts at {parts[1]} s, before its recording")
            if end == OPEN_END:  # Kaldi's extract-segments: -1 is the end of the recording
                reco2dur = _durations(path / "reco2dur") if reco2dur is None else reco2dur
                seconds = reco2dur[rec] - start if rec in reco2dur else None  # else from the header, when needed
            elif end <= start:
                raise DataError(f"{where}: segment {key!r} ends at {parts[2]} s, not after its start {parts[1]} s "
                                "(-1: the end of its recording)")
            else:
                seconds = end - start
            if rec not in wavs:
                raise DataError(f"{where}: utterance {key!r} names recording {rec!r}, which is not in {wav_scp}")
            items.append(Item(key, where, audio=wavs[rec][0], seconds=seconds,
                              fields={"rec": rec, "start": start, "end": end},
                              records={"wav.scp": wavs[rec][0], "segments": value} if with_records else None))

    if not segments.is_file():  # without segments a recording is an utterance: reco2dur is utt2dur (Kaldi's own)
        durations = _durations(path / "utt2dur") or _durations(path / "reco2dur")
        for item in items:
            item.seconds = durations.get(item.key)

    _read_fields(path, items, with_records, notes,
                 "utterance in segments" if segments.is_file() else "recording in wav.scp")
    if notes is not None:
        notes.extend(unsorted_note(items, segments if segments.is_file() else wav_scp))
    return items


def _read_features_dir(path: Path, with_records: bool, notes: list | None) -> list[Item]:
    """A Kaldi data dir of features without audio (``feats.scp``, no ``wav.scp``): its keys are feats.scp's, read by
    ``load_array(key, "feats")``; their durations come from utt2dur, else utt2num_frames times the dir's
    frame_shift (a Kaldi user's trial: such a dir was refused)."""
    feats_scp = path / FEATS_SCP
    items, entries, feature_files = [], [], {}
    for key, value, line_no in unique_kaldi_table(feats_scp):  # read once: its lines are the keys and their feats
        items.append(Item(key, f"{feats_scp}:{line_no}"))
        entries.append(value)
    durations = _durations(path / "utt2dur")
    if not durations and (path / "utt2num_frames").is_file():
        shift = KALDI_FRAME_SHIFT
        if (path / "frame_shift").is_file():
            shift = duration_seconds(read_text_lines(path / "frame_shift")[0].strip(), f"{path / 'frame_shift'}:1",
                                     "the frame shift")
        durations = {key: duration_seconds(value, f"{path / 'utt2num_frames'}:{n}", f"frames of {key!r}") * shift
                     for key, value, n in unique_kaldi_table(path / "utt2num_frames")}
    for item in items:
        item.seconds = durations.get(item.key)
    _read_fields(path, items, with_records, notes, "key in feats.scp", FIELD_TABLES[:-1])
    for item, value in zip(items, entries):  # after text and utt2spk, in the order a dir with a wav.scp has them
        item.fields[FEATS] = value
        if with_records:
            item.records[FEATS_SCP] = _feature_record(item.key, value, item.source, feature_files)
    if notes is not None:
        notes.extend(unsorted_note(items, feats_scp))
    return items


def has_kaldi_features(spec: dict) -> bool:
    """Whether a dataset spec is a Kaldi data dir with a ``feats.scp`` (its keys' ``feats`` are Kaldi's features),
    with or without a wav.scp."""
    return spec.get("format", "kaldi") == "kaldi" and os.path.isfile(os.path.join(spec.get("path", ""), FEATS_SCP))


def _feature_file(rxfilename: str) -> str | None:
    """The file a feats.scp entry reads (``raw_fbank.1.ark:1234``, ``x.ark:17[0:9]``, ``x.mat``), or None for a
    pipe, which has none."""
    if is_pipe(rxfilename):
        return None
    path, colon, offset = rxfilename.rpartition(":")
    return path if colon and offset.split("[", 1)[0].isdigit() else rxfilename.split("[", 1)[0]


def _feature_record(key: str, rxfilename: str, where: str, stats: dict) -> str:
    """What a key's features stand for in its shard's fingerprint: feats.scp's entry and its file's size and mtime
    (Kaldi rewrites an ark in place with the same offsets when a feature config changes). A missing file is named
    here, at the plan, as a missing audio file is."""
    file = _feature_file(rxfilename)
    if file is None:
        return rxfilename
    if file not in stats:
        try:
            st = os.stat(file)
        except FileNotFoundError:
            relative = "" if os.path.isabs(file) else f" (relative to the working directory {os.getcwd()})"
            raise DataError(f"{where}: key {key!r}: its feature file {file} does not exist{relative}") from None
        stats[file] = f"{st.st_size} {st.st_mtime_ns}"
    return f"{rxfilename} {stats[file]}"


# The per-key tables beside a Kaldi dir's keys, and the field each gives: feats.scp's is the rxfilename that
# load_array(key, "feats") reads.
FIELD_TABLES = (("text", "text"), ("utt2spk", "spk"), (FEATS_SCP, FEATS))


def _read_fields(path: Path, items: list[Item], with_records: bool, notes: list | None, holder: str,
                 tables=FIELD_TABLES) -> None:
    """Each of ``tables`` beside the keys' file, each key once, as the items' fields; ``spk2utt`` checked against
    utt2spk."""
    by_key = {item.key: item for item in items}
    check_spk2utt = notes is not None and (path / "spk2utt").is_file()
    speakers: dict[str, tuple[str, int]] = {}  # utt2spk as read, for the spk2utt check: utt -> (speaker, line)
    feature_files: dict[str, str] = {}  # a feature file's size and mtime, stat'ed once for all its keys
    for name, attr in tables:
        if (path / name).is_file():
            strays, stray_count = [], 0  # the first few named, all counted
            for key, value, line_no in unique_kaldi_table(path / name):
                if check_spk2utt and name == "utt2spk":
                    speakers[key] = (value, line_no)
                item = by_key.get(key)
                if item is not None:
                    item.fields[attr] = value
                    if with_records:
                        item.records[name] = (value if attr != FEATS else
                                              _feature_record(key, value, f"{path / name}:{line_no}", feature_files))
                else:
                    stray_count += 1
                    if len(strays) < MAX_LISTED:
                        strays.append(f"{key!r} (line {line_no})")
            if notes is not None:
                notes.extend(kaldi_file_notes(path, name, attr, strays, stray_count, items, holder))
    if check_spk2utt:
        notes.extend(spk2utt_note(path, speakers if (path / "utt2spk").is_file() else None))


def spk2utt_note(path: Path, speakers: dict[str, tuple[str, int]] | None) -> list[str]:
    """A note when ``spk2utt`` is not what ``utt2spk`` says (``speakers``: its lines as read, utt -> (speaker,
    line); speakers come from utt2spk, and Kaldi's validate_data_dir.sh refuses the two disagreeing), or when there
    is no utt2spk (None) to read instead."""
    spk2utt = path / "spk2utt"
    if speakers is None:
        return [f"{spk2utt}: not read: speakers come from utt2spk, which this dir lacks (Kaldi's "
                "utils/spk2utt_to_utt2spk.pl makes it)"]
    said = {utt: spk for spk, utts, _ in read_kaldi_table(spk2utt) for utt in utts.split()}
    for utt, (spk, line_no) in speakers.items():
        if said.pop(utt, None) != spk:
            return [f"{spk2utt}: does not agree with utt2spk ({path / 'utt2spk'}:{line_no}: {utt!r} is speaker "
                    f"{spk!r}); speakers come from utt2spk (Kaldi's utils/utt2spk_to_spk2utt.pl remakes spk2utt)"]
    if said:
        utt = next(iter(said))
        return [f"{spk2utt}: lists {utt!r} (speaker {said[utt]!r}), which utt2spk does not; speakers come from "
                "utt2spk (Kaldi's utils/utt2spk_to_spk2utt.pl remakes spk2utt)"]
    return []


def unsorted_note(items: list[Item], key_file: Path) -> list[str]:
    """A note when the keys are not in ``LC_ALL=C sort`` order (code point order is UTF-8's byte order): Kaldi's tools
    refuse such a dir, and the merged files keep the order of the keys (a Kaldi user's trial)."""
    for before, item in zip(items, items[1:]):
        if item.key < before.key:
            return [f"{key_file}: keys are not sorted ({item.source}: {item.key!r} after {before.key!r}); shards and "
                    "merged files keep this order, and Kaldi's tools want it sorted (LC_ALL=C sort, or "
                    "utils/fix_data_dir.sh)"]
    return []


def kaldi_file_notes(path: Path, name: str, attr: str, strays: list[str], stray_count: int, items: list[Item],
                     holder: str) -> list:
    """What Kaldi's validate_data_dir.sh would refuse in ``path/name`` (text or utt2spk) and snakeshard lets
    pass, said as notes: its keys that no item has (a wav.scp filtered and its text kept is common, and such
    lines are only ignored), and items it has no line for (their field is unset; a stage that reads it fails on
    them, naming the key). ``strays``: the first of the ``stray_count`` keys with no item, described; ``holder``:
    what an item is ("recording in wav.scp")."""
    notes = []
    if stray_count:
        notes.append(f"{path / name}: {stray_count} key(s) with no {holder}, ignored: "
                     + listing(stray_count, strays) + " (Kaldi's utils/fix_data_dir.sh drops them)")
    unset = [item for item in items if attr not in item.fields]
    if unset:
        notes.append(f"{path / name}: no line for {len(unset)} of {len(items)} key(s), their {attr!r} field unset: "
                     + listing(len(unset), [repr(i.key) for i in unset[:MAX_LISTED]]))
    return notes


def _read_jsonl(path: Path, spec: dict) -> list[Item]:
    key_field = spec.get("key_field", "key")
    audio_field = spec.get("audio_field", "audio")
    duration_field = spec.get("duration_field", "duration")
    items = []
    prefix = f"{path}:"  # formatted once: this loop runs once per record of manifests of millions
    numbered = [(n, text) for n, line in enumerate(read_text_lines(path), 1) if (text := line.strip())]
    parsed = _parse_all([line for _, line in numbered])
    for i, (line_no, line) in enumerate(numbered):
        where = prefix + str(line_no)
        record = parsed[i] if parsed is not None else jsonl_record(line, where)
        key, audio, seconds = jsonl_values(record, where, key_field, audio_field, duration_field)
        # records: the record as written; reformatting the manifest reruns its shards, a cheap price
        # for not re-serialising 100,000 records at every plan
        items.append(Item(key, where, audio, seconds, record, {JSONL_RECORD: line}))
    return items


def jsonl_record(line: str, where: str):
    """One JSON Lines record (a line that is not exactly one JSON value is an error naming ``where``)."""
    try:
        return json.loads(line)
    except json.JSONDecodeError as e:
        if line.startswith("\ufeff"):  # an editor's byte order mark
            path = where.rsplit(":", 1)[0]
            raise DataError(f"{where}: the file starts with a UTF-8 byte order mark (BOM), which JSON Lines does not "
                            f"allow; remove it, e.g. sed -i '1s/^\\xEF\\xBB\\xBF//' {path}") from None
        raise DataError(f"{where}: not valid JSON ({e.msg})") from None


def jsonl_values(record, where: str, key_field: str, audio_field: str, duration_field: str) -> tuple:
    """(key, audio path or None, seconds or None) of a JSON Lines record, validated; errors name ``where``."""
    if not isinstance(record, dict):
        kind = {list: "an array", str: "a string", bool: "a boolean", type(None): "null"}.get(type(record), "a number")
        raise DataError(f"{where}: {kind}, not a JSON object; a JSON Lines record is one {{...}} per line")
    if key_field not in record:
        fields = ", ".join(map(repr, list(record)[:12])) + (", ..." if len(record) > 12 else "")
        raise DataError(f"{where}: record has no key field {key_field!r} (its fields: {fields}); the dataset's "
                        "key_field (and audio_field, duration_field) must name the fields that hold them")
    key = record[key_field]
    if not isinstance(key, str):
        raise DataError(f"{where}: key field {key_field!r} must be a string, got {key!r}")
    seconds = record.get(duration_field)
    audio = record.get(audio_field)
    if audio is not None and not isinstance(audio, str):
        raise DataError(f"{where}: audio field {audio_field!r} must be a path string, got {audio!r}")
    if seconds is not None:
        seconds = duration_seconds(seconds, where, f"{duration_field!r} of {key!r}")
    return key, audio, seconds


def _parse_all(lines: list[str]) -> list | None:
    """The records of non-blank ``lines``, from ONE json.loads over them joined as a JSON array (100,000
    records: 0.15 s instead of 0.6 s line by line); None when that fails or gives another count (a line
    with two values), so that parsing line by line names the bad line."""
    try:
        parsed = json.loads("[" + ",".join(lines) + "]")
    except json.JSONDecodeError:
        return None
    return parsed if len(parsed) == len(lines) else None


STAGE_FORMAT = "stage"  # a chained dataset: another stage's merged output


def read_shard_items(paths: str | os.PathLike | list) -> list[Item]:
    """The items of a shard's slice (``manifest.Rows.slice_text``, validated by the plan), of one slice or of several
    (a job running several shards: see ``shards_per_job``), in the order given."""
    items = []
    for path in [paths] if isinstance(paths, (str, os.PathLike)) else paths:
        with open(path, encoding="utf-8") as f:
            written = json.load(f)
        items += [Item(key, source, audio, seconds, fields, None)
                  for (key, source, audio, seconds), fields in zip(written["items"], written["fields"])]
    return items


def source_spec(spec: dict) -> dict:
    """The dataset a chained one comes from, through every link of the chain (a plain spec: itself)."""
    while spec.get("format") == STAGE_FORMAT:
        spec = spec["source"]
    return spec


def read_items(spec: dict, with_records: bool = True, notes: list | None = None) -> list[Item]:
    """All items of a dataset in file order, validated: non-empty, unique keys without whitespace.
    A chained dataset's items are those of its source dataset. ``with_records=False`` leaves out what
    only planning digests (each item's source lines), for the dataset a job holds in memory. ``notes``, when
    given, receives what a Kaldi dir holds that is let pass but worth a look (``kaldi_file_notes``)."""
    from pathlib import Path

    spec = source_spec(spec)
    path = Path(spec["path"])
    fmt = spec.get("format", "kaldi")
    if not path.exists():
        where = f"datasets.{spec['name']}.path" if spec.get("name") else "dataset path"
        relative = "" if path.is_absolute() else f" (relative paths are taken from the working directory {os.getcwd()})"
        raise DataError(f"{where}: {path} does not exist{relative}")
    if fmt == "kaldi":
        items = _read_kaldi_dir(path, with_records, notes)
    elif fmt == "jsonl":
        items = _read_jsonl(path, spec)
    else:
        where = f"datasets.{spec['name']}.format" if spec.get("name") else f"dataset {path}: format"
        raise DataError(f"{where}: unknown format {fmt!r} (use 'kaldi' or 'jsonl')")
    if not items:
        raise empty_dataset_error(spec, path, (path / "wav.scp" if (path / "wav.scp").is_file() else path / FEATS_SCP)
                                  if fmt == "kaldi" else path)
    validate_keys(items, str(path))
    return items


def empty_dataset_error(spec: dict, path, listing) -> DataError:
    where = f"datasets.{spec['name']}: " if spec.get("name") else ""
    return DataError(f"{where}dataset {path} has no items: {listing} lists no key")


def bad_key(key: str) -> bool:
    """Empty, holding whitespace (one C call), or a control character (NUL, ESC, DEL: a file name or a
    terminal mangles them; isprintable() first, a C call that passes ASCII keys)."""
    return key.split() != [key] or not key.isprintable() and _has_control(key)


def validate_keys(items: list[Item], name: str) -> None:
    bad = [i for i in items if bad_key(i.key)]
    if bad:
        raise bad_keys_error(len(bad), [f"{i.key!r} ({i.source})" for i in bad[:MAX_LISTED]])
    first_seen: dict[str, str] = {}
    dupes = []
    for item in items:
        if item.key in first_seen:
            dupes.append(f"{item.key!r} ({item.source}, first at {first_seen[item.key]})")
        else:
            first_seen[item.key] = item.source
    if dupes:
        raise duplicate_keys_error(dupes)


def bad_keys_error(count: int, listed: list[str]) -> DataError:
    """``count`` keys that ``bad_key`` refuses, the first MAX_LISTED of them described in ``listed``."""
    return DataError(f"{count} key(s) are empty or contain whitespace or control characters: "
                     + listing(count, listed))


def missing_audio_error(count: int, listed: list[str], relative: bool = False) -> DataError:
    """``count`` audio files not found, the first MAX_LISTED of them described in ``listed``; ``relative``: some of
    them are relative paths (a wav.scp written for another directory is the usual cause, so the error says where
    they were looked for)."""
    where = (f" (relative audio paths are taken from the working directory {os.getcwd()}, as Kaldi takes them, "
             "not from the directory of the file that lists them)") if relative else ""
    return DataError(f"{count} audio file(s) not found: " + listing(count, listed) + where)


def unreadable_headers_error(bad: list[str]) -> DataError:
    """Every audio file whose header does not read, so that its duration is unknown (``bad``: the errors, each
    naming key, line and file), in one error: one fix and one rerun, not one per file."""
    if len(bad) == 1:
        return DataError(f"{bad[0]}. Fix or replace the file, or remove its line")
    return DataError(f"{len(bad)} audio file(s) with no readable header (their durations are needed to cut shards "
                     "by seconds): " + "; ".join(bad[:MAX_LISTED]) + (f"; and {len(bad) - MAX_LISTED} more"
                                                                    if len(bad) > MAX_LISTED else "")
                     + ". Fix or replace these files, or remove their lines")


def duplicate_keys_error(dupes: list[str]) -> DataError:
    return DataError(f"{len(dupes)} duplicate key(s): " + listing(len(dupes), dupes[:MAX_LISTED]))


def listing(count: int, listed: list[str]) -> str:
    """The first offenders of ``count``, and how many more there are."""
    more = count - len(listed)
    return ", ".join(listed) + (f" and {more} more" if more > 0 else "")


def _has_control(key: str) -> bool:
    return any(c < " " or "\x7f" <= c < "\xa0" for c in key)  # Unicode's Cc: C0, DEL and C1


def check_audio_exists(items: list[Item]) -> None:
    """Fail before any job runs if a plain audio path is missing (pipes are not checked)."""
    # each recording looked up once: the segments of one recording share it
    gone = {a for a in {i.audio for i in items} if a and not is_pipe(a) and not os.path.exists(a)}
    missing = [i for i in items if i.audio in gone] if gone else []
    if missing:
        listed = [f"key {i.key!r}: {i.audio} ({i.source})" for i in missing[:MAX_LISTED]]
        raise missing_audio_error(len(missing), listed, relative=any(not os.path.isabs(i.audio) for i in missing))


def read_kaldi_matrix(rxfilename: str, what: str):
    """A Kaldi matrix (an ark offset, an ark range, a plain file, a pipe) read by kaldiio, writable: kaldiio gives a
    read-only view of the bytes it read, which torch.from_numpy warns about (a user trial); np.require copies
    only such a view (~20 us for 1,000 frames of 80 floats)."""
    import kaldiio
    import numpy as np

    try:
        return np.require(kaldiio.load_mat(rxfilename), requirements="W")
    except Exception as e:  # kaldiio's errors name neither the key nor the table
        raise DataError(f"{what} {rxfilename!r} cannot be read: {type(e).__name__}: {e}") from e


def fill_durations(items: list[Item]) -> None:
    """Read durations from audio headers for items that have none yet (a truncated or empty file is an error)."""
    from snakeshard.io.audio import audio_duration

    bad = []
    for item in items:
        if item.seconds is not None:
            continue
        if not item.audio or is_pipe(item.audio):
            give = ("its recording's duration in reco2dur (its segment ends at -1)" if "start" in item.fields
                    else "durations (utt2dur, or utt2num_frames beside feats.scp)" if FEATS in item.fields
                    else "durations (utt2dur, segments, or a jsonl duration field)")
            raise DataError(f"key {item.key!r} ({item.source}): cannot read a duration from {item.audio!r}; give "
                            f"{give} or shard by count (shard_size)")
        try:
            item.seconds = audio_duration(item.audio, f"key {item.key!r} ({item.source})")
        except DataError as e:
            bad.append(str(e))
            continue
        if "start" in item.fields:  # a segment to the end of its recording (the others have their durations)
            item.seconds -= item.fields["start"]
            if item.seconds <= 0:
                bad.append(f"key {item.key!r} ({item.source}): segment starts at {item.fields['start']} s, at or "
                           f"past the end of {item.audio} ({item.seconds + item.fields['start']:.3f} s)")
    if bad:
        raise unreadable_headers_error(bad)


class KaldiDataset:
    """A key -> item mapping over a dataset, for providers: ``dataset[key]`` and ``load_audio(key)``.

    Items carry ``key``, ``audio`` and, when the data dir has them, ``text``, ``spk``
    (utt2spk) and segment ``start``/``end``.

    In a shard job (the spec then has ``shard_items``, set by the job) it holds only the shard's
    items, read from the plan's ``split.N/items.json`` (a job of several shards: theirs): a job's
    memory and start-up do not depend on the size of the dataset. Everywhere else (``runner(indices)``,
    notebooks) it reads the dataset.
    """

    def __init__(self, spec: dict):
        self.spec = spec
        self.shard_items = spec.get("shard_items")
        items = read_shard_items(self.shard_items) if self.shard_items else read_items(spec, with_records=False)
        if spec.get("only_keys") is not None:  # a canary job: its first keys of split.0
            only = set(spec["only_keys"])
            items = [i for i in items if i.key in only]
        self._items = {i.key: i for i in items}
        self.keys = [i.key for i in items]

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, key: str) -> bool:
        return key in self._items

    def __iter__(self):
        """The keys in the dataset's file order (the plan's): ``list(dataset)``."""
        return iter(self.keys)

    def _item(self, key: str) -> Item:
        try:
            return self._items[key]
        except KeyError:
            if self.shard_items:
                raise KeyError(f"{key!r}: not in this shard job's slice of the dataset ({self.shard_items}); "
                               "a shard job holds only its own keys") from None
            if isinstance(key, int) and self.keys:  # ESPnet3's datasets take int indices
                raise KeyError(f"{key!r}: a dataset's keys are strings; dataset.keys[{key}] is the key at that "
                               f"position (dataset.keys[0] is {self.keys[0]!r})") from None
            raise

    def __getitem__(self, key: str) -> dict:
        item = self._item(key)
        return {"key": item.key, "audio": item.audio, **item.fields}

    def duration(self, key: str) -> float:
        """Seconds of the key's audio: from the dataset (segments, utt2dur, jsonl), else its header."""
        item = self._item(key)
        if item.seconds is None:
            fill_durations([item])
        return item.seconds

    def load_array(self, key: str, field: str):
        """``feats`` of a Kaldi data dir with a ``feats.scp`` (Kaldi's features, read by kaldiio, writable); any other
        array is a field another stage wrote (fbank's ``feats``), which only a chained dataset has
        (StageOutputDataset): here the mistake is named rather than an AttributeError."""
        item = self._item(key)
        if field == FEATS and FEATS in item.fields:
            return read_kaldi_matrix(item.fields[FEATS], f"key {key!r} ({item.source}): its {FEATS_SCP} entry")
        name = self.spec.get("name", "?")
        if field == FEATS and has_kaldi_features(source_spec(self.spec)):
            raise DataError(f"datasets.{name}: key {key!r} ({item.source}) has no line in "
                            f"{os.path.join(source_spec(self.spec)['path'], FEATS_SCP)}")
        raise DataError(f"datasets.{name}: load_array({key!r}, {field!r}) reads a field of another stage's merged "
                        f"output, and dataset {name!r} ({self.spec.get('path', '?')}) is a data dir, not a stage's "
                        "output: run this stage over a chained dataset, e.g. datasets: "
                        f"{{feats_{name}: {{from_stage: <the stage that writes {field!r}>, dataset: {name}}}}}")

    def load_field(self, key: str, field: str):
        """A field of the key's record: ``text``, ``spk``, ``start``/``end``, or a JSON Lines field (what
        ``dataset[key]`` holds). A chained dataset (StageOutputDataset) gives its upstream's fields instead."""
        record = self[key]
        if field not in record:
            name = self.spec.get("name", "?")
            raise DataError(f"datasets.{name}: key {key!r} has no field {field!r} (its record has "
                            f"{sorted(record)}); a field another stage wrote is read over a chained dataset, e.g. "
                            f"datasets: {{out_{name}: {{from_stage: <the stage>, dataset: {name}}}}}")
        return record[field]

    def load_audio(self, key: str, dtype: str = "float32"):
        """(samples, sample_rate) of one item; segments are cut; Kaldi pipes are run.

        Refused, naming key, file and line: a truncated or empty file, a rate other than the
        stage's ``sample_rate``, a segment past the end of its recording (beyond the dataset's
        ``max_segment_overshoot`` seconds, which are cut off as Kaldi's extract-segments does).
        """
        from snakeshard.io.audio import read_item_audio

        item = self._audio_item(key)
        return read_item_audio(item, dtype=dtype, **self._audio_checks())

    def check_audio_headers(self, keys) -> tuple[list[AudioError], int]:
        """(the error ``load_audio`` would raise for each of ``keys`` whose audio fails its checks, read from the
        file's header alone; how many keys were not checked: Kaldi pipes, which are not run here)."""
        from snakeshard.io.audio import check_item_audio_header

        bad, unchecked = [], 0
        for key in keys:
            try:
                unchecked += not check_item_audio_header(self._audio_item(key), **self._audio_checks())
            except AudioError as e:
                bad.append(e)
        return bad, unchecked

    def _audio_item(self, key: str) -> Item:
        item = self._item(key)
        if item.audio is None:
            source = source_spec(self.spec)
            field = (f"; datasets.{source['name']}.audio_field is {source.get('audio_field', 'audio')!r}"
                     if source.get("format") == "jsonl" and source.get("name") else "")
            if FEATS in item.fields:  # a data dir of features alone (a wav.scp gives every key audio)
                field = (f": its data dir has features ({FEATS_SCP}) and no wav.scp; a stage that reads audio "
                         "needs a wav.scp (features are read with load_array(key, 'feats'))")
            raise AudioError(f"key {key!r} ({item.source}) has no audio{field}", key)
        return item

    def _audio_checks(self) -> dict:
        from snakeshard.io.audio import KALDI_MAX_OVERSHOOT

        source = source_spec(self.spec)
        return {"sample_rate": self.spec.get("sample_rate"), "dataset": source.get("name"),
                "max_overshoot": float(source.get("max_segment_overshoot", KALDI_MAX_OVERSHOOT))}

    def load_mono_audio(self, key: str, dtype: str = "float32"):
        """``load_audio``, for a stage that reads one channel: a multi-channel recording is refused naming the
        key, its file and the fix (a library fed 2-D samples fails naming neither)."""
        samples, rate = self.load_audio(key, dtype=dtype)
        if samples.ndim != 1:
            item = self._item(key)
            raise AudioError(f"key {key!r} ({item.source}): {item.audio} has {samples.shape[1]} channels, and this "
                             "stage reads one: downmix it (sox IN.wav -c 1 OUT.wav, or a wav.scp pipe "
                             "'sox IN.wav -c 1 -t wav - |')", key)
        return samples, rate


class StageOutputDataset(KaldiDataset):
    """A chained dataset: the upstream stage's dataset (keys, items, audio) plus its merged fields.

    ``fields`` names them (the merged ``fields.json``); ``load_field(key, name)`` gives any of them as
    its writer stored it: text as ``str``, JSON Lines as the value, ark/npy as a numpy array, wav/flac
    as (samples, rate). Each field's index is read on first use, then kept.
    """

    def __init__(self, spec: dict):
        from pathlib import Path

        from snakeshard.core.merge import FIELDS_FILE, require_current

        super().__init__(spec)
        self.set_dir = Path(spec["path"])
        # A shard job reads the upstream shards that hold its keys (the job checked they are current, see
        # workflow.job.read_upstream_shards); anything else reads the merged output, which must be current.
        self.sources = spec.get("upstream_dirs")
        if self.sources:
            from snakeshard.core.merge import SHARD_ONLY_META, read_done

            done = read_done(self.sources[0])
            if done is None:  # the job checked it, but another run may have removed it since (a trial's TypeError)
                raise DataError(f"{self.sources[0]}/done is missing: the upstream shard this job reads is not done "
                                "(another run redoing it?); run snakemake again")
            fields = done["fields"] or {}
            self.fields = {name: {k: v for k, v in meta.items() if k not in SHARD_ONLY_META}
                           for name, meta in fields.items()}
        else:
            require_current(self.set_dir, spec.get("upstream_inputs"))
            self.fields = json.loads((self.set_dir / FIELDS_FILE).read_text())
        self._index: dict[str, dict] = {}

    def _lookup(self, key: str, name: str, formats) -> tuple[str, str]:
        meta = self.fields.get(name)
        if meta is None:
            raise DataError(f"{self.set_dir}: the upstream stage wrote no field {name!r} (it has {sorted(self.fields)})")
        if formats and meta["format"] not in formats:
            raise DataError(f"{self.set_dir}: field {name!r} is {meta['format']}, not one of {sorted(formats)}")
        if name not in self._index:
            index = self._index[name] = {}
            # in a shard job, only the shard's keys are kept (an upstream index may hold other keys too)
            # and the file is streamed rather than read whole
            wanted = self._items if self.shard_items else None
            for path in self._index_files(meta):
                for line in read_text_lines(path) if wanted is None else _stream_lines(path):
                    if meta["format"] == "jsonl":
                        record = json.loads(line)
                        if wanted is None or record["key"] in wanted:
                            index[record["key"]] = record["value"]
                    else:
                        k, _, value = line.partition(" ")
                        if wanted is None or k in wanted:
                            index[k] = value
        try:
            return meta["format"], self._index[name][key]
        except KeyError:
            where = ", ".join(str(p) for p in self._index_files(meta))
            raise DataError(f"{where}: no key {key!r}") from None

    def _index_files(self, meta: dict) -> list[Path]:
        """Where a field's index lines are: in each upstream shard a shard job reads, else in the merged output."""
        from pathlib import Path

        if self.sources:
            return [Path(d) / meta["index"] for d in self.sources]
        return [self.set_dir / meta["index"]]

    def load_array(self, key: str, field: str):
        """An ark or npy field's array for ``key`` (kaldiio, numpy), writable as a model's input is."""
        import numpy as np

        fmt, value = self._lookup(key, field, ("ark", "npy"))
        if fmt == "npy":
            return np.load(value, allow_pickle=False)
        return read_kaldi_matrix(value, f"key {key!r}: field {field!r} of {self.set_dir}:")

    def load_audio(self, key: str, field: str | None = None, dtype: str = "float32"):
        """(samples, rate) of ``field`` (a wav/flac field of the upstream). Without ``field``: the
        upstream's ``wav`` field if it wrote one (its merged dir is then a Kaldi data dir), else the
        source dataset's audio. A rate other than the stage's ``sample_rate`` is refused."""
        if field is None and self.fields.get("wav", {}).get("format") in ("wav", "flac"):
            field = "wav"
        if field is None:
            return super().load_audio(key, dtype=dtype)
        import soundfile

        _, path = self._lookup(key, field, ("wav", "flac"))
        samples, rate = soundfile.read(path, dtype=dtype)
        expected = self.spec.get("sample_rate")
        if expected and rate != expected:
            raise DataError(f"key {key!r}: {path} (field {field!r} of {self.set_dir}) is {rate} Hz, the stage "
                            f"expects {expected} Hz (stages.<stage>.sample_rate)")
        return samples, rate

    def load_field(self, key: str, field: str):
        fmt = self.fields.get(field, {}).get("format")
        if fmt in ("ark", "npy"):
            return self.load_array(key, field)
        if fmt in ("wav", "flac"):
            return self.load_audio(key, field)
        return self._lookup(key, field, None)[1]


def load_dataset(spec: dict) -> KaldiDataset:
    """The dataset named by a stage's dataset spec, for use in a provider. In-process (a notebook, a test) a dataset
    is given as the config writes it: ``{"path": ...}``, or a chained one ``{"from_stage": ..., "dataset": ...}``
    (plus ``output_dir`` when it is not ``results``), which reads that stage's merged output (see chained_spec)."""
    if spec.get("format") == STAGE_FORMAT:  # as a shard job gets it (its from_stage too)
        return StageOutputDataset(spec)
    if "from_stage" in spec:
        return StageOutputDataset(chained_spec(spec))
    if "path" not in spec:
        raise DataError(f"dataset spec {spec!r} names no data: give {{'path': <Kaldi dir or JSON Lines file>}}, or a "
                        "chained dataset {'from_stage': <stage>, 'dataset': <its dataset>, 'output_dir': 'results'}")
    return KaldiDataset(spec)


def chained_spec(spec: dict) -> dict:
    """The spec of a chained dataset written as in the config (``from_stage``, ``dataset``, ``output_dir``), as a
    shard job gets it: the upstream set's dir, and its own dataset, read from the ``spec.json`` that the last
    snakemake parse wrote there (a user trial found no way to run a chained stage's runner in-process)."""
    from snakeshard.core.shard_files import SET_SPEC, read_spec

    if "dataset" not in spec:
        raise DataError(f"chained dataset spec {spec!r}: name the dataset of stage {spec['from_stage']!r} it reads "
                        "('dataset': ...)")
    out = spec.get("output_dir", "results")
    set_dir = os.path.join(out, spec["from_stage"], spec["dataset"])
    try:
        upstream = read_spec(os.path.join(set_dir, SET_SPEC))
    except FileNotFoundError:
        raise DataError(f"{set_dir}: no spec.json there: stage {spec['from_stage']!r} over dataset {spec['dataset']!r} "
                        f"has not been planned under output_dir {out!r} (run snakemake -n in the project, or give "
                        "'output_dir': the config's, from this working directory)") from None
    return {"name": spec.get("name", spec["dataset"]), "format": STAGE_FORMAT, "path": set_dir,
            "source": upstream["dataset"]}
