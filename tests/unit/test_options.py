"""One description of the strategies' shared options (lightning_mtraining.strategies.options): every strategy accepts
every field it should, with the field's default and annotation, validates through it, and documents it."""

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
    ({"sparsity": {"vertical_topk": 8}}, TypeError,
     "sparsity=...) must be a SparsityConfig, a spec string such as 'paper', or None, got dict"),
    ({"compile": "max-autotune"}, TypeError, "compile=...) must be True, False or a dict of torch.compile keyword"),
])
def test_bad_options_name_the_strategy_the_option_and_the_value(cls, kwargs, error, words):
    with pytest.raises(error, match=rf"^{cls.__name__}\({next(iter(kwargs))}=\.\.\.\) must be ") as info:
        cls(**kwargs)
    assert words in str(info.value)


def test_a_strategy_class_means_what_its_name_means():
    """``MTrainingStrategy()`` is ``strategy="mtraining"``: sparse in the paper's setting, for every strategy class
    (Trainer DDP and FSDP2, Fabric); the ``*_dense`` names are ``sparsity=None``. One meaning for one name."""
    from lightning.fabric.strategies import STRATEGY_REGISTRY
    from lightning.pytorch.strategies import StrategyRegistry

    from lightning_mtraining.sparsity.config import PAPER_SPARSITY

    assert ContextParallelOptions().sparsity == PAPER_SPARSITY
    for registry, cls, sparse, dense in ((StrategyRegistry, MTrainingStrategy, "mtraining", "mtraining_dense"),
                                         (StrategyRegistry, MTrainingFSDPStrategy, "mtraining_fsdp",
                                          "mtraining_fsdp_dense"),
                                         (STRATEGY_REGISTRY, MTrainingFabricStrategy, "mtraining", "mtraining_dense")):
        assert registry[sparse]["strategy"] is cls and registry[dense]["strategy"] is cls
        assert cls().sparsity == registry.get(sparse).sparsity == PAPER_SPARSITY, cls.__name__
        assert registry.get(dense).sparsity is None and cls(sparsity=None).sparsity is None, cls.__name__
        assert "PAPER_SPARSITY" in cls.__doc__, cls.__name__  # the docstring says what the default is


def test_a_default_that_cannot_tile_the_layout_says_it_is_the_default():
    """The default is sparse (128-token tiles): a striped block of 64 fails at construction, naming the default and
    both ways out (a smaller tile, or dense)."""
    with pytest.raises(ValueError, match=r"^MTrainingStrategy\(sparsity=PAPER_SPARSITY, the default\): ") as info:
        MTrainingStrategy(block_size=64)
    assert "SparsityConfig(tile_size=...)" in str(info.value) and "sparsity=None" in str(info.value)
    assert MTrainingStrategy(block_size=64, sparsity=None).sparsity is None


@pytest.mark.parametrize("cls", list(STRATEGIES), ids=lambda c: c.__name__)
def test_sparsity_as_the_short_strings_examples_train_takes(cls):
    """``sparsity="paper"`` (also ``"none"``, ``"topp:P"``, ``"topk:V,S"``): the config the string names, as
    ``examples/train.py --sparsity`` reads it, stored as that config; a bad string names the strategy and the forms."""
    from lightning_mtraining.sparsity.config import PAPER_SPARSITY

    assert cls(sparsity="paper").sparsity == PAPER_SPARSITY
    assert cls(sparsity="none").sparsity is None
    assert cls(sparsity="topp:0.95").sparsity == SparsityConfig(top_p=0.95)
    assert cls(sparsity="topk:64,16", block_size=128).sparsity == SparsityConfig(vertical_topk=64, slash_topk=16)
    # the tile stated in the string: the same meaning as in examples/train.py (its default, 'topk:64,16@32')
    assert cls(sparsity="topk:64,16@32", block_size=64).sparsity == SparsityConfig(vertical_topk=64, slash_topk=16,
                                                                                    tile_size=32)
    with pytest.raises(ValueError, match=rf"^{cls.__name__}\(sparsity=\.\.\.\): a sparsity spec is 'none', 'paper'"):
        cls(sparsity="dense")


def test_a_sparsity_string_means_the_same_in_every_entry_point():
    """``parse_sparsity`` is what the strategies, LightningCLI configs and the examples read: the tile is the string's
    (``@T``) or 128; an example's ``--tile-size`` applies only to a string that names none, and a conflict is an
    error naming both."""
    from lightning_mtraining.sparsity.config import parse_sparsity

    assert parse_sparsity("topk:64,16").tile_size == 128
    assert parse_sparsity("topk:64,16@32").tile_size == 32
    assert parse_sparsity("paper@64").tile_size == 64 and parse_sparsity("paper@64").top_p == 0.9
    assert parse_sparsity("topp:0.9", tile_size=None).tile_size == 128  # an option left unset
    assert parse_sparsity("topp:0.9", tile_size=32).tile_size == 32
    with pytest.raises(ValueError, match="names 32-token tiles, but tile_size=64 was also given"):
        parse_sparsity("topk:64,16@32", tile_size=64)
    for bad in ("topk:64", "topk:64,16@", "topk:64,16@x", "fast"):
        with pytest.raises(ValueError, match=r"a sparsity spec is .* e\.g\. 'topk:64,16@32'; got"):
            parse_sparsity(bad)
    # the example's default names its tile: the string alone says what it trains, and the strategy it makes
    from helpers.scripts import load_script

    example = load_script("examples/train.py", "train_example")
    args = example.parse_args([])
    assert args.sparsity == "topk:64,16@32" and args.tile_size is None
    assert example.make_strategy(args).sparsity == parse_sparsity("topk:64,16@32")
