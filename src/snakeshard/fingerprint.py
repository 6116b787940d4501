"""Fingerprints: what a shard's result depends on, as a short hex digest.

A stage fingerprint covers the runner and provider import paths, the provider
config (less the keys the stage lists in ``fingerprint_ignore``: options such as
worker counts or fault injection that do not change results), batch size, the
dataset spec, snakeshard's version and the identity
(path, size, mtime) of every model file named in the provider config. A shard's
fingerprint adds the digest of its keys. The Snakefile passes it as a rule
``param``, so a change reruns the shard; merge refuses a shard whose ``done``
records another one.
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


def file_identity(path: str) -> list:
    # size + mtime, not a content hash: this runs at every Snakefile parse, and
    # hashing multi-GB checkpoints there would cost minutes.
    st = os.stat(path)
    return [os.path.abspath(path), st.st_size, st.st_mtime_ns]


def stage_fingerprint(spec: dict, version: str) -> str:
    """Fingerprint of everything but the keys; ``spec`` is the stage's run spec (see workflow.py)."""
    ignored = set(spec.get("fingerprint_ignore", []))
    provider_config = {k: v for k, v in spec.get("provider_config", {}).items() if k not in ignored}
    payload = {
        "runner": spec["runner"],
        "provider": spec["provider"],
        "provider_config": provider_config,
        "batch_size": spec.get("batch_size", 1),
        "dataset": spec.get("dataset"),
        "snakeshard": version,
        "model_files": [file_identity(p) for p in model_files_in(provider_config)],
    }
    return digest(json.dumps(payload, sort_keys=True, default=str))


def shard_fingerprint(stage_fp: str, shard_keys_digest: str) -> str:
    return digest(f"{stage_fp}:{shard_keys_digest}")
