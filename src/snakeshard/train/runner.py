"""The training contract: a provider builds model, optimizer and data; a runner's step methods use them.

``TrainProvider.build_env()`` returns a dict with ``model`` and ``optimizer`` (a ``scheduler`` of the user's
own is optional: without one the loop builds ``schedule.make_scheduler`` from the config's ``schedule``)
and anything the steps read (datasets, feature tables). ``TorchRunner``'s step methods are
``@staticmethod``s whose first parameter receives a batch (a list of keys) and whose other parameters are
filled from the env by name, as ``BaseRunner.forward``'s are:

* ``train_step(batch, *, model, ...)`` returns ``{"loss": tensor, ...}``: the loop runs backward (divided by
  the accumulation count), clipping and the optimizer step; every entry goes to the train meters;
* ``evaluate_step(batch, *, model, ...)`` returns meter values (run under ``torch.no_grad``, model in eval mode);
* ``infer_step(batch, *, model, ...)`` returns ``{key: result}``, one result per key.
"""

from __future__ import annotations

from snakeshard.core.contract import InferenceProvider
from snakeshard.core.hooks import method_kwargs


class TrainProvider(InferenceProvider):
    """Implement ``build_env()`` returning ``{"model", "optimizer", ...}``."""


class TorchRunner:
    @staticmethod
    def train_step(batch, *, model, **env) -> dict:
        raise NotImplementedError("a TorchRunner must define @staticmethod train_step(batch, *, model, ...) "
                                  "returning {'loss': tensor, ...}")

    @staticmethod
    def evaluate_step(batch, *, model, **env) -> dict:
        raise NotImplementedError("define @staticmethod evaluate_step(batch, *, model, ...) to evaluate")

    @staticmethod
    def infer_step(batch, *, model, **env) -> dict:
        raise NotImplementedError("define @staticmethod infer_step(batch, *, model, ...) to infer")


def defines(runner_cls: type, method: str) -> bool:
    """``runner_cls`` has its own ``method`` (not TorchRunner's, which only raises)."""
    return getattr(runner_cls, method, None) not in (None, getattr(TorchRunner, method))


def step_kwargs(runner_cls: type, method: str, env: dict) -> dict:
    """The env entries ``runner_cls.<method>`` receives, chosen by parameter name (all of them with ``**env``).
    Raises naming the runner when the method is no staticmethod or needs a name the env lacks."""
    return method_kwargs(runner_cls, method, env, "the batch (a list of keys)")
