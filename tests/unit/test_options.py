"""One description of the strategies' shared options (lightning_mtraining.strategies.options): every strategy accepts every
field it should, with the field's default and annotation, validates through it, and documents it."""

import dataclasses
import inspect

import pytest

from lightning_mtraining.sparsity.config import SparsityConfig
from lightning_mtraining.strategies.fabric import MTrainingFabricStrategy
from lightning_mtraining.strategies.fsdp import MTrainingFSDPStrategy
from lightning_mtraining.strategies.options import FIELD_DOCS, FSDP_ONLY, TRAINER_ONLY, ContextParallelOptions
from lightning_mtraining.strategies.trainer import MTrainingStrategy

STRATEGIES = {MTrainingStrategy: FSDP_ONLY, MTrainingFSDPStrategy: (),
              MTrainingFabricStrategy: TRAINER_ONLY + FSDP_ONLY}
FIELDS = {f.name: f for f in dataclasses.fields(ContextParallelOptions) if f.name != "owner"}


@pytest.mark.parametrize("cls", list(STRATEGIES), ids=lambda c: c.__name__)
def test_every_strategy_takes_every_option_with_its_default(cls):
    params = inspect.signature(cls.__init__).parameters
    for name, field in FIELDS.items():
        if name in STRATEGIES[cls]:
            assert name not in params, f"{cls.__name__} accepts {name}, listed as not applying to it"
            continue
        assert name in params, f"{cls.__name__}.__init__ lacks the option {name!r} (add it to its signature)"
        assert params[name].default == field.default, (cls.__name__, name)
        # Both modules use `from __future__ import annotations`, so the annotations are the source strings.
        assert params[name].annotation == field.type, (cls.__name__, name, params[name].annotation, field.type)
        assert params[name].kind is inspect.Parameter.POSITIONAL_OR_KEYWORD


@pytest.mark.parametrize("cls", list(STRATEGIES), ids=lambda c: c.__name__)
def test_strategies_store_the_options_and_document_them(cls):
    strategy = cls(context_parallel_size=2, layout="zigzag", block_size=64, activation_checkpointing=True,
                   sparsity=SparsityConfig(vertical_topk=8, slash_topk=8))
    assert strategy.options.context_parallel_size == 2
    assert (strategy.layout, strategy.block_size, strategy.activation_checkpointing) == ("zigzag", 64, True)
    assert strategy.sparsity == SparsityConfig(vertical_topk=8, slash_topk=8)
    for name in FIELDS:
        assert (f"{name}: " in cls.__doc__) == (name not in STRATEGIES[cls]), (cls.__name__, name)
    assert "rendered here by document_options" not in cls.__doc__


def test_every_field_is_documented():
    assert set(FIELD_DOCS) == set(FIELDS)


@pytest.mark.parametrize("cls", list(STRATEGIES), ids=lambda c: c.__name__)
@pytest.mark.parametrize("kwargs, error, words", [
    ({"context_parallel_size": 0}, ValueError, "context_parallel_size=...) must be 'auto' or a positive int, got 0"),
    ({"inner_ring_size": True}, ValueError, "inner_ring_size=...) must be None or a positive int"),
    ({"layout": "spiral"}, ValueError, "layout=...) must be one of"),
    ({"block_size": -1}, ValueError, "block_size=...) must be a positive int, got -1"),
    ({"loss_check": "loud"}, ValueError, "loss_check=...) must be one of"),
    ({"nonfinite_check": 1}, ValueError, "nonfinite_check=...) must be one of"),
    ({"fused_loss": "cuda"}, TypeError, "fused_loss=...) must be True, False or a backend name"),
    ({"activation_checkpointing": 1}, TypeError, "activation_checkpointing=...) must be True or False, got 1"),
    ({"sparsity": {"vertical_topk": 8}}, TypeError, "sparsity=...) must be a SparsityConfig or None, got dict"),
    ({"compile": "max-autotune"}, TypeError, "compile=...) must be True, False or a dict of torch.compile keyword"),
])
def test_bad_options_name_the_strategy_the_option_and_the_value(cls, kwargs, error, words):
    with pytest.raises(error, match=rf"^{cls.__name__}\({next(iter(kwargs))}=\.\.\.\) must be ") as info:
        cls(**kwargs)
    assert words in str(info.value)
