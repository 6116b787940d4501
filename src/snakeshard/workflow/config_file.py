"""The config file as the user wrote it: read (a key set twice refused, which YAML would drop silently), the
keys a project keeps for its own Snakefile set apart, and the schema's errors put as a user reads them."""

from __future__ import annotations

import os
import sys

from snakeshard.errors import ConfigError
from snakeshard.io.yaml_file import yaml_error_message


def load_config(path: str | os.PathLike) -> dict:
    import yaml

    try:
        with open(path, encoding="utf-8") as f:
            config = yaml.safe_load(f) or {}
    except FileNotFoundError:
        raise ConfigError(f"config file {path} not found") from None
    except yaml.YAMLError as e:
        raise ConfigError(yaml_error_message(path, e)) from None
    check_duplicate_keys([path])
    return config


def check_duplicate_keys(paths) -> None:
    """Refuse a key written twice in one mapping of a config file, naming file, both lines and the key's place:
    YAML loaders (Snakemake's too) keep the last one and drop the first without a word (a user trial: a second
    ``sharding:`` further down a stage silently replaced the first)."""
    import yaml

    for path in paths:
        try:
            with open(path, encoding="utf-8") as f:
                root = yaml.compose(f, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
        except (OSError, yaml.YAMLError):  # Snakemake has loaded it already, and says what is wrong with it
            continue
        todo = [(root, "")]
        while todo:
            node, where = todo.pop()
            if isinstance(node, yaml.SequenceNode):
                todo.extend((item, f"{where}[{n}]") for n, item in enumerate(node.value))
            if not isinstance(node, yaml.MappingNode):
                continue
            first: dict[str, int] = {}
            for key, value in node.value:
                name = f"{where}.{key.value}" if where else str(key.value)
                line = key.start_mark.line + 1
                if key.value in first and key.value != "<<":
                    raise ConfigError(f"{path}:{line}: {name} is set twice (first at line {first[key.value]}); YAML "
                                      "keeps the last one and drops the first without a word: remove one")
                first.setdefault(key.value, line)
                todo.append((value, name))


def without_project_keys(config: dict, path: str | os.PathLike) -> dict:
    """``config`` less the top-level keys snakeshard's schema does not define, for the commands that read a project's
    config file themselves (``snakeshard status``, ``plan``). A project's Snakefile may keep keys of its own there
    for its own rules and hand the module the rest (the digits recipe's ``fsdd:``). A key close to one of
    snakeshard's is left out the same way, and may be a misspelt one (snakemake's parse refuses it): a note on
    stderr names it with the key it is close to. Others go without a word (a trial: the recipe's own ``fsdd:``
    was noted at every `snakeshard plan`)."""
    import difflib

    from snakeshard.resources import load_schema

    if not isinstance(config, dict):  # validate_config names what it is
        return config
    known = load_schema()["properties"]
    for key in config:
        close = [] if key in known else difflib.get_close_matches(str(key), known, n=1)
        if close:
            print(f"note: {path}: {key!r} left out: not snakeshard's (did you mean {close[0]!r}? a misspelt key is "
                  "refused when snakemake parses the config)", file=sys.stderr)
    return {key: value for key, value in config.items() if key in known}


def schema_messages(errors: list) -> list[tuple]:
    """(error, message) for the schema's errors as a user reads them: a misspelt key with the key it is close to;
    a "not valid under any of the given schemas" (a stage that is none of the kinds of stage), which quotes the
    whole stage, replaced by the error of the kind it comes closest to (jsonschema's best_match)."""
    import difflib

    from jsonschema.exceptions import best_match

    out, seen = [], set()
    for err in errors:
        if err.validator in ("oneOf", "anyOf") and err.context:
            err = best_match(err.context)
        if (tuple(err.absolute_path), err.message) in seen:
            continue
        seen.add((tuple(err.absolute_path), err.message))
        message = err.message
        if err.validator == "additionalProperties" and isinstance(err.instance, dict):
            known = list(err.schema.get("properties", {}))
            for key in err.instance:
                close = difflib.get_close_matches(str(key), known, n=1) if key not in known else []
                if close:
                    message += f"; {key!r}: did you mean {close[0]!r}?"
        out.append((err, message))
    return out
