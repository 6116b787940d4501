"""The default writers: each result field lands in the format its values call for.

A field's kind comes from the value the shard's first key returns for it; a later key
returning another kind fails, naming key, field and both types.

  kind     value                                   default format -> shard files
  scalar   str, int, float, bool, numpy scalar     text  -> ``<field>``          ``key value`` lines
  array    numpy array, torch tensor (to CPU)      ark   -> ``<field>.ark`` + ``<field>.scp`` (kaldiio)
  audio    ``Audio(samples, sample_rate)``         wav   -> ``<field>/<key>.wav`` + ``<field>.scp`` (soundfile)
  json     dict, list, tuple                       jsonl -> ``<field>.jsonl``: ``{"key": k, "value": v}`` per line

A stage's ``outputs:`` config picks another format per field (``ark``, ``npy``, ``wav``, ``flac``,
``jsonl``, ``text``) and its options (``subtype`` for wav/flac, ``compression_method`` for ark).
The per-key *index* file of a field (``<field>``, ``<field>.scp``, ``<field>.jsonl``) holds one
line per key, in plan order, and is what the merge concatenates; ``fields`` (recorded in the
shard's ``done`` and the merged ``fields.json``) says what each field is, so nothing downstream guesses.

Heavy libraries (numpy, kaldiio, soundfile) are imported on the first value that needs them:
this module is imported at every Snakefile parse and in every shard job.
"""

from __future__ import annotations

import json
import math
import os
import re
import zlib
from operator import itemgetter

from snakeshard.errors import ConfigError, ContractError

SCALAR_TYPES = (str, int, float, bool)
_PLAIN_TYPES = frozenset(SCALAR_TYPES)  # exact types whose f-string is str(value)
DEFAULT_FORMAT = {"scalar": "text", "array": "ark", "audio": "wav", "json": "jsonl"}
# Which kinds each format can hold (text takes a list of scalars as Kaldi's space-separated tokens).
FORMAT_KINDS = {"text": {"scalar", "json"}, "jsonl": {"scalar", "json", "array"}, "ark": {"array"},
                "npy": {"array"}, "wav": {"audio"}, "flac": {"audio"}}
FORMAT_OPTIONS = {"ark": {"compression_method"}, "wav": {"subtype"}, "flac": {"subtype"}}
# Names a field cannot take: files of the shard dir (keys, items.json, done: the plan's and the job's) and of
# the merged set dir (jobs/: the done files of jobs of several shards).
RESERVED_NAMES = frozenset({"keys", "items.json", "done", "fields.json", "merged.json", "plan.json", "spec.json",
                            "fingerprints.json", "audio_files.json", "stage_history.json", "logs", "jobs"})
# What str.splitlines() splits on. Every line-based file here is split on "\n" alone, but a user's tools
# may split on any of these (Python's text mode splits on "\r"), so a text value holding one is refused,
# and JSON Lines escape the three that JSON leaves as they are (\x85, \u2028, \u2029).
LINE_BREAKS = "\n\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029"
_JSON_RAW_BREAKS = {"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"}
# A field name is a file name (letters, digits, _ . -, not starting with . or -), optionally under one group
# directory ("collect_feats/feats", as ESPnet's collect_stats lays out its collected features); the group dir
# is created in the shard and merged dirs.
FIELD_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*(/[A-Za-z0-9_][A-Za-z0-9_.-]*)?")
SHARD_DIR_NAME = re.compile(r"split\.\d+")  # a field so named would land on a shard dir when merged


class Audio:
    """A waveform result: ``samples`` (numpy array or torch tensor, (frames,) or (frames, channels)) at
    ``sample_rate`` Hz. Written as one audio file per key, indexed by a ``wav.scp``-style file.
    (A plain class: dataclasses would cost every shard job ~12 ms of imports.)"""

    __slots__ = ("samples", "sample_rate")

    def __init__(self, samples, sample_rate: int):
        self.samples = samples
        self.sample_rate = sample_rate

    def __repr__(self) -> str:
        return f"Audio(samples={self.samples!r}, sample_rate={self.sample_rate!r})"


def value_kind(value) -> str | None:
    """scalar / array / audio / json, or None for a type no writer takes."""
    t = type(value)
    if t in _PLAIN_TYPES or isinstance(value, SCALAR_TYPES):
        return "scalar"
    if isinstance(value, Audio):
        return "audio"
    if isinstance(value, (dict, list, tuple)):
        return "json"
    module = t.__module__
    if module == "numpy":
        return "scalar" if getattr(value, "ndim", None) == 0 and t.__name__ != "ndarray" else "array"
    if module.startswith("torch") and hasattr(value, "detach"):
        return "array"
    return None


def to_numpy(value):
    """A numpy array of ``value``: torch tensors are detached and moved to the CPU."""
    import numpy as np

    if hasattr(value, "detach"):
        value = value.detach().cpu().numpy()
    return np.asarray(value)


def index_file(name: str, fmt: str) -> str:
    """The per-key file a field's format writes (and the merge concatenates)."""
    return {"text": name, "jsonl": f"{name}.jsonl"}.get(fmt, f"{name}.scp")


def check_outputs_config(outputs: dict, where: str) -> None:
    """``stages.X.outputs``: known formats, options that format takes, usable field names."""
    for name, spec in (outputs or {}).items():
        if not usable_field_name(name):
            raise ConfigError(f"{where}.{name}: {name!r} cannot be a result field's file name "
                              f"(letters, digits, _ . -, at most one group/ dir; not split.N, not one of "
                              f"{sorted(RESERVED_NAMES)})")
        fmt = spec.get("format")
        if fmt is not None and fmt not in FORMAT_KINDS:
            raise ConfigError(f"{where}.{name}.format: {fmt!r} is not one of {sorted(FORMAT_KINDS)}")
        extra = sorted(set(spec) - {"format"} - FORMAT_OPTIONS.get(fmt, set()))
        if extra:
            takes = sorted(FORMAT_OPTIONS.get(fmt, set())) or "no options"
            raise ConfigError(f"{where}.{name}.{extra[0]}: format {fmt!r} takes {takes}")


def usable_field_name(name: str) -> bool:
    top = name.split("/", 1)[0]
    return bool(FIELD_NAME.fullmatch(name)) and top not in RESERVED_NAMES and not SHARD_DIR_NAME.fullmatch(top)


def check_field_name(name: str, where: str) -> None:
    if not usable_field_name(name):
        raise ContractError(f"{where}: result field {name!r} cannot be used as a file name "
                            f"(letters, digits, _ . -, at most one group/ dir; not split.N, not one of "
                            f"{sorted(RESERVED_NAMES)})")


class _Field:
    """One field's writer in one shard: appends in processing order, indexes in plan order at close."""

    def __init__(self, shard_dir: str, name: str, fmt: str, options: dict, allow_nonfinite: bool):
        self.shard_dir, self.name, self.fmt, self.options = shard_dir, name, fmt, options
        self.allow_nonfinite = allow_nonfinite
        self.index_name = index_file(name, fmt)
        if "/" in name:  # a grouped field: its group dir
            os.makedirs(os.path.join(shard_dir, name.partition("/")[0]), exist_ok=True)
        self.index = open(os.path.join(shard_dir, self.index_name), "w", encoding="utf-8")
        self.keys: list[str] = []  # in the order written

    def write_column(self, keys: list[str], values: list) -> None:
        for key, value in zip(keys, values):
            self.write(key, value)

    def meta(self) -> dict:
        """What the merge needs to know: the format, the index file and a check of its bytes."""
        with open(os.path.join(self.shard_dir, self.index_name), "rb") as f:
            raw = f.read()
        return {"format": self.fmt, "index": self.index_name, **self.options, "bytes": len(raw),
                "crc32": zlib.crc32(raw)}

    def close(self, order: list[str]) -> None:
        """Flush and fsync; make the index hold exactly the shard's keys (``order``), in that order."""
        self.index.flush()
        os.fsync(self.index.fileno())
        self.index.close()
        if self.keys != order:
            missing = set(order).difference(self.keys)
            if missing or len(self.keys) != len(order):
                listed = [k for k in order if k in missing][:5]
                raise ContractError(f"field {self.name!r} has values for {len(self.keys)} of the shard's "
                                    f"{len(order)} keys (missing: {listed}): every key's result must hold "
                                    "every field, or none of them")
            self._reorder(order)

    def _reorder(self, order: list[str]) -> None:
        path = os.path.join(self.shard_dir, self.index_name)
        lines = dict(zip(self.keys, _read_lines(path)))
        _rewrite(path, "".join(lines[k] + "\n" for k in order))


def _read_lines(path: str) -> list[str]:
    """The lines of an index file this module wrote: split on "\n" only, as every reader here does."""
    with open(path, encoding="utf-8", newline="") as f:
        return f.read().split("\n")[:-1]


def has_line_break(text: str) -> bool:
    return any(c in text for c in LINE_BREAKS)


def _rewrite(path: str, text: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


class TextField(_Field):
    def write(self, key: str, value) -> None:
        if isinstance(value, (list, tuple)):  # Kaldi's token lists: "key tok1 tok2"
            value = " ".join(map(str, value))
        elif type(value) is not str:
            if hasattr(value, "item"):  # numpy scalar
                value = value.item()
            if type(value) is float and not (self.allow_nonfinite or math.isfinite(value)):
                raise ContractError(f"item {key!r}: field {self.name!r} is {value}; list the field under "
                                    "stages.<stage>.allow_nonfinite if that is a valid result")
            value = str(value)
        if has_line_break(value):
            raise ContractError(f"item {key!r}: field {self.name!r} holds a line break ({_first_break(value)!r}), "
                                f"which would split its line of the {self.name} file; remove it in forward, or "
                                f"write the field as JSON Lines (stages.<stage>.outputs.{self.name}.format: jsonl)")
        self.index.write(f"{key} {value}\n")
        self.keys.append(key)


def _first_break(text: str) -> str:
    return next(c for c in text if c in LINE_BREAKS)


def _json_default(value):
    if hasattr(value, "tolist"):  # numpy scalars and arrays, torch tensors
        return (value.detach().cpu() if hasattr(value, "detach") else value).tolist()
    raise TypeError(f"a {type(value).__name__} is not JSON serialisable")


def line_encoder(allow_nan: bool):
    """``encode(value) -> str``: a JSON Lines record's text (numpy and torch values as lists)."""
    return json.JSONEncoder(ensure_ascii=False, allow_nan=allow_nan, default=_json_default).encode


class JsonlField(_Field):
    def __init__(self, *args):
        super().__init__(*args)
        self._encode = line_encoder(self.allow_nonfinite)

    def write(self, key: str, value) -> None:
        try:
            line = self._encode({"key": key, "value": value})
        except ValueError:
            raise ContractError(f"item {key!r}: field {self.name!r} holds a NaN or infinity; list the field under "
                                "stages.<stage>.allow_nonfinite if that is a valid result") from None
        except TypeError as e:
            raise ContractError(f"item {key!r}: field {self.name!r}: {e}") from None
        if any(c in line for c in _JSON_RAW_BREAKS):
            for c, escaped in _JSON_RAW_BREAKS.items():
                line = line.replace(c, escaped)
        self.index.write(line + "\n")
        self.keys.append(key)


def check_finite(array, key: str, name: str) -> None:
    """Refuse NaN and infinity in a float array (the sum is finite only if every element is)."""
    import numpy as np

    kind = array.dtype.kind
    if kind not in "fc" or not array.size:
        return
    if kind == "f" and np.isfinite(array.sum()):
        return
    if not np.isfinite(array).all():  # not just an overflowing sum
        bad = int(np.flatnonzero(~np.isfinite(array.ravel()))[0])
        raise ContractError(f"item {key!r}: field {name!r} holds {array.ravel()[bad]} (flat index {bad}); "
                            "list the field under stages.<stage>.allow_nonfinite if that is a valid result")


class _ShapeCheck:
    """An ark field keeps one number of dims and one trailing shape (all but the first dim, the frames): the
    first key's. A feature matrix of another width in one ark would reach training as a crash or a silent
    broadcast; the merge also refuses shards that disagree (the shape is part of the field's meta). An npy
    field is the format for arrays of any rank and shape, and is not checked."""

    def __init__(self, name: str):
        self.name = name
        self.shape: tuple | None = None  # the first key's shape with its first dim left out

    def check(self, key: str, array) -> None:
        shape = array.shape
        if self.shape is None:
            self.shape = (None, *shape[1:]) if shape else ()
        elif len(shape) != len(self.shape) or shape[1:] != self.shape[1:]:
            raise ContractError(f"item {key!r}: field {self.name!r} is an array of shape {shape}, but earlier keys "
                                f"gave it shape {_shape_text(self.shape)} (a field keeps its number of dims and "
                                "all but its first dim)")

    def meta(self) -> dict:
        return {} if self.shape is None else {"shape": list(self.shape)}


def _shape_text(shape: tuple) -> str:
    return "(" + ", ".join("N" if d is None else str(d) for d in shape) + ("," if len(shape) == 1 else "") + ")"


def all_finite(arrays: list) -> bool:
    """True if no float array in ``arrays`` holds NaN or infinity (one sum over all of them)."""
    import numpy as np

    floats = [a.ravel() for a in arrays if a.dtype.kind == "f" and a.size]
    return not floats or bool(np.isfinite(np.concatenate(floats).sum(dtype=np.float64)))


class ArkField(_Field):
    """Kaldi ark + scp through kaldiio. Records are appended as they come; if the shard processed keys
    out of plan order, close copies each record's bytes (as kaldiio wrote them) into a new ark in plan
    order, so the shard's files do not depend on the processing order."""

    def __init__(self, *args):
        import kaldiio
        import numpy

        super().__init__(*args)
        self.ark_path = os.path.abspath(os.path.join(self.shard_dir, f"{self.name}.ark"))
        self.ark = open(self.ark_path, "wb")
        self.end = 0  # where the next record starts
        self.compression = self.options.get("compression_method")
        self._save_ark, self._ndarray = kaldiio.save_ark, numpy.ndarray
        self.shape = _ShapeCheck(self.name)

    def write(self, key: str, value) -> None:
        self.write_column([key], [value])

    def write_column(self, keys: list[str], values: list) -> None:
        """Many keys at once: one NaN/inf check over all their arrays (per-array checks cost more than
        the writes for small arrays), then the writes, then their index lines in one go."""
        arrays = [v if type(v) is self._ndarray else to_numpy(v) for v in values]
        if not (self.allow_nonfinite or all_finite(arrays)):
            for key, array in zip(keys, arrays):  # find the key, name it
                check_finite(array, key, self.name)
        for key, array in zip(keys, arrays):
            self.shape.check(key, array)
        save, ark, compression, ark_path = self._save_ark, self.ark, self.compression, self.ark_path
        start, lines = self.end, []
        try:
            for key, array in zip(keys, arrays):
                save(ark, {key: array}, compression_method=compression)
                lines.append(f"{key} {ark_path}:{start + len(key.encode()) + 1}\n")
                start = ark.tell()
        except (AssertionError, ValueError, TypeError):  # kaldiio asserts on dtype and shape
            ark.seek(start)
            ark.truncate()
            raise ContractError(
                f"item {key!r}: field {self.name!r} is a {array.dtype} array of shape {array.shape}: a Kaldi ark "
                "holds float32/float64 vectors and matrices and int32 vectors (compressed: matrices only); cast "
                f"it in forward, or set stages.<stage>.outputs.{self.name}.format: npy"
            ) from None
        finally:
            self.end = start
            self.index.write("".join(lines))
            self.keys.extend(keys[:len(lines)])

    def close(self, order):
        self.ark.flush()
        os.fsync(self.ark.fileno())
        self.ark.close()
        super().close(order)

    def meta(self) -> dict:
        return {**super().meta(), **self.shape.meta(), "ark": self.ark_path}

    def _reorder(self, order: list[str]) -> None:
        """Copy each record's bytes into a new ark in plan order. Records lie back to back in written
        order, so each one runs from its key to where the next one's key starts."""
        index = os.path.join(self.shard_dir, self.index_name)
        starts = [int(line.rpartition(":")[2]) - len(key.encode()) - 1
                  for key, line in zip(self.keys, _read_lines(index))]
        span = dict(zip(self.keys, zip(starts, starts[1:] + [self.end])))
        parent, name = os.path.split(self.ark_path)
        tmp = os.path.join(parent, f".{name}.ordered")
        lines = []
        with open(self.ark_path, "rb") as src, open(tmp, "wb") as dst:
            for key in order:
                start, end = span[key]
                src.seek(start)
                lines.append(f"{key} {self.ark_path}:{dst.tell() + len(key.encode()) + 1}\n")
                dst.write(src.read(end - start))
            dst.flush()
            os.fsync(dst.fileno())
        os.replace(tmp, self.ark_path)
        _rewrite(index, "".join(lines))


class _PerKeyFileField(_Field):
    """One file per key under ``<field>/``, indexed by ``key /abs/path`` lines (wav.scp form)."""

    suffix = ""

    def __init__(self, *args):
        super().__init__(*args)
        self.dir = os.path.abspath(os.path.join(self.shard_dir, self.name))
        os.mkdir(self.dir)

    def path_for(self, key: str) -> str:
        if "/" in key or key.startswith("."):
            raise ContractError(f"item {key!r}: field {self.name!r} writes one file per key, and this key cannot "
                                f"be a file name; use format ark or jsonl for it")
        return os.path.join(self.dir, f"{key}{self.suffix}")

    def write(self, key: str, value) -> None:
        path = self.path_for(key)
        self.write_file(path, key, value)
        self.index.write(f"{key} {path}\n")
        self.keys.append(key)

    def close(self, order):
        # One fsync per file: a done that survives a power loss must not point at lost audio.
        for key in self.keys:
            fd = os.open(self.path_for(key), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        from snakeshard.io.atomic import fsync_dir

        fsync_dir(self.dir)
        super().close(order)

    def meta(self) -> dict:
        return {**super().meta(), "dir": self.dir}


class NpyField(_PerKeyFileField):
    suffix = ".npy"

    def write_file(self, path, key, value):
        import numpy as np

        array = to_numpy(value)
        if not self.allow_nonfinite:
            check_finite(array, key, self.name)
        np.save(path, array, allow_pickle=False)


class AudioField(_PerKeyFileField):
    def __init__(self, shard_dir: str, name: str, fmt: str, options: dict, allow_nonfinite: bool):
        self.suffix = f".{fmt}"  # .wav or .flac
        super().__init__(shard_dir, name, fmt, options, allow_nonfinite)

    def write_file(self, path, key, value):
        import soundfile

        samples = to_numpy(value.samples)
        if not self.allow_nonfinite:
            check_finite(samples, key, self.name)
        try:
            soundfile.write(path, samples, int(value.sample_rate), subtype=self.options.get("subtype"),
                            format=self.fmt.upper())
        except (ValueError, TypeError, RuntimeError) as e:
            raise ContractError(f"item {key!r}: field {self.name!r}: cannot write {samples.dtype} samples of shape "
                                f"{samples.shape} at {value.sample_rate} Hz as {self.fmt}: {e}") from None


FIELD_WRITERS = {"text": TextField, "jsonl": JsonlField, "ark": ArkField, "npy": NpyField,
                 "wav": AudioField, "flac": AudioField}


class FieldWriters:
    """The default writers of a shard: one typed writer per result field (see the module doc).

    The shard loop sets ``allow_nonfinite`` (fields that may hold NaN/inf), ``outputs`` (the stage's
    format overrides) and ``order`` (the shard's keys in plan order, whatever order it processes them in).
    ``close`` checks that every field holds every key of ``order`` and writes each index in that order; it fsyncs every file, so a ``done`` that survives a power loss never points at
    fragments that did not, and leaves ``fields``: per field, its format, index file and a check of the
    index's bytes (the merge trusts an index only while it is byte for byte what was checked here).
    """

    def __init__(self, shard_dir: str | os.PathLike):
        self.allow_nonfinite: frozenset = frozenset()
        self.outputs: dict = {}  # per instance: a runner's open_writers may preset formats in it
        self.order: list[str] | None = None
        self.shard_dir = os.fspath(shard_dir)
        self.writers: dict[str, _Field] = {}
        self.kinds: dict[str, str] = {}
        self.fields: dict[str, dict] = {}
        self.closed = False
        self.index_files: list[str] = []

    def _open(self, name: str, key: str, value, kind: str | None) -> _Field:
        check_field_name(name, f"item {key!r}")
        # "g/x" needs a dir g: no field may be named g (nor a field g/... when one named g exists)
        group = name.partition("/")[0]
        clash = group if "/" in name and group in self.writers else next(
            (other for other in self.writers if other.startswith(name + "/")), None)
        if clash:
            raise ContractError(f"item {key!r}: field {name!r} and field {clash!r} cannot both exist "
                                f"({group!r} would be a file and a directory)")
        if kind is None:
            raise ContractError(f"item {key!r}: field {name!r} is a {type(value).__name__}; the default writers "
                                "take str/int/float/bool, numpy arrays, torch tensors, snakeshard.Audio, dicts and "
                                "lists (override write_record for other types)")
        options = dict(self.outputs.get(name) or {})
        fmt = options.pop("format", None) or DEFAULT_FORMAT[kind]
        if kind not in FORMAT_KINDS[fmt]:
            raise ContractError(f"item {key!r}: field {name!r} is a {type(value).__name__}, which format {fmt!r} "
                                f"(stages.<stage>.outputs.{name}.format) cannot hold")
        self.kinds[name] = kind
        writer = self.writers[name] = FIELD_WRITERS[fmt](self.shard_dir, name, fmt, options,
                                                         name in self.allow_nonfinite)
        return writer

    def write(self, result: dict) -> None:
        key = result["key"]
        for name, value in result.items():
            if name == "key":
                continue
            kind = value_kind(value)
            writer = self.writers.get(name)
            if writer is None:
                writer = self._open(name, key, value, kind)
            elif kind != self.kinds[name]:
                raise ContractError(f"item {key!r}: field {name!r} is a {type(value).__name__} ({kind}), but earlier "
                                    f"keys of this shard gave it {self.kinds[name]} values (a field keeps one type)")
            writer.write(key, value)

    def write_many(self, keys: list[str], results: list) -> bool:
        """Write a slice of results field by field when all are alike: dicts with the same fields, no
        ``key`` field, each field's values of one type (and the kind its writer has). Plain scalars go
        out as one block of text. Returns False, having written nothing, for anything else (the caller
        then goes item by item, which writes or raises the precise error); a value its writer refuses
        raises that writer's error, naming key and field, as the item path would."""
        try:
            names = list(results[0])
            if "key" in names or sum(map(len, results)) != len(names) * len(results):
                return False
            columns = [list(map(itemgetter(name), results)) for name in names]
        except (TypeError, KeyError, IndexError):  # not mappings, or same field count with other names
            return False
        text_blocks, typed = [], []
        for name, values in zip(names, columns):
            types = set(map(type, values))
            if len(types) != 1 and not types <= _PLAIN_TYPES:
                return False
            kind = value_kind(values[0])
            writer = self.writers.get(name)
            if kind is None or (writer is not None and self.kinds[name] != kind):
                return False
            plain_text = (types <= _PLAIN_TYPES and name not in self.outputs
                          and (writer is None or type(writer) is TextField))
            if not plain_text:
                typed.append((name, values, kind))
                continue
            if float in types and name not in self.allow_nonfinite and not all(
                    math.isfinite(v) for v in values if type(v) is float):
                return False  # a NaN or inf: the item-by-item path names it
            text = "".join([f"{k} {v}\n" for k, v in zip(keys, values)])
            if len(text.splitlines()) != len(keys):  # a value held a line break (keys hold none)
                return False
            text_blocks.append((name, text))
        for name, text in text_blocks:
            writer = self.writers.get(name) or self._open(name, keys[0], "", "scalar")
            writer.index.write(text)
            writer.keys.extend(keys)
        for name, values, kind in typed:
            writer = self.writers.get(name) or self._open(name, keys[0], values[0], kind)
            writer.write_column(keys, values)
        return True

    def close(self) -> list[str]:
        """Close every field; returns the index files (what the merge concatenates). Closing again
        returns them again: the shard loop closes the writers after a ``close_writers`` that did not."""
        if self.closed:
            return self.index_files
        for name, writer in self.writers.items():
            writer.close(self.order if self.order is not None else writer.keys)
            self.fields[name] = writer.meta()
        self.closed = True
        self.index_files = sorted(w.index_name for w in self.writers.values())
        return self.index_files
