"""A learning-rate schedule with DanLing's ``LRScheduler`` semantics, as a torch ``LambdaLR``.

Over ``total_steps`` optimizer steps, progress ``p = step / total_steps`` runs from 0 to 1 and a
``strategy`` maps it to a ratio from 0 (the optimizer's lr) to 1 (the final lr):
``linear`` p, ``cosine`` (1 - cos(pi p)) / 2, ``constant`` 0. The final lr is ``final_lr`` or
``final_lr_ratio`` x the lr (default ratio 1e-3). ``method`` turns the ratio into an lr:
``percentile`` (geometric, lr x final_lr_ratio ** ratio; the default with a ratio) or ``numerical``
(linear interpolation between lr and final_lr; the default with ``final_lr``). Warmup scales the first
``warmup_steps`` by step / warmup_steps; cooldown scales the last ``cooldown_steps`` by the steps left /
cooldown_steps. As in DanLing they default to the first 5% and the last 20% of the steps; 0 turns one off.
Nothing goes below ``min_lr`` (1e-9).

The scheduler's state (its step count) goes into the checkpoint; the lambdas are rebuilt from the config.
"""

from __future__ import annotations

import math

OPTIONS = ("strategy", "final_lr_ratio", "final_lr", "min_lr", "warmup_steps", "cooldown_steps", "method")
STRATEGIES = {
    "linear": lambda p: p,
    "cosine": lambda p: (1 - math.cos(math.pi * p)) / 2,
    "constant": lambda p: 0.0,
}


def lr_lambda(base_lr: float, total_steps: int, *, strategy: str = "cosine", final_lr_ratio: float | None = None,
              final_lr: float | None = None, min_lr: float = 1e-9, warmup_steps: int | None = None,
              cooldown_steps: int | None = None, method: str | None = None):
    """The factor (lr / base_lr) at each step, as ``LambdaLR`` wants it."""
    if strategy not in STRATEGIES:
        raise ValueError(f"schedule strategy {strategy!r}: one of {sorted(STRATEGIES)}")
    if total_steps < 1:
        raise ValueError(f"schedule: total_steps is {total_steps}; at least 1")
    if final_lr is not None and final_lr_ratio is not None:
        raise ValueError("schedule: give final_lr or final_lr_ratio, not both")
    if method is None:
        method = "numerical" if final_lr is not None else "percentile"
    if method not in ("percentile", "numerical"):
        raise ValueError(f"schedule method {method!r}: 'percentile' or 'numerical'")
    ratio_final = final_lr_ratio if final_lr_ratio is not None else (
        final_lr / base_lr if final_lr is not None and base_lr else 1e-3)
    final = final_lr if final_lr is not None else base_lr * ratio_final
    warmup = int(0.05 * total_steps) if warmup_steps is None else int(warmup_steps)
    cooldown = int(0.2 * total_steps) if cooldown_steps is None else int(cooldown_steps)
    scale = STRATEGIES[strategy]

    def factor(step: int) -> float:
        if not base_lr:
            return 0.0
        p = min(max(step / total_steps, 0.0), 1.0)
        ratio = scale(p)
        if method == "percentile":
            lr = base_lr * ratio_final ** ratio
        else:
            lr = (1 - ratio) * base_lr + ratio * final
        if warmup and step < warmup:
            lr *= step / warmup
        if cooldown and step > total_steps - cooldown:
            lr *= max(total_steps - step, 0) / cooldown
        return max(lr, min_lr) / base_lr

    return factor


def check_options(options: dict, where: str) -> None:
    """A training stage's ``schedule:`` checked at parse: an unknown option, or a value lr_lambda refuses or cannot
    compute with, is a ConfigError naming the key (in the job it would be a traceback, after the model was built)."""
    from snakeshard.errors import ConfigError

    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        raise ConfigError(f"{where}.{unknown[0]}: not a schedule option (options: {', '.join(OPTIONS)})")
    try:
        lr_lambda(1.0, 10, **options)(1)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{where}: {e}") from None


def make_scheduler(optimizer, total_steps: int, **options):
    """A ``torch.optim.lr_scheduler.LambdaLR`` over ``optimizer``'s groups with ``lr_lambda``'s schedule."""
    from torch.optim.lr_scheduler import LambdaLR

    lambdas = [lr_lambda(group.get("initial_lr", group["lr"]), total_steps, **options)
               for group in optimizer.param_groups]
    return LambdaLR(optimizer, lambdas)
