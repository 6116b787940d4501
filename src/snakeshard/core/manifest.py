"""A dataset as the planner reads it: per key only what a plan needs, in compact columns.

Planning needs each key, its duration (the cost that balances shards) and, per shard, the lines its keys
stand for (digested into the shard's fingerprint and copied into its ``items.json`` slice). Holding a
whole manifest as one Python object per key cost the driver 1.1 GB at 1,000,000 keys, so a JSON Lines
manifest is read in blocks and kept as one string of keys per block and one array of durations (~20 bytes a
key):

* pass 1 (``JsonlManifest.__init__``): each block is parsed (one ``json.loads`` per block), validated
  as ``data.read_items`` validates it (the same errors, naming file and line), and reduced to its keys,
  durations and audio paths; then keys are checked unique by their hashes (a sorted numpy array; a hash met
  twice is resolved against the keys themselves);
* pass 2 (``shards``): the file is read again, block by block, and each shard's ``Rows`` (its keys,
  where they were declared, and their lines as written) are made as its lines go by, so one shard at a
  time is in memory. No JSON is parsed again: the lines are copied into the slices as written.

A big manifest's two passes run in processes forked from the driver (core/forked.py): pass 1 over byte ranges
of the file (``_scan_forked``; a range with anything bad in it is read again here, so errors are the same), pass 2
over runs of consecutive shards (``plan.make_plan``).

Pass 1's columns are kept beside the plan (``save``, in ``manifest_cache/``). A manifest that has only grown
by whole lines since (its old bytes unchanged: their SHA-256) resumes from them and parses only its new
lines; the plan then keeps its leading shards that hold the same items as before (``plan.make_plan``).

A Kaldi data dir joins several files by key, so it is read whole (``data.read_items``) and wrapped as
``ItemsManifest``: the same interface over a list of ``Item``.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from array import array
from bisect import bisect_right
from contextlib import suppress
from itertools import chain, islice, repeat

from snakeshard.core.data import (JSONL_RECORD, Item, bad_key, bad_keys_error, check_audio_exists,
                                  duplicate_keys_error, empty_dataset_error, fill_durations, is_pipe, jsonl_record,
                                  jsonl_values, listing, missing_audio_error, read_items, source_spec,
                                  unreadable_headers_error, utf8_error)
from snakeshard.core.fingerprint import digest
from snakeshard.core.forked import map_forked, plan_workers
from snakeshard.errors import MAX_LISTED, DataError
from snakeshard.io.atomic import atomic_write_text

RANGES_PER_WORKER = 4  # pass 1 forked: smaller results in flight (10,000,000 keys: 779 -> 514 MB in all processes)
BLOCK_BYTES = 1 << 20  # a block of the manifest, parsed at once: ~10,000 lines of 100 bytes (as fast as 16 MB
# blocks, and 1,000,000 keys of 42 bytes peaked at 83 MB instead of 298: bench/RESULTS.md section 21)
UNKNOWN = math.nan  # a duration not in the manifest (read from the audio header if the sharding needs it)
CACHE_DIR = "manifest_cache"  # in the plan's set dir: pass 1's columns, for a manifest appended to
CACHE_META, CACHE_COLUMNS, CACHE_SECONDS = "manifest.json", "columns.jsonl", "seconds.f64"
CACHE_FORMAT = 1
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

    def total_seconds(self) -> float:
        """The shard's seconds, rounded as plan.json holds them (asked only when every duration is known)."""
        return round(sum(self.seconds), 3)


class ItemsManifest:
    """A dataset read whole as ``Item`` objects (a Kaldi data dir, or items made by hand)."""

    reused_items, reused_plan = 0, None  # read whole every time

    def __init__(self, items: list[Item], notes: list[str] = ()):
        self.items = items
        self.notes = list(notes)  # what the data dir holds that is let pass but worth a look
        self.num_items = len(items)
        self.seconds = array("d", (UNKNOWN if i.seconds is None else i.seconds for i in items))
        self.missing = sum(i.seconds is None for i in items)

    def save(self, cache_dir, plan_signature: str) -> None:
        """Nothing to keep: a Kaldi data dir is read whole at every plan."""

    def check_audio_field(self) -> None:
        """Nothing to check: a Kaldi data dir's wav.scp gives every key its audio."""

    def bytes_after(self, first_item: int) -> int:
        """0: its items are in memory, and shards from them are planned here unless ``SNAKESHARD_PLAN_WORKERS``
        asks for more processes (a Kaldi dir is read whole, in one process: no big corpus ships as one)."""
        return 0

    def fill_durations(self) -> None:
        fill_durations(self.items)
        self.seconds = array("d", (i.seconds for i in self.items))
        self.missing = 0

    def groups(self, field: str):
        """(value of ``field``, key, where it was declared) per item, in order: ``spk`` from utt2spk, ``rec``
        the recording a segment is cut from (without segments each key is its own recording)."""
        for item in self.items:
            value = item.fields.get(field, item.key if field == "rec" and "start" not in item.fields else None)
            yield group_value(value, field, item.key, item.source), item.key, item.source

    def shards(self, counts, first_item: int = 0):
        start = first_item
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
    """A JSON Lines manifest read in blocks (see the module's docstring): keys, durations, audio paths.

    With ``cache_dir`` (the plan's set dir), pass 1's columns are kept there (``save``); when the manifest has
    only grown by whole lines since (its old bytes unchanged: same size prefix, same SHA-256), only the new
    lines are read, and ``reused_items`` says how many leading items are as they were.
    """

    notes = ()  # one file: nothing to cross-check

    def __init__(self, path: str, spec: dict, cache_dir=None):
        self.path = path
        self.fields = [spec.get("key_field", "key"), spec.get("audio_field", "audio"),
                       spec.get("duration_field", "duration")]  # key, audio, duration
        self.key_blocks: list[str] = []  # per block, its keys joined by "\n" (keys hold no control character)
        self.audio_blocks: list[list | None] = []  # per block, its audio paths (None: the block names none)
        self.blocks: list[list[int]] = []  # per block: [byte offset, first line number, first item, items]
        self.seconds = array("d")
        self.num_items = 0
        self.reused_items = 0  # leading items read from the cache: as they were at the plan before
        self.reused_plan = None  # the signature of the plan made with those items
        self._sha = hashlib.sha256()  # of the bytes read, to tell an appended manifest from an edited one
        self.size, self.lines_read = 0, 0
        resumed = self._resume(cache_dir) if cache_dir is not None else None
        self._scan(*(resumed or (0, 1)), spec)

    def _scan(self, offset: int, first_line: int, spec: dict) -> None:
        """Pass 1 from byte ``offset`` (line ``first_line``) to the end: parse, validate, keep the columns; in
        forked processes when the manifest is big (``forked.plan_workers``)."""
        end = os.path.getsize(self.path)
        workers = plan_workers(end - offset)
        hashes = self._scan_forked(offset, first_line, end, workers) if workers > 1 else None
        if hashes is None:  # one process, or a worker met bad data: read here, to name it as always
            self._scan_here(offset, first_line, spec)
        elif not self.num_items:
            raise empty_dataset_error(spec, self.path, self.path)
        else:
            self._check_unique(hashes)
        self.spec = spec
        self.missing = sum(1 for s in self.seconds if s != s)  # NaN: UNKNOWN

    def check_audio_field(self) -> None:
        """Records that name their audio and records that do not, in one manifest: refused, naming those without
        (every stage that loads audio would fail on them, a shard at a time). A manifest with no audio at all is a
        text-only dataset and passes. ~0.02 s a million keys, on manifests with audio."""
        spec = self.spec
        if not any(a is not None for a in self.audio_blocks):
            return
        if all(a is not None and None not in a for a in self.audio_blocks):
            return
        without, listed = 0, []
        for key, n, _, audio, _ in self._rows():
            if audio is None:
                without += 1
                if len(listed) < MAX_LISTED:
                    listed.append(f"{key!r} ({self.path}:{n})")
        field, name = self.fields[1], spec.get("name")
        where, config_key = (f"datasets.{name}: ", f"datasets.{name}.audio_field") if name else ("", "audio_field")
        names = "names" if without == 1 else "name"
        raise DataError(f"{where}{without} of {self.num_items} records {names} no audio ({config_key} is {field!r}), "
                        f"which the other {self.num_items - without} do: {listing(without, listed)}. Give every "
                        "record its audio, or none (a text-only dataset)")

    def _scan_here(self, offset: int, first_line: int, spec: dict) -> None:
        """Pass 1 in this process: every bad record, key and audio path is found, and named as
        ``data.read_items`` names it."""
        path = self.path
        bad_keys: list[str] = []
        bad_key_count = 0
        absent: list[str] = []
        absent_count = 0
        absent_relative = False
        for block_offset, numbers, lines in self._lines(offset, first_line, self._sha):
            keys, audio, seconds = self._parse_block(numbers, lines)
            if not keys:  # a block of blank lines
                continue
            if not keys_plainly_good(keys):
                for key, n in zip(keys, numbers):
                    if bad_key(key):
                        bad_key_count += 1
                        if len(bad_keys) < MAX_LISTED:
                            bad_keys.append(f"{key!r} ({path}:{n})")
            if audio is not None and (gone := absent_audio(audio)):
                for key, a, n in zip(keys, audio, numbers):
                    if a in gone:
                        absent_count += 1
                        absent_relative = absent_relative or not os.path.isabs(a)
                        if len(absent) < MAX_LISTED:
                            absent.append(f"key {key!r}: {a} ({path}:{n})")
            self.blocks.append([block_offset, numbers[0], self.num_items, len(keys)])
            self.key_blocks.append("\n".join(keys))
            self.audio_blocks.append(audio)
            self.seconds.extend(seconds)
            self.num_items += len(keys)
        if not self.num_items:
            raise empty_dataset_error(spec, path, path)
        if bad_keys:
            raise bad_keys_error(bad_key_count, bad_keys)
        self._check_unique([])  # before the audio: a duplicate key is named first, as data.read_items does
        if absent:
            raise missing_audio_error(absent_count, absent, relative=absent_relative)

    def _scan_forked(self, offset: int, first_line: int, end: int, workers: int):
        """Pass 1 of bytes ``offset``..``end`` as byte ranges parsed in ``workers`` forked processes while this
        one digests the bytes: the keys' hashes of each range (for ``_check_unique``), or None when a
        range holds anything ``_scan_here`` would refuse (nothing is kept then; it reads them again)."""
        import numpy  # noqa: F401 -- imported once here, not in every forked worker (~0.1 s each)

        starts, count = [offset], workers * RANGES_PER_WORKER
        with open(self.path, "rb") as f:  # each range starts at a line: after the first newline past its share
            for k in range(1, count):
                f.seek(max(offset + (end - offset) * k // count - 1, starts[-1]))
                f.readline()
                if f.tell() < end:
                    starts.append(f.tell())
            f.seek(max(end - 1, 0))
            last_byte = f.read(1)
        sha = self._sha.copy()

        def digest_bytes():
            with open(self.path, "rb") as f:
                f.seek(offset)
                for chunk in iter(lambda: f.read(min(BLOCK_BYTES, end - f.tell())), b""):
                    sha.update(chunk)

        line, item = first_line - 1, self.num_items  # what the ranges before a part hold
        hashes = []
        ranges = list(zip(starts, starts[1:] + [end]))
        kept = len(self.blocks)  # the cached blocks before the ranges
        for part in map_forked(self._scan_range, ranges, workers, digest_bytes):  # taken in one by one (memory)
            if part is None:  # back to the cached columns alone, for _scan_here
                del self.blocks[kept:], self.key_blocks[kept:], self.audio_blocks[kept:], self.seconds[self.num_items:]
                return None
            blocks, key_blocks, audio_blocks, seconds, lines, part_hashes = part
            for block in blocks:  # numbered within its range: from the manifest's start
                block[1] += line
                block[2] += item
            self.blocks += blocks
            self.key_blocks += key_blocks
            self.audio_blocks += audio_blocks
            self.seconds.frombytes(seconds)
            hashes.append(part_hashes)
            line += lines
            item += len(part_hashes)
        self.num_items = item
        self._sha, self.size, self.lines_read = sha, end, line
        self.ends_with_newline = end == offset or last_byte == b"\n"  # as _lines says it (nothing read: True)
        return hashes

    def _scan_range(self, byte_range: tuple[int, int]):
        """In a forked process: (blocks, key blocks, audio blocks, durations as bytes, lines, the keys' sorted
        hashes) of one byte range, its lines numbered from 1 and its items from 0; None if any record, key or
        audio path in it is bad."""
        import numpy as np

        blocks, key_blocks, audio_blocks, seconds = [], [], [], array("d")
        start, end = byte_range
        try:  # a line that is not UTF-8, or not a good record: named by the driver, which knows its line number
            for block_offset, numbers, lines in self._lines(start, 1, end=end):
                keys, audio, durations = self._parse_block(numbers, lines)
                if not keys:
                    continue
                if not keys_plainly_good(keys) and any(map(bad_key, keys)):
                    return None
                if audio is not None and absent_audio(audio):
                    return None
                blocks.append([block_offset, numbers[0], len(seconds), len(keys)])
                key_blocks.append("\n".join(keys))
                audio_blocks.append(audio)
                seconds.extend(durations)
        except DataError:
            return None
        hashes = np.fromiter(map(hash, chain.from_iterable(b.split("\n") for b in key_blocks)), dtype=np.int64,
                             count=len(seconds))
        hashes.sort()
        return blocks, key_blocks, audio_blocks, seconds.tobytes(), self._next_line - 1, hashes

    def groups(self, field: str):
        """(value of ``field``, key, where it was declared) per record, in order: one more reading of the file,
        made only for ``sharding.keep_together``."""
        key_field = self.fields[0]
        for _, numbers, lines in self._lines():
            for n, record in zip(numbers, json.loads("[" + ",".join(lines) + "]")):
                where = f"{self.path}:{n}"
                yield group_value(record.get(field), field, record[key_field], where), record[key_field], where

    # -- pass 1 ---------------------------------------------------------------------------------------

    def _lines(self, offset: int = 0, first: int = 1, sha=None, end: int | None = None):
        """(byte offset, line numbers, stripped lines) of each block of the manifest's non-blank lines, from
        ``offset`` (a line start, line number ``first``) to ``end`` (a line start; None: the file's end);
        ``sha`` is updated with every byte read. Then ``_next_line`` is the number of the line after them."""
        with open(self.path, "rb") as f:
            f.seek(offset)
            rest = b""
            at = offset  # where ``rest`` starts in the file
            while True:
                chunk = f.read(BLOCK_BYTES if end is None else min(BLOCK_BYTES, end - at - len(rest)))
                if sha is not None:
                    sha.update(chunk)
                raw = rest + chunk
                if chunk:
                    cut = raw.rfind(b"\n") + 1
                    if not cut:  # a line longer than a block: read on
                        rest = raw
                        continue
                    raw, rest = raw[:cut], raw[cut:]
                elif not raw:
                    break
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
                    yield at, range(first, first + len(lines)), stripped
                else:
                    kept = [(n, t) for n, t in enumerate(stripped, first) if t]
                    yield at, [n for n, _ in kept], [t for _, t in kept]
                first += len(lines)
                at += len(raw)
                if not chunk:
                    break
        self._next_line = first
        if sha is not None:
            self.size, self.lines_read, self.ends_with_newline = at, first - 1, not raw or raw.endswith(b"\n")

    def _parse_block(self, numbers, lines) -> tuple[list, list | None, list]:
        """(keys, audio paths or None, durations with UNKNOWN) of one block's lines, validated."""
        try:
            records = json.loads("[" + ",".join(lines) + "]")
            if len(records) != len(lines):  # a line with two values: found below, line by line
                records = None
        except json.JSONDecodeError:
            records = None
        if records is not None and set(map(type, records)) == {dict}:
            key_field, audio_field, duration_field = self.fields
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
            record = records[i] if records is not None else jsonl_record(line, where)
            key, path, value = jsonl_values(record, where, *self.fields)
            keys.append(key)
            audio.append(path)
            seconds.append(UNKNOWN if value is None else value)
        return keys, (audio if any(a is not None for a in audio) else None), seconds

    def _check_unique(self, hashed: list) -> None:
        """Duplicate keys, found among the keys' 64-bit hashes sorted (8 bytes a key, not a set of the keys).
        ``hashed``: the sorted hashes of the last items' keys, computed where they were read (forked); the keys
        before them are hashed here."""
        import numpy as np

        every = np.empty(self.num_items, dtype=np.int64)
        at, here, runs = 0, self.num_items - sum(map(len, hashed)), len(hashed)
        for block in self.key_blocks:
            if at == here:
                break
            keys = block.split("\n")
            every[at:at + len(keys)] = np.fromiter(map(hash, keys), dtype=np.int64, count=len(keys))
            at += len(keys)
        while hashed:  # each part's hashes dropped once copied: not all of them twice in memory
            part = hashed.pop(0)
            every[at:at + len(part)] = part
            at += len(part)
        every.sort(kind="stable" if runs else "quicksort")  # stable (timsort): it merges the forked parts' sorted runs
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

    # -- the cache: pass 1's columns, kept for an appended manifest ----------------------------------

    def save(self, cache_dir, plan_signature: str) -> None:
        """Keep pass 1's columns in ``cache_dir/manifest_cache/`` (before durations are read from audio headers:
        they describe the file), for the plan of ``plan_signature``, which is written next: only that plan's
        shards may be kept on an append (were it not written, the plan before would not describe these
        columns). The description file is written last, so a cache without it is ignored."""
        cache = os.path.join(cache_dir, CACHE_DIR)
        os.makedirs(cache, exist_ok=True)
        for name in (CACHE_META, CACHE_COLUMNS, CACHE_SECONDS):  # stale ones, should this save be cut short
            with suppress(FileNotFoundError):
                os.remove(os.path.join(cache, name))
        with open(os.path.join(cache, CACHE_COLUMNS), "w", encoding="utf-8") as f:
            f.writelines(json.dumps([keys, audio], ensure_ascii=False) + "\n"
                         for keys, audio in zip(self.key_blocks, self.audio_blocks))
        with open(os.path.join(cache, CACHE_SECONDS), "wb") as f:
            getattr(self, "given_seconds", self.seconds).tofile(f)
        meta = {"format": CACHE_FORMAT, "path": self.path, "fields": self.fields, "size": self.size,
                "sha256": self._sha.hexdigest(), "lines": self.lines_read, "ends_with_newline": self.ends_with_newline,
                "num_items": self.num_items, "float_bytes": self.seconds.itemsize, "blocks": self.blocks,
                "plan_signature": plan_signature}
        atomic_write_text(os.path.join(cache, CACHE_META), json.dumps(meta), fsync=False)

    def _resume(self, cache_dir) -> tuple[int, int] | None:
        """Load the cached columns if the manifest is what they describe plus whole lines after it: then the byte
        offset and line number to read on from; else None (the manifest is read from the start)."""
        cache = os.path.join(cache_dir, CACHE_DIR)
        try:
            with open(os.path.join(cache, CACHE_META), encoding="utf-8") as f:
                meta = json.load(f)
            if (meta.get("format") != CACHE_FORMAT or meta["path"] != self.path or meta["fields"] != self.fields
                    or not meta["ends_with_newline"] or os.path.getsize(self.path) < meta["size"]
                    or meta["float_bytes"] != self.seconds.itemsize):
                return None
            sha = hashlib.sha256()
            with open(self.path, "rb") as f:
                left = meta["size"]
                while left:
                    chunk = f.read(min(left, BLOCK_BYTES))
                    if not chunk:
                        return None
                    sha.update(chunk)
                    left -= len(chunk)
            if sha.hexdigest() != meta["sha256"]:  # edited, not only appended to
                return None
            with open(os.path.join(cache, CACHE_COLUMNS), encoding="utf-8") as f:
                columns = [json.loads(line) for line in f]
            seconds = array("d")
            with open(os.path.join(cache, CACHE_SECONDS), "rb") as f:
                seconds.fromfile(f, meta["num_items"])
        except (OSError, ValueError, KeyError, TypeError, EOFError):  # missing, cut short, another version: read all
            return None
        if len(columns) != len(meta["blocks"]):
            return None
        audio_blocks = [audio for _, audio in columns]
        if absent_audio(chain.from_iterable(audio for audio in audio_blocks if audio)):
            return None  # an audio file gone since: read it all, to name it with its key and line as always
        self.key_blocks = [keys for keys, _ in columns]
        self.audio_blocks = audio_blocks
        self.seconds = seconds
        self.blocks = meta["blocks"]
        self.num_items = self.reused_items = meta["num_items"]
        self.reused_plan = meta["plan_signature"]
        self._sha, self.size, self.lines_read = sha, meta["size"], meta["lines"]
        return meta["size"], meta["lines"] + 1

    # -- after pass 1 ---------------------------------------------------------------------------------

    def _rows(self):
        """(key, line number, line, audio, seconds) of every item, in file order (reads the file again)."""
        seconds = iter(self.seconds)
        for keys, numbers, lines, audio in self._columns():
            yield from zip(keys, numbers, lines, audio, seconds)

    def _columns(self, first_item: int = 0):
        """(keys, line numbers, lines, audio paths) of the items from ``first_item`` on, a block of lines at a
        time (reads the file again, from the block holding that item)."""
        b = self._block_at(first_item)
        offset, first_line, block_item, _ = self.blocks[b]
        skip = first_item - block_item
        keys = islice(chain.from_iterable(block.split("\n") for block in self.key_blocks[b:]), skip, None)
        audio = islice(chain.from_iterable(a if a is not None else repeat(None, n) for a, (_, _, _, n)
                                           in zip(self.audio_blocks[b:], self.blocks[b:])), skip, None)
        for _, numbers, lines in self._lines(offset, first_line):
            if skip:
                numbers, lines, skip = numbers[skip:], lines[skip:], max(0, skip - len(lines))
            if lines:
                yield list(islice(keys, len(lines))), numbers, lines, list(islice(audio, len(lines)))

    def _block_at(self, item: int) -> int:
        """The index of the block holding ``item``."""
        return bisect_right([block[2] for block in self.blocks], item) - 1

    def bytes_after(self, first_item: int) -> int:
        """The manifest's bytes from the block holding ``first_item`` on: what planning shards from it reads."""
        return self.size - self.blocks[self._block_at(first_item)][0]

    def fill_durations(self) -> None:
        """Durations the manifest lacks, from the audio headers (a key without readable audio is an error)."""
        if not self.missing:
            return
        from snakeshard.io.audio import audio_duration

        self.given_seconds = array("d", self.seconds)  # what the cache keeps: the manifest's, not the headers'
        bad = []
        for i, (key, n, _, a, s) in enumerate(self._rows()):
            if s == s:
                continue
            if not a or is_pipe(a):
                raise DataError(
                    f"key {key!r} ({self.path}:{n}): cannot read a duration from {a!r}; "
                    "give durations (utt2dur, segments, or a jsonl duration field) or shard by count (shard_size)")
            try:
                self.seconds[i] = audio_duration(a, f"key {key!r} ({self.path}:{n})")
            except DataError as e:  # every unreadable header in one error
                bad.append(str(e))
        if bad:
            raise unreadable_headers_error(bad)
        self.missing = 0

    def shards(self, counts, first_item: int = 0):
        """Each shard's ``Rows`` in turn, for shards of ``counts`` consecutive items from ``first_item`` on
        (pass 2)."""
        columns = self._columns(first_item)
        block, at = None, 0  # the block being cut, and how much of it the shards before took
        start = first_item
        prefix = f"{self.path}:"
        for count in counts:
            parts, need = [], count
            while need:
                if block is None or at == len(block[0]):
                    block, at = next(columns), 0
                take = min(need, len(block[0]) - at)
                parts.append([column[at:at + take] for column in block])
                at, need = at + take, need - take
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


def group_value(value, field: str, key: str, where: str) -> str:
    """A record's ``keep_together`` value, as a string (a number or a list compared by its JSON); none is an error
    naming the key."""
    if value is None:
        source = " (utt2spk has no line for it)" if field == "spk" else ""
        raise DataError(f"sharding.keep_together: key {key!r} ({where}) has no {field!r}{source}; every key needs "
                        "one to be kept with the others of its value")
    return value if isinstance(value, str) else json.dumps(value, sort_keys=True)


def keys_plainly_good(keys: list[str]) -> bool:
    """True when no key can be bad (``data.bad_key``), checked on the keys joined: a block of 10,000 at C speed.
    False only asks for the key-by-key check."""
    joined = "".join(keys)
    return all(keys) and " " not in joined and joined.isprintable()


def absent_audio(paths) -> set[str]:
    """The plain audio files among ``paths`` that do not exist, each looked up once (keys cut from one recording
    by segments share it: 1,000,000 keys over 10 files were 2.5 s of stat calls)."""
    return {a for a in set(paths) if a and not is_pipe(a) and not os.path.exists(a)}


def scan_manifest(spec: dict, cache_dir=None):
    """The planner's view of a dataset (a chained dataset: of its source), validated as ``data.read_items``
    validates it, audio files included; a JSON Lines manifest resumes from ``cache_dir``'s columns when it
    was only appended to."""
    from pathlib import Path

    source = source_spec(spec)
    if source.get("format", "kaldi") == "jsonl" and Path(source["path"]).is_file():
        return JsonlManifest(source["path"], source, cache_dir)
    notes = []
    items = read_items(spec, notes=notes)
    check_audio_exists(items)
    return ItemsManifest(items, notes)
