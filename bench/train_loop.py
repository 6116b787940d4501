"""Benchmark (not a test): snakeshard.train.train against a plain PyTorch loop; checkpoint and resume costs.

1. throughput: ``train(Runner, env, keys, (), {seed, epochs, batch_size: 16}, run_dir)`` at the default
   checkpoint settings against a hand-written loop over the same batches (``loop.batch_order``), the same
   ``Runner.train_step``, the same init, Adam, zero_grad/backward/step and no logging. Models: a 1-D conv
   classifier over 40-dim features (16 x 100 frames per batch) and a linear layer (the per-step overhead).
   Interleaved rounds; each round checks that both sides end with equal weights.
2. checkpoint: the share of train()'s time spent in CheckpointManager.save in those runs, and one save
   (torch.save, history + latest, fsynced) and one load+restore of a model with Adam state per size.
3. resume: a child process (this script, --child) trains with checkpoint interval 25, is SIGKILLed after its
   first checkpoint and rerun; the rerun's time from spawn to its first new train_step, split by phase,
   against a fresh start; the rerun's final weights must equal an uninterrupted run's.

    python bench/train_loop.py [--repeats 5] [--threads N] [--epochs 3] [--utts 1600] [--sizes 1 10 50]
                               [--only throughput,checkpoint,resume]
"""

from __future__ import annotations

import time

T_START = time.monotonic()  # the child's first line: what comes before is the interpreter's own start

# the imports below come after T_START, so the child can time them (hence the noqa: E402)
import argparse, io, json, os, shutil, signal, statistics, subprocess, sys  # noqa: E401, E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
from torch import nn  # noqa: E402

import snakeshard.train.loop as loop  # noqa: E402
from snakeshard.io.atomic import atomic_write_bytes  # noqa: E402
from snakeshard.train import TorchRunner, rng, train  # noqa: E402
from snakeshard.train.checkpoint import CheckpointManager, read_checkpoint  # noqa: E402

T_IMPORTED = time.monotonic()
WORK = Path(__file__).resolve().parent / "work" / "train_loop"
BS, FRAMES, DIM, CLASSES, CHANNELS = 16, 100, 40, 40, 128  # a step of the conv model: ~10-15 ms here
FIRST_STEP: list[float] = []


class TimedManager(CheckpointManager):
    """CheckpointManager timing its saves and loads; put in loop's namespace, so train() uses it unchanged."""
    saves: list[float] = []
    loads: list[float] = []

    def save(self, state, **kw):
        t0 = time.perf_counter()
        super().save(state, **kw)
        TimedManager.saves.append(time.perf_counter() - t0)

    def load_latest(self):
        t0 = time.perf_counter()
        out = super().load_latest()
        TimedManager.loads.append(time.perf_counter() - t0)
        return out


loop.CheckpointManager = TimedManager


def evict(path) -> None:
    """Drop ``path``'s pages from the page cache (they are clean after fsync): a resume reads it from disk."""
    fd = os.open(path, os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)


class Conv(nn.Module):
    """Speech-like: two 1-D convolutions over time, dropout (so train()'s RNG seeding matters), mean pooling."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Conv1d(DIM, CHANNELS, 5, padding=2), nn.ReLU(), nn.Dropout(0.1),
                                  nn.Conv1d(CHANNELS, CHANNELS, 5, padding=2), nn.ReLU())
        self.out = nn.Linear(CHANNELS, CLASSES)

    def forward(self, x):  # (batch, frames, dim)
        return self.out(self.body(x.transpose(1, 2)).mean(2))


class Tiny(nn.Linear):
    """A linear layer over mean-pooled features: its step is so short that what remains is the loop's overhead."""

    def forward(self, x):
        return super().forward(x.mean(1))


class Runner(TorchRunner):
    @staticmethod
    def train_step(batch, *, model, feats, labels):
        if not FIRST_STEP:
            FIRST_STEP.append(time.monotonic())
        idx = torch.tensor(batch)
        logits = model(feats[idx])
        y = labels[idx]
        return {"loss": nn.functional.cross_entropy(logits, y), "acc": (logits.argmax(1) == y).float().mean()}


def build_env(kind: str, utts: int) -> dict:
    """Fixed synthetic features in memory (no I/O); the same init on every call."""
    g = torch.Generator().manual_seed(1)
    feats, labels = torch.randn(utts, FRAMES, DIM, generator=g), torch.randint(0, CLASSES, (utts,), generator=g)
    torch.manual_seed(0)
    model = Conv() if kind == "conv" else Tiny(DIM, CLASSES)
    return {"model": model, "optimizer": torch.optim.Adam(model.parameters(), lr=1e-3), "feats": feats,
            "labels": labels}


def plain_loop(env: dict, keys: list, epochs: int, seed: int = 0) -> None:
    rng.seed_all(seed)  # train() seeds torch once before step 1: without this the dropout masks differ
    model, opt = env["model"], env["optimizer"]
    kw = {"model": model, "feats": env["feats"], "labels": env["labels"]}
    model.train()
    for epoch in range(epochs):
        order = loop.batch_order(seed, epoch, len(keys))
        for b in range(0, len(keys), BS):
            opt.zero_grad(set_to_none=True)
            Runner.train_step([keys[i] for i in order[b:b + BS]], **kw)["loss"].backward()
            opt.step()


def throughput(args) -> None:
    keys, steps = list(range(args.utts)), args.epochs * -(-args.utts // BS)
    cases = [(kind, side) for kind in ("conv", "tiny") for side in ("plain", "train")]
    runs = {c: [] for c in cases}  # per counted round: (wall s, s in CheckpointManager.save, s before step 1)
    for rep in range(args.repeats + 1):  # round 0 warms up and is not counted
        weights = {}
        for kind, side in cases[rep % 4:] + cases[:rep % 4]:
            env = build_env(kind, args.utts)
            shutil.rmtree(WORK / "run", ignore_errors=True)
            TimedManager.saves.clear()
            FIRST_STEP.clear()
            t0 = time.monotonic()
            if side == "plain":
                plain_loop(env, keys, args.epochs)
            else:
                train(Runner, env, keys, (), {"seed": 0, "epochs": args.epochs, "batch_size": BS}, WORK / "run")
            if rep:
                runs[kind, side].append((time.monotonic() - t0, sum(TimedManager.saves), FIRST_STEP[0] - t0))
            weights[kind, side] = env["model"].state_dict()
        for kind in ("conv", "tiny"):
            a, b = weights[kind, "plain"], weights[kind, "train"]
            assert all(torch.equal(a[k], b[k]) for k in a), f"{kind}: train() and the plain loop differ"
    print(f"\n### Throughput: {args.epochs} epochs x {steps // args.epochs} steps of {BS} x {FRAMES} x {DIM}, "
          f"median of {args.repeats} interleaved rounds; final weights torch.equal on both sides\n")
    print("| model | params | plain ms/step | train() ms/step | steps/s ratio | median of round ratios | "
          "train() before step 1 ms | saves ms (% of train()) | per-step overhead ms |\n|---|" + "---:|" * 8)
    med = statistics.median
    for kind in ("conv", "tiny"):
        plain, ours = runs[kind, "plain"], runs[kind, "train"]
        wall_p, wall_t = med(p[0] for p in plain), med(t[0] for t in ours)
        ratios = [p[0] / t[0] for p, t in zip(plain, ours)]
        # what train() adds per step, less its saves and its setup (the plain loop's own setup is less too)
        per_step = med(((t[0] - t[1] - t[2]) - (p[0] - p[2])) / steps for p, t in zip(plain, ours))
        params = sum(p.numel() for p in build_env(kind, BS)["model"].parameters())
        print(f"| {kind} | {params:,} | {wall_p / steps * 1e3:.2f} | {wall_t / steps * 1e3:.2f} | {wall_p / wall_t:.3f}x"
              f" | {med(ratios):.3f}x | {med(t[2] for t in ours) * 1e3:.1f} | {med(t[1] for t in ours) * 1e3:.1f} "
              f"({med(t[1] / t[0] for t in ours):.2%}, {args.epochs + 1} saves) | {per_step * 1e3:.3f} |")
    for kind in ("conv", "tiny"):  # the spread
        print(f"\n{kind}: steps/s ratio per round " + ", ".join(f"{p[0] / t[0]:.3f}" for p, t in
                                                              zip(runs[kind, "plain"], runs[kind, "train"])))


def checkpoint_sizes(args) -> None:
    print(f"\n### One checkpoint by size (Adam state included), median of {args.repeats}\n")
    print("| params | file MB | torch.save to bytes ms | one atomic write + fsync ms | CheckpointManager.save ms "
          "| load (not cached) + restore ms | save <= 3% of an epoch of at least |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for millions in args.sizes:
        model = nn.Sequential(*[nn.Linear(1000, 1000) for _ in range(millions)])
        opt = torch.optim.Adam(model.parameters())
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        opt.step()  # creates exp_avg and exp_avg_sq: the checkpoint holds three times the weights
        opt.zero_grad(set_to_none=True)  # what loop.train's save() hands the manager:
        state = {"model": model.state_dict(), "optimizer": opt.state_dict(), "scheduler": None,
                 "progress": {"step": 1}, "rng": rng.capture(), "meters": {}, "log_bytes": 0, "config": {},
                 "fingerprint": "", "versions": {}, "runner": "bench"}
        folder = WORK / f"ck{millions}M"
        shutil.rmtree(folder, ignore_errors=True)
        manager = CheckpointManager(folder)
        times = {k: [] for k in ("serialize", "write", "save", "load")}
        for rep in range(args.repeats):
            t = [time.perf_counter()]
            buffer = io.BytesIO()
            torch.save(state, buffer)  # what CheckpointManager.save does first
            data = buffer.getvalue()
            t.append(time.perf_counter())
            atomic_write_bytes(folder.parent / f"single{millions}M.pt", data)  # what one file costs
            t.append(time.perf_counter())
            manager.save(state, step=rep + 1)
            t.append(time.perf_counter())
            evict(manager.latest)
            ck = read_checkpoint(manager.latest)
            model.load_state_dict(ck["model"])
            opt.load_state_dict(ck["optimizer"])
            t.append(time.perf_counter())
            for k, t0, t1 in zip(times, t, t[1:]):
                times[k].append(t1 - t0)
            del ck
        med = {k: statistics.median(v) for k, v in times.items()}
        print(f"| {millions}M | {len(data) / 1e6:.0f} | {med['serialize'] * 1e3:.0f} | {med['write'] * 1e3:.0f} | "
              f"{med['save'] * 1e3:.0f} | {med['load'] * 1e3:.0f} | {med['save'] / 0.03:.1f} s |")
        del model, opt, state, data, buffer
        shutil.rmtree(folder, ignore_errors=True)
        (folder.parent / f"single{millions}M.pt").unlink()


def child(run_dir: str, out: str, max_steps: int, utts: int) -> None:
    env = build_env("conv", utts)
    built = time.monotonic()
    cfg = {"seed": 0, "max_steps": max_steps, "batch_size": BS, "checkpoint": {"interval": 25}}
    result = train(Runner, env, list(range(utts)), (), cfg, run_dir)
    Path(out).write_text(json.dumps({"start": T_START, "imported": T_IMPORTED, "built": built,
                                     "first_step": FIRST_STEP[0], "load": sum(TimedManager.loads),
                                     "resumed_from": str(result.resumed_from), "step": result.step}))


def resume(args) -> None:
    def spawn(run_dir, out):
        cmd = [sys.executable, __file__, "--child", str(run_dir), str(out), str(args.resume_steps), "--utts",
               str(args.utts), "--threads", str(args.threads)]
        return time.monotonic(), subprocess.Popen(cmd)

    phases = {side: [] for side in ("rerun", "fresh")}
    for rep in range(args.repeats + 1):
        for side in ("rerun", "fresh") if rep % 2 else ("fresh", "rerun"):
            run_dir, out = WORK / f"resume-{side}", WORK / f"resume-{side}.json"
            shutil.rmtree(run_dir, ignore_errors=True)
            if side == "rerun":  # the killed first run
                _, proc = spawn(run_dir, out)
                while not (run_dir / "checkpoints" / "latest.pt").exists():
                    time.sleep(0.01)
                time.sleep(0.2)
                proc.send_signal(signal.SIGKILL)
                assert proc.wait() == -signal.SIGKILL
                killed_at = read_checkpoint(run_dir / "checkpoints" / "latest.pt")["progress"]["step"]
                for f in (run_dir / "checkpoints").rglob("*.pt"):
                    evict(f)
            t_spawn, proc = spawn(run_dir, out)
            assert proc.wait() == 0, f"{side} child failed"
            r = json.loads(out.read_text())
            assert (r["resumed_from"] != "None") == (side == "rerun") and r["step"] == args.resume_steps, r
            if rep:
                phases[side].append([r["start"] - t_spawn, r["imported"] - r["start"], r["built"] - r["imported"],
                                     r["load"], r["first_step"] - r["built"] - r["load"], r["first_step"] - t_spawn])
        final = {s: read_checkpoint(WORK / f"resume-{s}" / "checkpoints" / "latest.pt")["model"] for s in phases}
        assert all(torch.equal(final["rerun"][k], final["fresh"][k]) for k in final["fresh"]), "resume differs"
    names = ["interpreter start (spawn to the script's first line)", "imports (torch, snakeshard.train, ...)",
             "model/env build", "train(): checkpoint load (CheckpointManager.load_latest)",
             "train(): the rest before step 1 (restore, log, signals, batch order)", "total, spawn to first new step"]
    print(f"\n### Resume: SIGKILL after the first checkpoint (the last at step {killed_at}), rerun; "
          f"median of {args.repeats}, seconds; final weights equal an uninterrupted run's\n")
    print("| phase | rerun after kill | fresh start |\n|---|---:|---:|")
    for i, name in enumerate(names):
        print(f"| {name} | {statistics.median(x[i] for x in phases['rerun']):.3f} | "
              f"{statistics.median(x[i] for x in phases['fresh']):.3f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--utts", type=int, default=1600, help="train utterances (steps per epoch: utts / 16)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--sizes", type=int, nargs="+", default=[1, 10, 50], help="checkpoint sizes, M params")
    ap.add_argument("--resume-steps", type=int, default=150, help="max_steps of the resume runs")
    ap.add_argument("--only", default="throughput,checkpoint,resume")
    ap.add_argument("--child", nargs=3, help=argparse.SUPPRESS)  # RUN_DIR OUT MAX_STEPS: one resume run
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.child:
        return child(args.child[0], args.child[1], int(args.child[2]), args.utts)
    WORK.mkdir(parents=True, exist_ok=True)
    from benchlib import machine_info
    print(machine_info(torch=torch.__version__, threads=str(torch.get_num_threads())))
    for part in args.only.split(","):
        {"throughput": throughput, "checkpoint": checkpoint_sizes, "resume": resume}[part](args)
    print(machine_info())


if __name__ == "__main__":
    main()
