"""A dataset as the planner reads it: per key only what a plan needs, in compact columns.

Planning needs each key, its duration (the cost that balances shards) and, per shard, the lines its keys
stand for (digested into the shard's fingerprint and copied into its ``items.json`` slice). Holding a
whole manifest as one Python object per key cost the driver 1.1 GB at 1,000,000 keys, so a JSON Lines
manifest is read in blocks and kept as one string of keys and one array of durations (~20 bytes a key):

* pass 1 (``JsonlManifest.__init__``): each block is parsed (one ``json.loads`` per block), validated
  as ``data.read_items`` validates it (the same errors, naming file and line), and reduced to its keys,
  durations and audio paths; keys are checked unique by their hashes (a sorted numpy array; a hash met
  twice is resolved against the keys themselves);
* pass 2 (``shards``): the file is read again, block by block, and each shard's ``Rows`` (its keys,
  where they were declared, and their lines as written) are made as its lines go by, so one shard at a
  time is in memory. No JSON is parsed again: the lines are copied into the slices as written.

A Kaldi data dir joins several files by key, so it is read whole (``data.read_items``) and wrapped as
``ItemsManifest``: the same interface over a list of ``Item``.
"""

from __future__ import annotations

import json
import math
import os
from array import array
from itertools import chain, repeat

from snakeshard.core.data import (JSONL_RECORD, MAX_LISTED, Item, _duration, bad_key, check_audio_exists,
                                  duplicate_keys_error, empty_dataset_error, fill_durations, is_pipe, read_items,
                                  source_spec, utf8_error)
from snakeshard.core.fingerprint import digest
from snakeshard.errors import DataError

BLOCK_BYTES = 1 << 20  # a block of the manifest, parsed at once: ~10,000 lines of 100 bytes (a smaller transient than 4 or 16 MB, and as fast)
UNKNOWN = math.nan  # a duration not in the manifest (read from the audio header if the sharding needs it)
_encoder = json.JSONEncoder(ensure_ascii=False, check_circular=False, separators=(",", ":"))


class Rows:
    """One shard's items as columns, and what the plan writes of them."""

    __slots__ = ("keys", "items_json", "audio", "seconds", "records", "fields_json")

    def __init__(self, keys, items_json, audio, seconds, records, fields_json):
        self.keys = keys  # list[str]
        self.items_json = items_json  # the JSON array [[key, "file:line" where declared, audio, seconds], ...]
        self.audio = audio  # list[str | None]
        self.seconds = seconds  # list[float | None]
        self.records = records  # {source file: "key\tvalue\n" lines}: what the keys stand for, as written there
        self.fields_json = fields_json  # the JSON array of the items' fields, as the slice holds it

    def slice_text(self) -> str:
        """``split.N/items.json``: ``{"items": [[key, source, audio, seconds], ...], "fields": [...]}``
        (read back by ``data.read_shard_items``)."""
        return f'{{"items":{self.items_json},"fields":{self.fields_json}}}\n'

    def records_digests(self) -> dict[str, str]:
        """Per source file (wav.scp, segments, text, utt2spk, jsonl), a digest of the shard's keys' lines in it."""
        return {name: digest(text) for name, text in sorted(self.records.items())}

    def audio_files(self) -> list[str]:
        """The plain audio files the shard reads, each once, in order (pipes are covered by their command text)."""
        return list(dict.fromkeys(a for a in self.audio if a and not is_pipe(a)))

    def total_seconds(self) -> float | None:
        return None if None in self.seconds else round(sum(self.seconds), 3)


class ItemsManifest:
    """A dataset read whole as ``Item`` objects (a Kaldi data dir, or items made by hand)."""

    def __init__(self, items: list[Item]):
        self.items = items
        self.num_items = len(items)
        self.seconds = array("d", (UNKNOWN if i.seconds is None else i.seconds for i in items))
        self.missing = sum(i.seconds is None for i in items)

    def fill_durations(self) -> None:
        fill_durations(self.items)
        self.seconds = array("d", (i.seconds for i in self.items))
        self.missing = 0

    def shards(self, counts):
        start = 0
        for count in counts:
            items = self.items[start:start + count]
            start += count
            records: dict[str, list[str]] = {}
            for item in items:
                for name, value in item.records.items():
                    records.setdefault(name, []).append(f"{item.key}\t{value}\n")
            written = [i.records.get(JSONL_RECORD) for i in items]
            fields = "[" + ",".join(written) + "]" if all(written) else _encoder.encode([i.fields for i in items])
            head = _encoder.encode([[i.key, i.source, i.audio, i.seconds] for i in items])
            yield Rows([i.key for i in items], head, [i.audio for i in items], [i.seconds for i in items],
                       {name: "".join(lines) for name, lines in records.items()}, fields)


class JsonlManifest:
    """A JSON Lines manifest read in blocks (see the module's docstring): keys, durations, audio paths."""

    def __init__(self, path: str, spec: dict):
        self.path = path
        self.key_field = spec.get("key_field", "key")
        self.audio_field = spec.get("audio_field", "audio")
        self.duration_field = spec.get("duration_field", "duration")
        self.key_blocks: list[str] = []  # per block, its keys joined by "\n" (keys hold no control character)
        self.audio_blocks: list[list | None] = []  # per block, its audio paths (None: the block names none)
        self.seconds = array("d")
        self.num_items = 0
        self.missing = 0
        hashes = []  # per block, its keys' hashes: duplicates are found among these (8 bytes a key)
        bad_keys: list[str] = []
        bad_key_count = 0
        absent: list[str] = []
        absent_count = 0
        for numbers, lines in self._lines():
            keys, audio, seconds = self._parse_block(numbers, lines)
            if not keys:  # a block of blank lines
                continue
            if not (all(keys) and " " not in (joined := "".join(keys)) and joined.isprintable()):
                for key, n in zip(keys, numbers):
                    if bad_key(key):
                        bad_key_count += 1
                        if len(bad_keys) < MAX_LISTED:
                            bad_keys.append(f"{key!r} ({path}:{n})")
            if audio is not None:
                for key, a, n in zip(keys, audio, numbers):
                    if a and not is_pipe(a) and not os.path.exists(a):
                        absent_count += 1
                        if len(absent) < MAX_LISTED:
                            absent.append(f"key {key!r}: {a} ({path}:{n})")
            self.key_blocks.append("\n".join(keys))
            self.audio_blocks.append(audio)
            self.seconds.extend(seconds)
            hashes.append(array("q", map(hash, keys)))
            self.num_items += len(keys)
        self.missing = sum(1 for s in self.seconds if s != s)  # NaN: UNKNOWN
        if not self.num_items:
            raise empty_dataset_error(spec, path, path)
        if bad_keys:
            raise DataError(f"{bad_key_count} key(s) are empty or contain whitespace or control characters: "
                            + ", ".join(bad_keys))
        self._check_unique(hashes)
        if absent:
            raise DataError(f"{absent_count} audio file(s) not found: " + ", ".join(absent))

    # -- pass 1 ---------------------------------------------------------------------------------------

    def _lines(self):
        """(line numbers, stripped lines) of the manifest's non-blank lines, a block at a time."""
        first = 1
        with open(self.path, "rb") as f:
            rest = b""
            while True:
                chunk = f.read(BLOCK_BYTES)
                raw = rest + chunk
                if chunk:
                    cut = raw.rfind(b"\n") + 1
                    if not cut:  # a line longer than a block: read on
                        rest = raw
                        continue
                    raw, rest = raw[:cut], raw[cut:]
                elif not raw:
                    return
                else:
                    rest = b""
                try:
                    text = raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    raise utf8_error(self.path, raw, e, first) from None
                lines = text.split("\n")
                if lines[-1] == "":
                    lines.pop()
                stripped = list(map(str.strip, lines))
                if all(stripped):
                    yield range(first, first + len(lines)), stripped
                else:
                    kept = [(n, t) for n, t in enumerate(stripped, first) if t]
                    yield [n for n, _ in kept], [t for _, t in kept]
                first += len(lines)
                if not chunk:
                    return

    def _parse_block(self, numbers, lines) -> tuple[list, list | None, list]:
        """(keys, audio paths or None, durations with UNKNOWN) of one block's lines, validated."""
        try:
            records = json.loads("[" + ",".join(lines) + "]")
            if len(records) != len(lines):  # a line with two values: found below, line by line
                records = None
        except json.JSONDecodeError:
            records = None
        if records is not None and set(map(type, records)) == {dict}:
            key_field, audio_field, duration_field = self.key_field, self.audio_field, self.duration_field
            keys = [r.get(key_field) for r in records]
            audio = [r.get(audio_field) for r in records]
            seconds = [r.get(duration_field) for r in records]
            audio_types = set(map(type, audio))
            if (set(map(type, keys)) == {str} and audio_types <= {str, type(None)}
                    and set(map(type, seconds)) <= {float, int, type(None)}):
                known = [s for s in seconds if s is not None] if None in seconds else seconds
                # all > 0 and finite (a NaN, which json reads, makes the sum NaN); else named below, line by line
                if not known or min(known) > 0 and math.isfinite(sum(known)):
                    durations = array("d", seconds) if known is seconds else array(
                        "d", (UNKNOWN if s is None else s for s in seconds))
                    return keys, (audio if str in audio_types else None), durations
        return self._parse_lines(numbers, lines, records)

    def _parse_lines(self, numbers, lines, records) -> tuple[list, list | None, list]:
        """One record at a time, raising at the first bad one with the error ``data.read_items`` gives."""
        keys, audio, seconds = [], [], array("d")
        for i, (n, line) in enumerate(zip(numbers, lines)):
            where = f"{self.path}:{n}"
            try:
                record = records[i] if records is not None else json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{where}: not valid JSON ({e.msg})") from None
            if not isinstance(record, dict) or self.key_field not in record:
                raise DataError(f"{where}: record has no key field {self.key_field!r}")
            key = record[self.key_field]
            if not isinstance(key, str):
                raise DataError(f"{where}: key field {self.key_field!r} must be a string, got {key!r}")
            value = record.get(self.duration_field)
            path = record.get(self.audio_field)
            if path is not None and not isinstance(path, str):
                raise DataError(f"{where}: audio field {self.audio_field!r} must be a path string, got {path!r}")
            keys.append(key)
            audio.append(path)
            seconds.append(UNKNOWN if value is None else _duration(value, where, f"{self.duration_field!r} of {key!r}"))
        return keys, (audio if any(a is not None for a in audio) else None), seconds

    def _check_unique(self, hashes: list) -> None:
        import numpy as np

        every = np.concatenate([np.frombuffer(h, dtype=np.int64) for h in hashes])
        hashes.clear()
        every.sort()
        twice = set(every[1:][every[1:] == every[:-1]].tolist())
        del every
        if not twice:
            return
        first_seen: dict[str, str] = {}
        dupes = []
        for key, n, _, _, _ in self._rows():  # the few keys whose hash was met twice, against each other
            if hash(key) in twice:
                where = f"{self.path}:{n}"
                if key in first_seen:
                    dupes.append(f"{key!r} ({where}, first at {first_seen[key]})")
                else:
                    first_seen[key] = where
        if dupes:
            raise duplicate_keys_error(dupes)

    # -- after pass 1 ---------------------------------------------------------------------------------

    def _rows(self):
        """(key, line number, line, audio, seconds) of every item, in file order (reads the file again)."""
        seconds = iter(self.seconds)
        for keys, numbers, lines, audio in self._columns():
            yield from zip(keys, numbers, lines, audio, seconds)

    def _columns(self):
        """(keys, line numbers, lines, audio paths) of each block that holds items (reads the file again)."""
        stored = zip(self.key_blocks, self.audio_blocks)
        for numbers, lines in self._lines():
            if lines:
                keys, audio = next(stored)
                keys = keys.split("\n")
                yield keys, numbers, lines, audio if audio is not None else [None] * len(keys)

    def block_sizes(self):
        return (block.count("\n") + 1 for block in self.key_blocks)

    def fill_durations(self) -> None:
        """Durations the manifest lacks, from the audio headers (a key without readable audio is an error)."""
        if not self.missing:
            return
        from snakeshard.io.audio import audio_duration

        for i, (key, n, _, a, s) in enumerate(self._rows()):
            if s == s:
                continue
            if not a or is_pipe(a):
                raise DataError(
                    f"key {key!r} ({self.path}:{n}): cannot read a duration from {a!r}; "
                    "give durations (utt2dur, segments, or a jsonl duration field) or shard by count (shard_size)")
            self.seconds[i] = audio_duration(a, f"key {key!r} ({self.path}:{n})")
        self.missing = 0

    def shards(self, counts):
        """Each shard's ``Rows`` in turn, for shards of ``counts`` consecutive items (pass 2)."""
        columns = self._columns()
        block, at = None, 0  # the block being cut, and how much of it the shards before took
        start = 0
        prefix = f"{self.path}:"
        for count in counts:
            parts = []
            while sum(len(p[0]) for p in parts) < count:
                if block is None or at == len(block[0]):
                    block, at = next(columns), 0
                take = min(count - sum(len(p[0]) for p in parts), len(block[0]) - at)
                parts.append([column[at:at + take] for column in block])
                at += take
            keys, numbers, lines, audio = parts[0] if len(parts) == 1 else [
                list(chain.from_iterable(p[i] for p in parts)) for i in range(4)]
            seconds = self.seconds[start:start + count].tolist()
            if self.missing:
                seconds = [None if s != s else s for s in seconds]
            start += count
            sources = list(map(prefix.__add__, map(str, numbers)))
            items_json = _encoder.encode(list(zip(keys, sources, audio, seconds)))
            record_lines = "".join(chain.from_iterable(zip(keys, repeat("\t"), lines, repeat("\n"))))  # key\tline\n
            yield Rows(keys, items_json, audio, seconds, {JSONL_RECORD: record_lines}, "[" + ",".join(lines) + "]")

def scan_manifest(spec: dict):
    """The planner's view of a dataset (a chained dataset: of its source), validated as ``data.read_items``
    validates it, audio files included."""
    from pathlib import Path

    source = source_spec(spec)
    if source.get("format", "kaldi") == "jsonl" and Path(source["path"]).is_file():
        return JsonlManifest(source["path"], source)
    items = read_items(spec)
    check_audio_exists(items)
    return ItemsManifest(items)
