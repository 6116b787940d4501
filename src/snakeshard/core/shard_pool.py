"""A shard's ``forward`` in pool workers (stage option ``workers: N`` or ``devices: all``).

Each worker builds the provider's env once on its own device (``build_worker_setup_fn``, with
``config["devices"] == [device]``) and runs ``forward`` on the units the shard loop hands it (a key,
or a planned batch of keys); results come back to the shard job's own process, which writes them and
keeps the state, as without a pool. Ordered pools hand results back in plan order; unordered ones as
they finish (the writers put every index in plan order at close, so the merged files are the same).
"""

from __future__ import annotations

import functools

from snakeshard.pool import OrderedRunner, UnorderedRunner


def _init(device, cfg):
    from snakeshard.core.hooks import injected_kwargs
    from snakeshard.core.user_code import import_object

    provider_cls = import_object(cfg.provider, "provider")
    runner_cls = import_object(cfg.runner, "runner")
    provider = provider_cls({**cfg.provider_config, "devices": [device]})
    env = provider.build_worker_setup_fn()()  # once per worker, on its device
    cfg.call = functools.partial(runner_cls.forward, **injected_kwargs(runner_cls, env))


def _work(device, cfg, unit):
    """A planned batch (a list of keys) gives forward's list of results; a key, its one result."""
    return unit, cfg.call(unit)


def _deliver(cfg, data):
    cfg.consume(*data)  # the shard loop's handler, set on the caller's cfg only


# start-up errors in the words of a stage's config: what _init runs, and the stage option that limits it
INIT_STEP, INIT_TIMEOUT_NAME = "building its env: build_worker_setup_fn", "worker_init_timeout"


class OrderedForward(OrderedRunner):
    producer_init, producer_work, consumer_work = staticmethod(_init), staticmethod(_work), staticmethod(_deliver)
    init_step, init_timeout_name = INIT_STEP, INIT_TIMEOUT_NAME


class UnorderedForward(UnorderedRunner):
    producer_init, producer_work, consumer_work = staticmethod(_init), staticmethod(_work), staticmethod(_deliver)
    init_step, init_timeout_name = INIT_STEP, INIT_TIMEOUT_NAME


def forward_pool(devices: list[str], ordered: bool, runner: str, provider: str, provider_config: dict,
                 item_timeout: float | None = None, init_timeout: float | None = None):
    """A started pool whose workers run ``runner``'s forward with ``provider``'s env (import paths)."""
    cls = OrderedForward if ordered else UnorderedForward
    return cls(devices, {"runner": runner, "provider": provider, "provider_config": provider_config},
               item_timeout=item_timeout, init_timeout=init_timeout)
