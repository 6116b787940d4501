"""Fingerprints: what a shard's result depends on, as a short hex digest.

A stage fingerprint covers the runner and provider import paths and the source of
the modules that define them (parsed, so comments and formatting do not count),
the provider config (less the keys the stage lists in ``fingerprint_ignore``:
options such as worker counts or fault injection that do not change results),
batch size, the dataset spec, snakeshard's version and the identity (path, size,
mtime) of every model file named in the provider config; an inference stage's adds the fingerprint of the
training stage whose model it reads.

A shard's fingerprint adds its inputs: the digest of its keys, of what each key
stands for (its wav.scp value or pipe, segment times, text, utt2spk, or JSON Lines
record) and of the identity (size, mtime) of every audio file it reads. The
Snakefile passes it as a rule ``param``, so any change reruns exactly the shards
it touches; merge refuses a shard whose ``done`` records another one. A stage's
``fingerprint:`` config may leave out record files, audio identity or the code.
"""

from __future__ import annotations

import hashlib
import json
import os


def digest(text: str) -> str:
    return digest_bytes(text.encode("utf-8"))


def digest_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:20]


def keys_text(keys: list[str]) -> str:
    """The exact bytes of a ``split.N/keys`` file: one key per line."""
    return "\n".join(keys) + "\n" if keys else ""


def keys_digest(keys: list[str]) -> str:
    return digest(keys_text(keys))


def model_files_in(provider_config) -> list[str]:
    """Files named in a provider config: ``model_files`` entries and any string value that is a file."""
    found = []

    def walk(value):
        if isinstance(value, dict):
            for v in value.values():
                walk(v)
        elif isinstance(value, (list, tuple)):
            for v in value:
                walk(v)
        elif isinstance(value, str) and value and os.path.isfile(value):
            found.append(value)

    walk(provider_config)
    return sorted(set(found))


def model_identities(provider_config: dict) -> list[list]:
    """The identity of each file ``provider_config`` names (``model_files_in``): what the stage and training
    fingerprints hold of model files, so that a new checkpoint under the same path reruns what used it."""
    return [file_identity(path) for path in model_files_in(provider_config)]


def file_identity(path: str) -> list:
    # size + mtime, not a content hash: this runs at every Snakefile parse, and
    # hashing multi-GB checkpoints there would cost minutes.
    st = os.stat(path)
    return [os.path.abspath(path), st.st_size, st.st_mtime_ns]


def stage_fingerprint(payload: dict) -> str:
    """Fingerprint of everything but the shard's inputs: of the stage's ``stage_payload``."""
    return digest(json.dumps(payload, sort_keys=True))


def stage_payload(spec: dict, version: str, code: dict | None = None, from_model: tuple = ()) -> dict:
    """What a stage's fingerprint covers; ``spec`` is the stage's run spec (see workflow.parse.run_spec), ``code``
    the digests of the runner's and provider's source (None: left out).

    ``from_model``: an inference stage's provider_config keys that are its training stage's (see
    train_config.model_config_keys). They count through the trained model's fingerprint, which leaves out the
    training stage's ``fingerprint_ignore`` keys, not here: an ignored key's change retrains nothing and reruns no
    inference either."""
    ignored = set(spec.get("fingerprint_ignore", [])) | set(from_model)
    provider_config = {k: v for k, v in spec.get("provider_config", {}).items() if k not in ignored}
    payload = {
        "runner": spec["runner"],
        "provider": spec["provider"],
        "provider_config": provider_config,
        "batching": [spec.get("batch_size", 1), spec.get("batch_seconds"), spec.get("sort_by_length", False)],
        "outputs": spec.get("outputs") or {},
        # a chained dataset's upstream output counts per shard (shard_inputs_text), not here
        "dataset": {k: v for k, v in (spec.get("dataset") or {}).items() if k not in UPSTREAM_PLAN},
        "allow_nonfinite": spec.get("allow_nonfinite") or [],
        "snakeshard": version,
        "model_files": model_identities(provider_config),
    }
    if code is not None:
        payload["code"] = code
    if spec.get("model"):  # inference with a trained model: its training's fingerprint (a retraining reruns it)
        payload["trained_model"] = spec["model"]["fingerprint"]
    return json.loads(json.dumps(payload, default=str))  # as stored and read back (stage_history.json)


class _Unset:
    """A key one side of a config diff lacks."""

    def __repr__(self) -> str:
        return "(unset)"


UNSET = _Unset()


def differences(a: dict, b: dict, prefix: str = ""):
    """(dotted key, a's value, b's value) for each key whose values differ, descending where both are dicts;
    ``UNSET`` for a side that lacks the key."""
    for k in sorted(set(a) | set(b)):
        x, y = a.get(k, UNSET), b.get(k, UNSET)
        if isinstance(x, dict) and isinstance(y, dict):
            yield from differences(x, y, f"{prefix}{k}.")
        elif x != y:
            yield f"{prefix}{k}", x, y


def records_digest(records: dict[str, str], selected) -> str:
    """One digest over a shard's per-file record digests (see manifest.Rows.records_digests), for the ``selected``
    files."""
    return digest(json.dumps({name: d for name, d in records.items() if name in selected}, sort_keys=True))


def audio_identity(paths: list[str], stat_cache: dict) -> str:
    """Digest of (path, size, mtime) of each audio file: new content written in place changes it.

    ``stat_cache`` shares stats between stages over the same data within one parse.
    """
    parts = []
    for path in paths:
        ident = stat_cache.get(path)
        if ident is None:
            st = os.stat(path)
            ident = stat_cache[path] = f"{path}\t{st.st_size}\t{st.st_mtime_ns}\n"
        parts.append(ident)
    return digest("".join(parts))


# What a chained dataset's spec says of its upstream's plan and merge (workflow.parse.Workflow._prepare_set): not a
# setting
UPSTREAM_PLAN = ("upstream_inputs", "upstream_shards")
SHARD_INPUT_PARTS = ("stage", "keys", "records", "audio", "upstream")


def shard_inputs_text(stage_fp: str, shard_keys_digest: str, shard_records: str = "", shard_audio: str = "",
                      upstream: str = "") -> str:
    """What a shard's fingerprint is the digest of, as one shell-safe word (hex digests joined by ':').

    ``upstream``: for a chained dataset, the digest of the fingerprints of the upstream shards holding its keys.
    The shard rule passes it to the job, which digests it and records the parts in its done, so
    status can later say which part changed."""
    text = f"{stage_fp}:{shard_keys_digest}:{shard_records}:{shard_audio}"
    return f"{text}:{upstream}" if upstream else text  # unchained shards keep their fingerprints


def parse_shard_inputs(text: str) -> dict[str, str]:
    return dict(zip(SHARD_INPUT_PARTS, text.split(":")))


def shard_fingerprint(stage_fp: str, shard_keys_digest: str, shard_records: str = "", shard_audio: str = "",
                      upstream: str = "") -> str:
    return digest(shard_inputs_text(stage_fp, shard_keys_digest, shard_records, shard_audio, upstream))


def inputs_digest(shard_fps: list[str]) -> str:
    """What a merged output is made from: every shard's fingerprint, in plan order."""
    return digest(":".join(shard_fps))


def set_data_digest(shard_inputs: list[dict]) -> str:
    """What a set's shards read, less the stage (its config and code): each shard's keys, records, audio and
    upstream digests, in plan order. A training stage's spec holds it per set, beside its config and code, so that
    a refused resume says whether the data changed."""
    return digest(":".join(f"{s['keys']}:{s['records']}:{s['audio']}:{s['upstream']}" for s in shard_inputs))


def result_inputs(spec: dict) -> dict:
    """What a training stage's result depends on besides the loop config, from its spec (train.json): the spec
    less loop, fingerprint and fingerprint_ignore, with provider_config less its fingerprint_ignore keys. The
    workflow digests it into the fingerprint; a refused resume names the entries that differ."""
    ignored = set(spec.get("fingerprint_ignore") or ())
    inputs = {k: v for k, v in spec.items() if k not in ("loop", "fingerprint", "fingerprint_ignore")}
    inputs["provider_config"] = {k: v for k, v in spec["provider_config"].items() if k not in ignored}
    return inputs


def training_fingerprint(spec: dict, version: str) -> str:
    """A training stage's fingerprint: its result inputs, its loop config less ``checkpoint`` (cadence changes no
    result) and snakeshard's ``version``. The workflow computes it at parse; the job, for checkpoints an earlier
    config of the same result wrote (train.stage)."""
    loop = {k: v for k, v in spec["loop"].items() if k != "checkpoint"}
    return digest(json.dumps({**result_inputs(spec), "loop": loop, "version": version}, sort_keys=True))
