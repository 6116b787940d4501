"""The config reference: docs/config.md is what workflow/schemas/config.schema.yaml renders (the schema is its one
source), and the schema gives every key a meaning and a default, the defaults the code uses."""

from __future__ import annotations

from conftest import PROJECT


def schema_keys(obj: dict, prefix: str = ""):
    """(dotted key, schema, required by its object) of every key of the config schema, nested ones too."""
    required = set(obj.get("required", ()))
    for key, sub in obj.get("properties", {}).items():
        yield f"{prefix}{key}", sub, key in required
        value = sub.get("additionalProperties")
        if isinstance(value, dict):
            yield from schema_keys(value, f"{prefix}{key}.<name>.")
        if sub.get("properties"):
            yield from schema_keys(sub, f"{prefix}{key}.")


def test_docs_config_md_is_what_the_schema_renders():
    """docs/config.md is generated from workflow/schemas/config.schema.yaml, its one source."""
    from snakeshard.workflow.config_reference import COMMAND, render

    assert (PROJECT / "docs/config.md").read_text() == render(), (
        f"docs/config.md differs from what the config schema renders: run `{COMMAND}` (and commit docs/config.md)")


def test_every_schema_key_has_a_meaning_and_a_default():
    """Each key's description, and its default (a value, or an x-default sentence, or required by its object);
    a default value passes the key's own schema."""
    import jsonschema

    from snakeshard.resources import load_schema

    keys = list(schema_keys(load_schema()))
    assert len(keys) > 80
    assert [key for key, sub, _ in keys if not sub.get("description")] == []
    assert [key for key, sub, required in keys if not ("default" in sub or "x-default" in sub or required)] == []
    for key, sub, _ in keys:
        if "default" in sub:
            jsonschema.Draft202012Validator(sub).validate(sub["default"])


def test_schema_defaults_are_the_codes():
    """The defaults the schema states are those the code uses when a key is left out."""
    from snakeshard.train import loop
    from snakeshard.train.schedule import lr_lambda
    from snakeshard.workflow import parse
    from snakeshard.resources import load_schema

    schema = load_schema()
    stage = schema["properties"]["stages"]["additionalProperties"]["properties"]

    def defaults(obj):
        return {key: sub["default"] for key, sub in obj["properties"].items() if "default" in sub}

    assert schema["properties"]["canary"]["default"] == parse.DEFAULT_CANARY
    resources = parse.stage_resources({"stages": {"s": {}}}, "s")
    assert defaults(stage["resources"]) == {"mem_mb": resources["mem_mb"], "runtime": resources["runtime"],
                                            "gpu": parse.requested_gpus({})}
    assert stage["resources"]["properties"]["cpus_per_task"]["x-default"] == (
        f"workers (a training stage: ranks), else {resources['cpus_per_task']}")
    assert stage["retries"]["default"] == resources["retries"]
    assert defaults(stage["fingerprint"]) == parse.FINGERPRINT_DEFAULTS
    assert defaults(stage["checkpoint"]) == {**loop.DEFAULTS["checkpoint"], "signal_seconds": parse.SIGNAL_SECONDS}
    for key in ("seed", "accum_steps", "skip_nonfinite"):
        assert stage[key]["default"] == loop.DEFAULTS[key], key
    keyword = lr_lambda.__kwdefaults__
    assert defaults(stage["schedule"]) == {k: keyword[k] for k in ("strategy", "min_lr")}
    from snakeshard.core import plan

    assert stage["shards_per_job"]["default"] == plan.AUTO
    assert f"{plan.AUTO_ITEMS} items or {plan.AUTO_SECONDS:.0f} s of audio" in stage["shards_per_job"]["description"]
    assert f"at least {plan.AUTO_MIN_JOBS} jobs" in stage["shards_per_job"]["description"]
