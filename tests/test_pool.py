"""snakeshard.pool: easycore's runner API, every failure easycore hangs on, each under a timeout.

Each scenario runs in a fresh Python process (``python -c``) killed after LIMIT seconds, so a hang fails
the test instead of stalling the suite, and a pool left open at exit is caught too (the process must end).
The runner classes live in tests/pool_cases.py: spawned workers import them from there.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
LIMIT = 60  # seconds a scenario may take, start-up of its worker processes included


def scenario(code: str, limit: float = LIMIT) -> tuple[dict, float]:
    """Run ``code`` (which sets ``out``, a JSON-able dict) in a fresh interpreter; return (out, wall seconds)."""
    script = "import json, sys\nsys.path.insert(0, %r)\n" % str(TESTS) + textwrap.dedent(code) + \
        "\nprint('OUT ' + json.dumps(out))\n"
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=limit)
    wall = time.monotonic() - t0
    lines = [line for line in proc.stdout.splitlines() if line.startswith("OUT ")]
    assert proc.returncode == 0 and lines, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return json.loads(lines[-1][4:]), wall


@pytest.mark.parametrize("workers", [1, 2, 4])
def test_ordered_output_equals_sequential(workers):
    out, _ = scenario(f"""
        from pool_cases import Square
        with Square({workers}, {{"jitter": True}}) as runner:
            first = runner(range(40))
            second = runner(iter(range(5)))      # the same workers serve a second call
        out = {{"values": [v for v, _, _ in first], "pids": len({{p for _, p, _ in first}}),
               "second": [v for v, _, _ in second], "closed": not runner.is_activate}}
    """)
    assert out["values"] == [i * i for i in range(40)] and out["second"] == [0, 1, 4, 9, 16]
    assert out["pids"] == workers and out["closed"]


def test_items_are_handed_out_evenly_when_there_are_few():
    """Items go one at a time to the worker holding fewest: 4 items over 2 workers are 2 each. (Filling one
    worker's 3 prefetch slots first gave 3 and 1: a small shard ran at the speed of one worker.)"""
    out, _ = scenario("""
        from collections import Counter
        from pool_cases import Square
        with Square(2, {}) as runner:
            got = runner(range(4))
        out = {"values": [v for v, _, _ in got], "per_worker": sorted(Counter(p for _, p, _ in got).values())}
    """)
    assert out["values"] == [0, 1, 4, 9] and out["per_worker"] == [2, 2]


def test_unordered_yields_every_item_exactly_once():
    out, _ = scenario("""
        from pool_cases import UnorderedSquare
        with UnorderedSquare(["cpu", "cpu", "cpu"], {"jitter": True}) as runner:
            got = runner(range(60))
        out = {"values": [v for v, _, _ in got], "devices": sorted({d for _, _, d in got})}
    """)
    assert sorted(out["values"]) == [i * i for i in range(60)] and out["devices"] == ["cpu"]


@pytest.mark.parametrize("cls", ["RaiseOn", "KillOn"])
def test_a_failing_producer_raises_in_the_caller_naming_item_device_and_cause(cls):
    """A producer that raises (traceback included), or is killed by SIGKILL mid-item: the call raises
    within a second of the failure, naming the item and the device; the other workers are stopped."""
    out, wall = scenario(f"""
        import time
        from snakeshard.pool import PoolError
        from pool_cases import {cls}
        runner = {cls}(["cpu", "cpu"], {{"bad": 13}})
        runner(range(4))                          # workers up (spawn start-up is not the failure's time)
        pids = [w.process.pid for w in runner._workers]
        t0 = time.monotonic()
        try:
            runner(range(100))
        except PoolError as e:
            out = {{"error": str(e), "seconds": time.monotonic() - t0}}
        import psutil
        out["alive"] = [psutil.pid_exists(p) and psutil.Process(p).status() != "zombie" for p in pids]
        out["active"] = runner.is_activate
        runner.close()                            # idempotent after a failure
        runner.close()
    """)
    assert "item 13" in out["error"] and "(cpu)" in out["error"]
    if cls == "RaiseOn":
        assert "ValueError: cannot square 13" in out["error"] and "Traceback" in out["error"]
    else:
        assert "was killed by SIGKILL" in out["error"] and "while holding item 13" in out["error"]
    assert out["seconds"] < 1.5, out["seconds"]  # items take 10 ms each: the failure comes at ~0.1 s
    assert out["alive"] == [False, False] and out["active"] is False


def test_a_consumer_that_raises_propagates_and_close_returns():
    out, _ = scenario("""
        from pool_cases import ConsumerRaises
        runner = ConsumerRaises(2)
        try:
            runner(range(10))
        except KeyError as e:
            out = {"error": str(e)}
        runner.close()
        out["active"] = runner.is_activate
    """)
    assert out == {"error": "'consumer refuses 9'", "active": False}


def test_producer_init_failure_names_the_device():
    out, _ = scenario("""
        from snakeshard.pool import PoolError
        from pool_cases import InitFails
        try:
            InitFails(["cpu"])(range(3))
        except PoolError as e:
            out = {"error": str(e)}
    """)
    assert "worker 0 (cpu) failed to start: producer_init raised" in out["error"]
    assert "RuntimeError: no model for cpu" in out["error"]


def test_an_item_over_its_timeout_fails_naming_it():
    out, wall = scenario("""
        from snakeshard.pool import PoolError
        from pool_cases import HangOn
        runner = HangOn(2, {"bad": 5}, item_timeout=2)
        try:
            runner(range(10))
        except PoolError as e:
            out = {"error": str(e)}
    """)
    assert "item 5 is still running after 2 s (item_timeout)" in out["error"]
    assert wall < 30


def test_a_worker_stuck_in_producer_init_fails_after_init_timeout_naming_its_device():
    """A producer_init that hangs (60 s) with init_timeout=2: the call fails at ~2 s naming the worker, its device
    and producer_init, and every worker is stopped. item_timeout (set here too) does not count start-up."""
    out, wall = scenario("""
        import time
        import psutil
        from snakeshard.pool import PoolError
        from pool_cases import SlowInit
        t0 = time.monotonic()
        runner = SlowInit(["cpu", "meta"], {"slow": "meta", "init_s": 60}, item_timeout=1, init_timeout=2)
        pids = [w.process.pid for w in runner._workers]
        try:
            runner(range(10))
        except PoolError as e:
            out = {"error": str(e), "seconds": time.monotonic() - t0}
        out["alive"] = [psutil.pid_exists(p) and psutil.Process(p).status() != "zombie" for p in pids]
        out["active"] = runner.is_activate
    """, limit=30)
    assert "worker 1 (meta) is still starting (producer_init) after 2 s (init_timeout)" in out["error"]
    assert 2 <= out["seconds"] < 5, out["seconds"]
    assert out["alive"] == [False, False] and out["active"] is False


def test_item_timeout_does_not_count_a_workers_start_up():
    """Loading a model may take far longer than an item: a 2 s producer_init under item_timeout=0.5 is no
    failure (init_timeout, unset here, is the start-up's limit)."""
    out, _ = scenario("""
        from pool_cases import SlowInit
        with SlowInit(["cpu", "meta"], {"slow": "meta", "init_s": 2}, item_timeout=0.5) as runner:
            got = runner(range(6))
        out = {"values": [v for v, _, _ in got], "devices": sorted({d for _, _, d in got})}
    """)
    assert out == {"values": [0, 1, 4, 9, 16, 25], "devices": ["cpu", "meta"]}


def test_an_unpicklable_result_is_an_error_not_a_hang():
    out, _ = scenario("""
        from snakeshard.pool import PoolError
        from pool_cases import Unpicklable
        try:
            Unpicklable(1)(range(3))
        except PoolError as e:
            out = {"error": str(e)}
    """)
    assert "failed on item 0" in out["error"] and "could not be sent to the caller" in out["error"]


@pytest.mark.parametrize("devices, message", [
    ('"cuda:0"', "devices='cuda:0' is a string: give a list of devices (['cuda:0'])"),
    ("0", "devices=0: at least one worker"),
    ("[]", "devices must be a non-empty list of device strings"),
])
def test_bad_devices_are_refused(devices, message):
    out, _ = scenario(f"""
        from pool_cases import Square
        try:
            Square({devices})
        except (TypeError, ValueError) as e:
            out = {{"error": str(e)}}
    """)
    assert message in out["error"]


def test_close_lets_workers_end_and_a_pool_left_open_does_not_hang_exit(tmp_path):
    """close() runs producer_end in every worker; a pool never closed is stopped at interpreter exit
    (the scenario's process must end within the limit)."""
    out, _ = scenario(f"""
        from pool_cases import EndWrites, Square
        with EndWrites(2, {{"end_dir": {str(tmp_path)!r}}}) as runner:
            runner(range(8))
        leaked = Square(2)
        leaked(range(8))                          # never closed
        out = {{"ok": True}}
    """)
    assert out == {"ok": True}
    assert sorted(p.read_text() for p in tmp_path.glob("*.end")) == ["cpu", "cpu"]


def test_devices_list_gives_each_worker_its_device():
    out, _ = scenario("""
        from pool_cases import Square
        with Square(["cpu", "meta", "cpu"]) as runner:
            got = runner(range(30))
        out = {"devices": sorted({d for _, _, d in got})}
    """)
    assert out["devices"] == ["cpu", "meta"]


# -- the pool in shard jobs: stage options workers / devices / worker_order / item_timeout --

from conftest import copy_workflow, read_config, run_cli, run_snakemake, write_config  # noqa: E402


def test_asr_demo_with_two_workers_is_byte_identical_to_one(tmp_path):
    """workers: 2 (ordered and unordered) over the ASR demo: merged text byte-identical to the plain stage."""
    wd = copy_workflow(tmp_path / "wf")
    config = read_config(wd)
    asr = {**config["stages"]["asr"], "resources": {"mem_mb": 1000, "runtime": 10}}
    config["stages"] = {"asr": asr, "asr_ordered": {**asr, "workers": 2},
                        "asr_unordered": {**asr, "workers": 2, "worker_order": "unordered"}}
    config["datasets"] = {"demo": config["datasets"]["demo"]}
    write_config(wd, config)
    run = run_snakemake(wd)
    assert run.returncode == 0, run.stderr[-3000:]
    plain = (wd / "results/asr/demo/text").read_bytes()
    assert len(plain.splitlines()) == 10
    for stage in ("asr_ordered", "asr_unordered"):
        assert (wd / f"results/{stage}/demo/text").read_bytes() == plain, stage
        log = (wd / f"results/{stage}/demo/logs/split.0.log").read_text()
        assert f"shard pool: 2 worker(s) on cpu, cpu, {stage.split('_')[1]}" in log


def toy_project(tmp_path: Path, **stage) -> Path:
    wd = copy_workflow(tmp_path / "wf")
    (wd / "toy.py").write_text(__import__("conftest").TOY_MODULE)
    keys = [f"utt{i:03d}" for i in range(12)]
    (wd / "data/toy").mkdir(parents=True)
    (wd / "data/toy/wav.scp").write_text("".join(f"{k} data/demo/wav/cards-001.wav\n" for k in keys))
    config = read_config(wd)
    config["datasets"] = {"toy": {"path": "data/toy"}}
    config["stages"] = {"upper": {"runner": "toy.UpperRunner", "provider": "toy.ToyProvider", "provider_config": {},
                                  "datasets": ["toy"], "sharding": {"shard_size": 6}, **stage}}
    write_config(wd, config)
    return wd


def test_a_failing_item_in_a_worker_fails_its_shard_naming_key_and_device(tmp_path):
    wd = toy_project(tmp_path, workers=2, provider_config={"fail_on_keys": ["utt008"]})
    run = run_snakemake(wd)
    out = run.stdout + run.stderr
    assert run.returncode != 0
    # one line, ending with the cause (a user trial: it ended at "producer_work raised:", the cause further down)
    line = ("snakeshard: error: shard 1 (log: results/upper/toy/logs/split.1.log): worker {} (cpu) failed on item "
            "'utt008': producer_work raised: RuntimeError: asked to fail on utt008\n")
    assert line.format(0) in out or line.format(1) in out, out
    log = (wd / "results/upper/toy/logs/split.1.log").read_text()
    assert 'in forward\n    raise RuntimeError(f"asked to fail on {key}")' in log  # the worker's traceback
    assert log.endswith(line.format(0)) or log.endswith(line.format(1)), log[-1000:]
    assert (wd / "results/upper/toy/split.0/done").exists() and not (wd / "results/upper/toy/split.1/done").exists()


def test_a_canary_that_fails_in_a_worker_is_one_line_and_status_shows_it(tmp_path):
    """A forward whose env name the provider does not give, run in pool workers: the canary's error is one line
    naming the cause, and status shows the canary's failure (a user trial: the line was cut before the cause,
    and status showed stale shards and no canary line)."""
    wd = toy_project(tmp_path, workers=2, runner="toy.NetRunner")
    (wd / "toy.py").write_text((wd / "toy.py").read_text() + (
        "\n\nclass NetRunner(UpperRunner):\n    @staticmethod\n    def forward(key, net, **env):\n"
        "        return {'text': key}\n"))
    run = run_snakemake(wd)
    assert run.returncode != 0
    error = [line for line in (run.stdout + run.stderr).splitlines() if line.startswith("snakeshard: error: canary")]
    assert error and error[0].endswith("NetRunner.forward() missing 1 required positional argument: 'net'"), error
    status = run_cli(wd, "status").stdout
    assert re.search(r"  canary: failed \(log results/upper/logs/canary.log\): snakeshard: error: canary of stage "
                     r"'upper' failed, .* worker \d \(cpu\) failed on item 'utt00[01]': producer_work raised: "
                     r"TypeError: NetRunner.forward\(\) missing 1 required positional argument: 'net'\n",
                     status), status


def test_item_timeout_fails_the_job_naming_the_key(tmp_path):
    wd = toy_project(tmp_path, item_timeout=0.5, provider_config={"item_delay": 3})
    run = run_snakemake(wd)
    out = run.stdout + run.stderr
    assert run.returncode != 0
    assert "item 'utt000' is still running after 0.5 s (item_timeout)" in out
    assert "shard pool: 1 worker(s) on cpu, ordered, item_timeout 0.5 s" in (
        wd / "results/upper/logs/canary.log").read_text()  # the stage's canary (on by default) runs the pool first
    assert not (wd / "results/upper/toy/logs").exists()  # and no shard job started


# A provider whose pool workers hang while building their env; the job's own process builds build_parent_env
# (build_env_local), so only the workers call build_worker_setup_fn.
SLOW_WORKER_PROVIDER = '''

class SlowWorkerProvider(ToyProvider):
    def build_worker_setup_fn(self):
        time.sleep(float(self.config["worker_setup_s"]))
        return self.build_env_local
'''


def test_worker_init_timeout_fails_the_job_naming_worker_and_device(tmp_path):
    """Workers stuck 60 s building their env, worker_init_timeout: 3 (item_timeout: 5 does not count start-up):
    the job fails within seconds naming the worker, its device and the option, and leaves no worker behind."""
    import psutil

    wd = toy_project(tmp_path, workers=2, item_timeout=5, worker_init_timeout=3, provider="toy.SlowWorkerProvider",
                     provider_config={"worker_setup_s": 60}, sharding={"num_shards": 1})
    with open(wd / "toy.py", "a") as f:
        f.write(SLOW_WORKER_PROVIDER)
    t0 = time.monotonic()
    run = run_snakemake(wd, timeout=300)
    elapsed = time.monotonic() - t0
    out = run.stdout + run.stderr
    assert run.returncode != 0 and elapsed < 40, (elapsed, out[-3000:])
    assert re.search(r"worker [01] \(cpu\) is still starting \(building its env: build_worker_setup_fn\) after 3 s "
                     r"\(worker_init_timeout\): stopping the pool", out), out[-3000:]
    assert "shard pool: 2 worker(s) on cpu, cpu, ordered, item_timeout 5 s, worker_init_timeout 3 s" in (
        wd / "results/upper/logs/canary.log").read_text()  # the stage's canary (on by default): no shard job ran
    left = [p for p in psutil.process_iter(["cwd"]) if p.info["cwd"] == str(wd)]
    assert not left, left


@pytest.mark.parametrize("stage, message", [
    ({"devices": "all"}, "stages.upper.devices: 'all' starts one worker per GPU of the job, but stages.upper.resources "
                         "asks for none"),
    ({"workers": 4, "resources": {"cpus_per_task": 2}}, "stages.upper.workers: 4 worker processes, but "
                                                        "stages.upper.resources.cpus_per_task is 2"),
    ({"workers": 2, "devices": "all", "resources": {"gpu": 2}}, "set workers (CPU processes) or devices: all"),
    ({"worker_order": "unordered"}, "stages.upper.worker_order: only for a pool"),
    ({"worker_init_timeout": 600}, "stages.upper.worker_init_timeout: only for a pool"),
    ({"workers": 2, "worker_init_timeout": 0}, "stages.upper.worker_init_timeout: 0 is less than or equal to the "
                                               "minimum of 0"),
])
def test_pool_config_errors_name_the_key_at_parse_time(tmp_path, stage, message):
    wd = toy_project(tmp_path, **stage)
    dry = run_snakemake(wd, "-n")
    assert dry.returncode != 0 and message in dry.stdout + dry.stderr


def test_workers_set_the_jobs_cpus_unless_given():
    from snakeshard.workflow.parse import stage_resources

    config = {"stages": {"a": {"workers": 3}, "b": {"workers": 3, "resources": {"cpus_per_task": 8}}, "c": {}}}
    assert [stage_resources(config, s)["cpus_per_task"] for s in "abc"] == [3, 8, 1]
