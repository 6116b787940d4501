"""Runner classes for tests/test_pool.py: spawned workers import them from here (spawn needs a module)."""

import os
import signal
import time

from snakeshard.pool import OrderedRunner, UnorderedRunner


class Square(OrderedRunner):
    """Squares numbers; the consumer collects (value, worker pid) pairs in order."""

    @staticmethod
    def producer_init(device, cfg):
        cfg.pid = os.getpid()

    @staticmethod
    def producer_work(device, cfg, data):
        if cfg.get("jitter"):
            time.sleep((data * 7919 % 13) / 1000)  # finish out of order
        return data * data, cfg.pid, device

    @staticmethod
    def consumer_init(cfg):
        cfg.out = []

    @staticmethod
    def consumer_work(cfg, data):
        cfg.out.append(data)

    @staticmethod
    def consumer_end(cfg):
        return cfg.out


class UnorderedSquare(UnorderedRunner):
    producer_init = Square.producer_init
    producer_work = Square.producer_work
    consumer_init = Square.consumer_init
    consumer_work = Square.consumer_work
    consumer_end = Square.consumer_end


class RaiseOn(Square):
    @staticmethod
    def producer_work(device, cfg, data):
        if data == cfg.bad:
            raise ValueError(f"cannot square {data}")
        time.sleep(0.01)
        return data * data, os.getpid(), device


class KillOn(Square):
    """Kills its own worker with SIGKILL on item ``cfg.bad`` (as the OOM killer would)."""

    @staticmethod
    def producer_work(device, cfg, data):
        if data == cfg.bad:
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(0.01)
        return data * data, os.getpid(), device


class HangOn(Square):
    @staticmethod
    def producer_work(device, cfg, data):
        if data == cfg.bad:
            time.sleep(3600)
        return data * data, os.getpid(), device


class InitFails(Square):
    @staticmethod
    def producer_init(device, cfg):
        raise RuntimeError(f"no model for {device}")


class ConsumerRaises(Square):
    @staticmethod
    def consumer_work(cfg, data):
        if data[0] == 9:
            raise KeyError("consumer refuses 9")
        cfg.out.append(data)


class Unpicklable(Square):
    @staticmethod
    def producer_work(device, cfg, data):
        return lambda: data  # a lambda cannot be pickled back to the caller


class EndWrites(Square):
    """producer_end leaves a file per worker: shows close() lets workers end cleanly."""

    @staticmethod
    def producer_end(device, cfg):
        with open(os.path.join(cfg.end_dir, f"{os.getpid()}.end"), "w") as f:
            f.write(device)


class SlowInit(Square):
    """producer_init takes ``cfg.init_s`` seconds on device ``cfg.slow`` (a model that loads slowly, or never)."""

    @staticmethod
    def producer_init(device, cfg):
        if device == cfg.slow:
            time.sleep(cfg.init_s)
        cfg.pid = os.getpid()
