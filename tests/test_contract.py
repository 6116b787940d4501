"""The runner/provider contract: env injection by name, hooks, batches, in-process calls."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest

from snakeshard import BaseRunner, EnvironmentProvider, InferenceProvider
from snakeshard.core.fingerprint import keys_digest
from snakeshard.core.hooks import RESERVED_ENV_NAMES
from snakeshard.errors import ContractError, ShardError

KEYS = [f"k{i}" for i in range(7)]


class DictProvider(EnvironmentProvider):
    """Hands out ``config`` itself as the env."""

    def build_env_local(self):
        return dict(self.config)


class UpperRunner(BaseRunner):
    @staticmethod
    def forward(key, *, suffix=""):
        return {"text": key.upper() + suffix}


class NeedsModel(BaseRunner):
    @staticmethod
    def forward(key, *, model, dataset):
        return {"text": model(key)}


class TakesAll(BaseRunner):
    @staticmethod
    def forward(key, **env):
        return {"names": ",".join(sorted(env))}


class PicksOne(BaseRunner):
    @staticmethod
    def forward(key, *, wanted, optional="dflt"):
        return {"text": f"{wanted}-{optional}"}


class PlainMethod(BaseRunner):
    def forward(self, key):
        return {"text": key}


class ClassMethod(BaseRunner):
    @classmethod
    def forward(cls, key):
        return {"text": key}


class FirstParamClash(BaseRunner):
    @staticmethod
    def forward(key, *, model):
        return {"text": key}


class BatchRecorder(BaseRunner):
    batch_size = 3

    @staticmethod
    def forward(batch, *, seen):
        seen.append(list(batch))
        return [{"text": k.upper()} for k in batch]


class BatchDropsOne(BaseRunner):
    batch_size = 3

    @staticmethod
    def forward(batch):
        return [{"text": k} for k in batch[:-1]] if "k4" in batch else [{"text": k} for k in batch]


class BatchReturnsDict(BaseRunner):
    @staticmethod
    def forward(batch):
        return {k: {"text": k} for k in batch}


class CountingRunner(BaseRunner):
    """Counts items and seconds in its state; writes stats.json in finalize_state; logs every hook call."""

    @staticmethod
    def init_state(*, calls, **env):
        calls.append("init_state")
        return {"items": 0, "chars": 0}

    @staticmethod
    def forward(key, *, calls):
        calls.append(f"forward {key}")
        return {"text": key.upper()}

    @staticmethod
    def reduce_state(state, result, *, calls, **env):
        calls.append(f"reduce_state {result['key']}")
        return {"items": state["items"] + 1, "chars": state["chars"] + len(result["text"])}

    @staticmethod
    def write_record(writers, result, state, *, calls, **env):
        calls.append(f"write_record {result['key']} items={state['items']}")
        writers.write(result)

    @staticmethod
    def close_writers(writers, state, *, calls, **env):
        calls.append("close_writers")
        return writers.close()

    @staticmethod
    def finalize_state(state, shard_dir, *, calls, **env):
        calls.append("finalize_state")
        if shard_dir is not None:
            Path(shard_dir, "stats.json").write_text(json.dumps(state))


class Fails(BaseRunner):
    @staticmethod
    def forward(key):
        if key == "k3":
            raise ValueError("bad audio")
        return {"text": key}


class ReturnsString(BaseRunner):
    @staticmethod
    def forward(key):
        return key.upper()


class ReturnsOtherKey(BaseRunner):
    @staticmethod
    def forward(key):
        return {"key": "zzz", "text": key}


class ReturnsNewline(BaseRunner):
    @staticmethod
    def forward(key):
        return {"text": "two\nlines" if key == "k2" else key}


class ReturnsSet(BaseRunner):
    @staticmethod
    def forward(key):
        return {"scores": {1, 2}}


class ReturnsDoneField(BaseRunner):
    @staticmethod
    def forward(key):
        return {"done": "yes"}


def qualified(cls) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def listing(d: Path) -> list[str]:
    return sorted(str(p.relative_to(d)) for p in d.rglob("*"))


# -- env injection ---------------------------------------------------------------------------------

def test_missing_env_name_names_key_and_runner(tmp_path):
    """forward asks for env 'model' the provider lacks: ContractError naming 'model', the runner class and the env it got."""
    runner = NeedsModel(DictProvider({"dataset": {}, "decoder": 1}), output_dir=tmp_path / "out")
    with pytest.raises(ContractError) as e:
        runner(KEYS)
    msg = str(e.value)
    assert f"{qualified(NeedsModel)}.forward needs env key 'model'" in msg
    assert "['dataset', 'decoder']" in msg


def test_contract_error_leaves_previous_shard_output_alone(tmp_path):
    """Runs a good runner into a dir, then one missing an env name into the same dir: error, old files byte-identical."""
    out = tmp_path / "out"
    UpperRunner(DictProvider({}), output_dir=out)(KEYS)
    before = {p: (out / p).read_bytes() for p in listing(out)}
    with pytest.raises(ContractError, match="needs env key 'model'"):
        NeedsModel(DictProvider({"dataset": {}}), output_dir=out)(KEYS)
    assert {p: (out / p).read_bytes() for p in listing(out)} == before


def test_a_provider_that_builds_no_dict_is_named_and_loses_nothing(tmp_path):
    """build_env_local returning None (a forgotten return): a ContractError saying what the provider built and what
    it must return (was: TypeError: 'NoneType' object is not iterable, from inside snakeshard; a code review);
    the shard dir's earlier output stays."""
    class Forgetful(EnvironmentProvider):
        def build_env_local(self):
            {"suffix": "!"}  # noqa: B018 -- the missing return under test

    out = tmp_path / "out"
    UpperRunner(DictProvider({}), output_dir=out)(KEYS)
    before = {p: (out / p).read_bytes() for p in listing(out)}
    with pytest.raises(ContractError, match=r"the provider built NoneType, not an env \(a dict of the names "
                                            r".*UpperRunner\.forward takes\): its build_env_local .* must return a dict"):
        UpperRunner(Forgetful({}), output_dir=out)(KEYS)
    assert {p: (out / p).read_bytes() for p in listing(out)} == before


@pytest.mark.parametrize("name", sorted(RESERVED_ENV_NAMES))
def test_env_key_clashing_with_reserved_name(name, tmp_path):
    """The provider's env holds a reserved hook name (state, writers, ...): ContractError naming it and the runner."""
    with pytest.raises(ContractError) as e:
        UpperRunner(DictProvider({name: 1}), output_dir=tmp_path)(KEYS)
    assert f"env key {name!r}" in str(e.value)
    assert qualified(UpperRunner) in str(e.value)
    assert not (tmp_path / "done").exists()


def test_env_key_clashing_with_first_forward_parameter():
    """The env holds 'key', the name of forward's first parameter: ContractError naming 'key'."""
    with pytest.raises(ContractError, match=r"env key 'key' clashes with the first parameter of .*FirstParamClash\.forward"):
        FirstParamClash(DictProvider({"key": 1, "model": 2}))(KEYS)


def test_var_keyword_forward_receives_every_env_entry():
    """forward(key, **env) over a 3-entry env: every result lists all 3 names."""
    results = TakesAll(DictProvider({"a": 1, "model": 2, "dataset": 3}))(KEYS[:2])
    assert results == [{"names": "a,dataset,model", "key": "k0"}, {"names": "a,dataset,model", "key": "k1"}]


def test_named_parameters_receive_only_their_entries_and_defaults_apply():
    """forward(key, *, wanted, optional='dflt') with extra env entries: extras not passed, default used when absent."""
    assert PicksOne(DictProvider({"wanted": "w", "extra": 1}))(["k0"]) == [{"text": "w-dflt", "key": "k0"}]
    assert PicksOne(DictProvider({"wanted": "w", "optional": "o"}))(["k0"]) == [{"text": "w-o", "key": "k0"}]


@pytest.mark.parametrize("runner_cls", [PlainMethod, ClassMethod])
def test_forward_not_a_staticmethod(runner_cls, tmp_path):
    """forward defined as a plain method or a classmethod: ContractError '<runner>.forward must be a @staticmethod'."""
    with pytest.raises(ContractError, match=rf"{qualified(runner_cls)}\.forward must be a @staticmethod"):
        runner_cls(DictProvider({}), output_dir=tmp_path)(KEYS)
    assert not (tmp_path / "done").exists()


# -- batches ---------------------------------------------------------------------------------------

def test_batch_size_forward_receives_lists(tmp_path):
    """batch_size 3 over 7 keys: forward gets [k0..k2], [k3..k5], [k6]; text holds all 7 keys in order."""
    seen = []
    done = BatchRecorder(DictProvider({"seen": seen}), output_dir=tmp_path)(KEYS)
    assert seen == [KEYS[0:3], KEYS[3:6], KEYS[6:]]
    assert (tmp_path / "text").read_text() == "".join(f"{k} {k.upper()}\n" for k in KEYS)
    assert done["items"] == 7


def test_batch_size_constructor_argument_overrides_class(tmp_path, capsys):
    """BatchRecorder (class batch_size 3) built with batch_size=2: forward gets pairs. In-process, the batch plan's
    line is printed only with progress on (a notebook's every call printed it: a user trial)."""
    seen = []
    BatchRecorder(DictProvider({"seen": seen}), output_dir=tmp_path, batch_size=2)(KEYS[:5])
    assert seen == [["k0", "k1"], ["k2", "k3"], ["k4"]]
    assert capsys.readouterr().err == ""
    BatchRecorder(DictProvider({"seen": []}), output_dir=tmp_path / "p", batch_size=2, progress=True)(KEYS[:5])
    assert "shard 0: 5 items in 3 batches (batch_size 2)" in capsys.readouterr().err


def test_batch_wrong_length_return_names_the_batch(tmp_path):
    """A batch forward returns 2 results for the 3 keys k3..k5: ShardError naming 'k3'..'k5' and both counts; no done."""
    with pytest.raises(ShardError) as e:
        BatchDropsOne(DictProvider({}), output_dir=tmp_path)(KEYS)
    assert "batch 'k3'..'k5': forward returned 2 results for 3 keys" in str(e.value)
    assert not (tmp_path / "done").exists()


def test_batch_non_list_return_names_the_batch(tmp_path):
    """A batch forward returns a dict instead of a list: ShardError naming the batch and the type."""
    with pytest.raises(ShardError, match=r"batch 'k0'..'k1': forward returned dict results for 2 keys"):
        BatchReturnsDict(DictProvider({}), output_dir=tmp_path, batch_size=2)(KEYS)


# -- in-process calls ------------------------------------------------------------------------------

def test_in_process_call_with_output_dir_writes_text_and_done(tmp_path):
    """Runner(provider, output_dir=tmp)(keys): text holds 'key VALUE' lines in order, done records the shard."""
    out = tmp_path / "shard"
    done = UpperRunner(DictProvider({"suffix": "!"}), output_dir=out)(KEYS)
    assert (out / "text").read_bytes() == "".join(f"{k} {k.upper()}!\n" for k in KEYS).encode()
    on_disk = json.loads((out / "done").read_text())
    assert on_disk == done
    assert on_disk["items"] == 7
    assert on_disk["keys_digest"] == keys_digest(KEYS)
    assert on_disk["fragments"] == ["text"]


def test_in_process_call_without_output_dir_returns_results_and_writes_nothing(tmp_path, monkeypatch):
    """Runner(provider)(keys) without output_dir: returns one result dict per key in order, creates no file."""
    monkeypatch.chdir(tmp_path)
    results = UpperRunner(DictProvider({}))(KEYS[:3])
    assert results == [{"text": "K0", "key": "k0"}, {"text": "K1", "key": "k1"}, {"text": "K2", "key": "k2"}]
    assert listing(tmp_path) == []


def test_rerun_into_same_dir_clears_old_fragments(tmp_path):
    """Runs a runner writing 'names', then one writing 'text', into one dir: the stale 'names' file is gone, keys kept."""
    out = tmp_path / "shard"
    out.mkdir()
    (out / "keys").write_text("k0\n")
    TakesAll(DictProvider({"a": 1}), output_dir=out)(["k0"])
    assert (out / "names").is_file()
    UpperRunner(DictProvider({}), output_dir=out)(["k0"])
    assert not (out / "names").exists()
    assert (out / "keys").read_text() == "k0\n"
    assert json.loads((out / "done").read_text())["fragments"] == ["text"]


# -- state hooks -----------------------------------------------------------------------------------

def test_state_hooks_called_in_order_and_stats_written(tmp_path):
    """A runner counting items in its state: hooks run init, (forward, reduce, write)*, close, finalize; stats.json = 3 items."""
    calls = []
    out = tmp_path / "shard"
    done = CountingRunner(DictProvider({"calls": calls}), output_dir=out)(KEYS[:3])
    per_item = []
    for n, k in enumerate(KEYS[:3], 1):
        per_item += [f"forward {k}", f"reduce_state {k}", f"write_record {k} items={n}"]
    assert calls == ["init_state", *per_item, "close_writers", "finalize_state"]
    assert json.loads((out / "stats.json").read_text()) == {"items": 3, "chars": 6}
    assert done["fragments"] == ["text"]  # stats.json is not a per-key fragment
    assert (out / "text").read_text() == "k0 K0\nk1 K1\nk2 K2\n"


def test_state_hooks_without_output_dir(tmp_path, monkeypatch):
    """The counting runner in-process without output_dir: init/reduce run, finalize_state (which writes) does not, no file."""
    monkeypatch.chdir(tmp_path)
    calls = []
    results = CountingRunner(DictProvider({"calls": calls}))(KEYS[:2])
    assert [r["key"] for r in results] == ["k0", "k1"]
    assert calls == ["init_state", "forward k0", "reduce_state k0", "forward k1", "reduce_state k1"]
    assert listing(tmp_path) == []


# -- providers -------------------------------------------------------------------------------------

class CountingProvider(InferenceProvider):
    builds = 0

    def build_env(self):
        type(self).builds += 1
        return {"suffix": f"#{type(self).builds}"}


def test_inference_provider_builds_env_once_across_calls(tmp_path):
    """Two in-process calls on one InferenceProvider: build_env runs once, both calls see the same env."""
    CountingProvider.builds = 0
    provider = CountingProvider({})
    runner = UpperRunner(provider)
    assert runner(["a"]) == [{"text": "A#1", "key": "a"}]
    assert UpperRunner(provider, output_dir=tmp_path)(["b"])["items"] == 1
    assert (tmp_path / "text").read_text() == "b B#1\n"
    assert CountingProvider.builds == 1
    # a shard job's setup function builds afresh (one per job process)
    assert provider.build_worker_setup_fn()() == {"suffix": "#2"}


def test_environment_provider_without_build_env_local_names_class():
    """A provider subclass that implements nothing: NotImplementedError naming the subclass."""
    class Bare(EnvironmentProvider):
        pass

    with pytest.raises(NotImplementedError, match="Bare must implement build_env_local"):
        UpperRunner(Bare({}))(["a"])


# -- bad results -----------------------------------------------------------------------------------

def test_forward_exception_names_item_and_shard(tmp_path):
    """forward raises ValueError on k3: ShardError naming shard 0, item 'k3' and the exception; no done."""
    with pytest.raises(ShardError, match=r"shard 0: item 'k3' failed: ValueError: bad audio") as e:
        Fails(DictProvider({}), output_dir=tmp_path)(KEYS)
    assert isinstance(e.value.__cause__, ValueError)
    assert not (tmp_path / "done").exists()


class BatchFails(BaseRunner):
    batch_size = 3

    @staticmethod
    def forward(batch):
        if "k4" in batch:
            raise ValueError("bad batch")
        return [{"text": k} for k in batch]


def test_batch_forward_exception_names_the_batch(tmp_path):
    """A batch forward raises on the batch k3..k5: ShardError naming its first/last key and size; earlier batches kept."""
    with pytest.raises(ShardError, match=r"shard 0: batch 'k3'..'k5' \(3 keys\) failed: ValueError: bad batch"):
        BatchFails(DictProvider({}), output_dir=tmp_path)(KEYS)
    assert not (tmp_path / "done").exists()


def test_forward_exception_deep_in_a_slice_names_that_item(tmp_path):
    """Items run in growing slices: a failure at item 300 of 1000 still names exactly that key."""
    keys = [f"u{i:04d}" for i in range(1000)]

    class FailsAt300(BaseRunner):
        @staticmethod
        def forward(key):
            if key == "u0300":
                raise RuntimeError("boom")
            return {"text": key}

    with pytest.raises(ShardError, match=r"item 'u0300' failed: RuntimeError: boom"):
        FailsAt300(DictProvider({}), output_dir=tmp_path)(keys)


@pytest.mark.parametrize("runner_cls, message", [
    (ReturnsString, r"item 'k0': forward returned str, expected a dict of fields"),
    (ReturnsOtherKey, r"item 'k0': forward returned a result for key 'zzz'"),
    (ReturnsNewline, r"item 'k2'.*field 'text' holds a line break \('\\n'\)"),
    (ReturnsSet, r"item 'k0'.*field 'scores' is a set; the default writers take"),
    (ReturnsDoneField, r"item 'k0'.*result field 'done' cannot be used as a file name"),
])
def test_bad_forward_results(runner_cls, message, tmp_path):
    """forward returns a non-dict, another key, a newline, a set value or a 'done' field: ShardError naming the item; no done."""
    with pytest.raises(ShardError, match=message):
        runner_cls(DictProvider({}), output_dir=tmp_path)(KEYS)
    assert not (tmp_path / "done").exists()


class MixedFields(BaseRunner):
    @staticmethod
    def forward(key):
        n = int(key[1:])
        if n == 700:
            return {"n": n, "f": n / 8, "b": n % 2 == 0, "s": "x y"}  # a value with a space
        return {"n": n, "f": n / 8, "b": n % 2 == 0, "s": f"{key} z"}


class MixedFieldsPerItem(MixedFields):
    @staticmethod
    def reduce_state(state, result):  # any reduce_state keeps the per-item path
        return state


def test_bulk_and_per_item_writes_give_identical_bytes(tmp_path):
    """int/float/bool/str fields over 2000 keys: the sliced bulk path writes the same bytes as the per-item path."""
    keys = [f"k{i}" for i in range(2000)]
    bulk = MixedFields(DictProvider({}), output_dir=tmp_path / "bulk")(keys)
    per_item = MixedFieldsPerItem(DictProvider({}), output_dir=tmp_path / "item")(keys)
    assert bulk["fragments"] == per_item["fragments"] == ["b", "f", "n", "s"]
    for name in bulk["fragments"]:
        assert (tmp_path / "bulk" / name).read_bytes() == (tmp_path / "item" / name).read_bytes()
    assert (tmp_path / "bulk/f").read_text().splitlines()[700] == "k700 87.5"
    assert (tmp_path / "bulk/b").read_text().splitlines()[3] == "k3 False"


def _plain(key): ...
def _named(key, *, model, dataset): ...
def _any(key, **env): ...
def _defaults(key, *, wanted, optional="dflt"): ...
def _everything(key, a, b=1, *args, c, d=2, **kw): ...
def _positional_only(key, /, model, extra=None): ...
def _star_keys(*keys, model): ...
def _nothing(): ...
def _all_defaulted(key=None, model=None): ...


def _decorated(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        return fn(*args, **kwargs)
    return wrapper


@pytest.mark.parametrize("forward", [
    _plain, _named, _any, _defaults, _everything, _positional_only, _star_keys, _nothing, _all_defaulted,
    lambda batch, *, seen: None, _decorated(_named), functools.partial(_everything, c=3), print,
], ids=lambda f: getattr(f, "__name__", type(f).__name__))
def test_forward_parameters_read_from_code_agree_with_inspect(forward):
    """hooks.forward_parameters reads a plain function's parameters from its code object (inspect's
    import costs every shard job ~10 ms) and what it reads equals what inspect.signature gives: the first
    positional parameter, the names after it, the ones without a default, whether **env is taken. A decorated
    function, a partial or a builtin goes through inspect itself."""
    from snakeshard.core.hooks import _parameters_by_inspect, forward_parameters

    try:
        expected = _parameters_by_inspect(forward)
    except ValueError:  # a builtin without a signature: neither can say, and both say so the same way
        with pytest.raises(ValueError):
            forward_parameters(forward)
        return
    assert forward_parameters(forward) == expected


def test_the_built_in_providers_declare_the_provider_config_keys_they_take():
    """Each built-in provider's ``config_keys`` literal (what the parse checks a stage's provider_config against)
    is what its code takes: a key added to the code and not to the literal would be refused at parse."""
    from snakeshard.stages.collect_stats import CollectStatsProvider
    from snakeshard.stages.fbank import DEFAULTS, FbankProvider
    from snakeshard.stages.vad import SEGMENT_OPTIONS, SileroVadProvider

    assert set(FbankProvider.config_keys) == {*DEFAULTS, *FbankProvider.reads_upstream_merge}
    assert set(CollectStatsProvider.config_keys) == {*DEFAULTS, "frontend", "feats_field", "write_collected_feats"}
    assert set(SileroVadProvider.config_keys) == {*SEGMENT_OPTIONS, "threads"}
