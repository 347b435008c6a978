"""Data: byte tokens, the embedded stdlib corpus (litdata), and context-parallel-aware streaming.

What is compared with what:
- tokens: bytes -> tokens -> bytes is the identity;
- the corpus: two builds of the same sources are byte-identical, a second call is a no-op, and
  streaming the whole corpus back (no shuffle) gives exactly the direct encoding of the sources,
  cut into windows within each litdata chunk;
- the loader: with world 4 = DP 2 x CP 2 (real gloo processes, DP rank from a named device mesh),
  both ranks of a CP group receive identical batches and the two DP groups disjoint ones, of equal
  count; odd DP sizes and DataLoader workers are checked in one process (the DP sharding depends
  only on the ranks we pass, not on a process group).
All comparisons are exact (integer tokens).
"""

from __future__ import annotations

import json
import os
import sysconfig

import numpy as np
import pytest
import torch

from helpers.dist import run_distributed

data = pytest.importorskip("lightning_mtraining.data.corpus", reason="litdata is not installed")

CHUNK_TOKENS = 50_000
SEQ_LEN = 97  # odd on purpose: windows never align with files or chunks


def _fake_stdlib(root) -> None:
    """A small stdlib-shaped tree with random (so every window is distinct) printable sources."""
    rng = np.random.default_rng(0)
    files = {
        "zeta.py": 9_001,
        "alpha/__init__.py": 1_234,
        "alpha/sub/mod.py": 60_007,
        "alpha/core.py": 70_003,
        "beta/__init__.py": 45_678,
        "gamma.py": 33_333,
        "alpha/__pycache__/core.cpython-311.py": 500,  # skipped: __pycache__
        "site-packages/thing.py": 500,  # skipped: not the standard library
        "alpha/data.txt": 500,  # skipped: not a .py file
    }
    for rel, size in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(rng.integers(32, 127, size, dtype=np.uint8).tobytes())


@pytest.fixture(scope="module")
def fake_stdlib(tmp_path_factory):
    root = tmp_path_factory.mktemp("stdlib")
    _fake_stdlib(root)
    return root


@pytest.fixture(scope="module")
def corpus(fake_stdlib, tmp_path_factory) -> str:
    out = tmp_path_factory.mktemp("corpus") / "stdlib_bytes"
    return str(data.build_stdlib_corpus(out, stdlib_dir=fake_stdlib, chunk_tokens=CHUNK_TOKENS))


def _window_keys(batches) -> list[bytes]:
    """Each sample as a hashable key: its tokens (the windows of this corpus are distinct, checked below)."""
    return [row.numpy().tobytes() for b in batches for row in b["input_ids"]]


def test_byte_tokens_round_trip():
    raw = bytes(range(256)) + "héllo wörld → ∑\n".encode()
    tokens = data.encode_bytes(raw)
    assert tokens.dtype == np.uint16 and tokens.max() < data.BYTE_VOCAB
    assert data.decode_tokens(tokens) == raw
    assert data.decode_tokens(torch.from_numpy(tokens.astype(np.int64))) == raw
    with_specials = np.array([data.FILE_TOKEN, 97, 10, 98, data.EOS_TOKEN])
    assert data.decode_tokens(with_specials) == b"<|file|>a\nb<|eos|>"
    with pytest.raises(ValueError, match="token ids"):
        data.decode_tokens([data.VOCAB_SIZE])


def test_real_stdlib_packages():
    packages = dict(data.stdlib_packages(include=["json", "abc"]))
    assert list(packages) == ["abc", "json"] and packages["abc"] == ["abc.py"]
    assert "json/__init__.py" in packages["json"] and packages["json"] == sorted(packages["json"])
    every = dict(data.stdlib_packages())
    assert "site-packages" not in every and len(every) > 100
    root = sysconfig.get_paths()["stdlib"]
    text = data.decode_tokens(data.encode_package(root, packages["json"]))
    assert text.startswith(b"<|file|>json/__init__.py\n") and text.endswith(b"<|eos|>")
    assert open(os.path.join(root, "json", "decoder.py"), "rb").read() in text
    with pytest.raises(ValueError, match="not found"):
        data.stdlib_packages(include=["no_such_package_here"])


def test_corpus_deterministic_idempotent_and_round_trips(fake_stdlib, corpus, tmp_path):
    root = fake_stdlib
    packages = data.stdlib_packages(root)
    assert packages == [
        ("alpha", ["alpha/__init__.py", "alpha/core.py", "alpha/sub/mod.py"]),
        ("beta", ["beta/__init__.py"]),
        ("gamma", ["gamma.py"]),
        ("zeta", ["zeta.py"]),
    ]

    # Idempotent: a second call with the same sources leaves the build alone.
    index_path = os.path.join(corpus, "index.json")
    mtime = os.path.getmtime(index_path)
    assert str(data.build_stdlib_corpus(corpus, stdlib_dir=root, chunk_tokens=CHUNK_TOKENS)) == corpus
    assert os.path.getmtime(index_path) == mtime

    # Deterministic: an independent build is byte-identical, chunk by chunk.
    other = data.build_stdlib_corpus(tmp_path / "again", stdlib_dir=root, chunk_tokens=CHUNK_TOKENS)
    index = json.load(open(index_path))
    assert index["chunks"] == json.load(open(other / "index.json"))["chunks"]
    assert len(index["chunks"]) > 3  # several chunks, so the chunk-boundary logic below is exercised
    for chunk in index["chunks"]:
        with open(os.path.join(corpus, chunk["filename"]), "rb") as a, open(other / chunk["filename"], "rb") as b:
            assert a.read() == b.read()

    # Round trip: the stream is FILE path \n bytes ... EOS per package, cut into SEQ_LEN windows per chunk.
    stream = np.concatenate([data.encode_package(root, files) for _, files in packages])
    manifest = json.load(open(os.path.join(corpus, "mtraining_corpus.json")))
    assert manifest["num_tokens"] == len(stream) == sum(c["dim"] for c in index["chunks"])
    assert (stream == data.EOS_TOKEN).sum() == len(packages)
    expected, start = [], 0
    for chunk in index["chunks"]:
        usable = chunk["dim"] // SEQ_LEN * SEQ_LEN
        expected.append(stream[start : start + usable])
        start += chunk["dim"]
    dataset = data.token_dataset(corpus, SEQ_LEN, shuffle=False)
    windows = [dataset[i]["input_ids"].numpy() for i in range(len(dataset))]
    assert len({w.tobytes() for w in windows}) == len(windows)  # distinct: the loader tests key samples by content
    got = np.concatenate(windows)
    np.testing.assert_array_equal(got, np.concatenate(expected))
    sample = dataset[0]
    assert sample["input_ids"].dtype == torch.int64 and torch.equal(sample["input_ids"], sample["labels"])
    # The first package's first file, readable.
    first = (root / "alpha/__init__.py").read_bytes()
    assert data.decode_tokens(got[: 30 + len(first)]).startswith(b"<|file|>alpha/__init__.py\n" + first)


def test_build_leaves_the_callers_random_generators_alone(fake_stdlib, tmp_path, capfd):
    """litdata's optimize seeds Python's, NumPy's and torch's generators with 42; a build must not move them, or
    the run that builds the corpus initialises its model differently from every later run with the same seed
    (what examples/train.py showed: first loss 5.3830 on the building run, 5.3670 on the next, same seed)."""
    import random

    def draws():
        return random.random(), float(np.random.rand()), float(torch.rand(()))

    random.seed(1), np.random.seed(1), torch.manual_seed(1)
    want = draws()
    random.seed(1), np.random.seed(1), torch.manual_seed(1)
    data.build_stdlib_corpus(tmp_path / "fresh", stdlib_dir=fake_stdlib, chunk_tokens=CHUNK_TOKENS, verbose=True)
    assert draws() == want
    # verbose: a start line, progress lines from the writer process, a summary; nothing when already built.
    out = capfd.readouterr().out
    assert "building the byte-level corpus of 4 packages (6 files)" in out and "corpus built:" in out
    assert "  corpus: 4/4 packages" in out
    data.build_stdlib_corpus(tmp_path / "fresh", stdlib_dir=fake_stdlib, chunk_tokens=CHUNK_TOKENS, verbose=True)
    assert capfd.readouterr().out == ""


def test_odd_data_parallel_sizes_and_workers(corpus):
    dp_size = 3
    per_rank = []
    for dp_rank in range(dp_size):
        loader = data.token_dataloader(corpus, SEQ_LEN, batch_size=2, dp_rank=dp_rank, dp_size=dp_size)
        per_rank.append(_window_keys(loader))
    assert len({len(keys) for keys in per_rank}) == 1 and len(per_rank[0]) > 0  # equal counts: no rank hangs
    for a in range(dp_size):
        for b in range(a + 1, dp_size):
            assert not set(per_rank[a]) & set(per_rank[b])
    # DataLoader worker processes keep the DP override (the dataset is pickled into them).
    with_workers = data.token_dataloader(corpus, SEQ_LEN, batch_size=2, dp_rank=1, dp_size=dp_size, num_workers=2)
    assert sorted(_window_keys(with_workers)) == sorted(per_rank[1])
    # A strategy-like object: Lightning's distributed_sampler_kwargs carry the DP rank and size.
    class _Strategy:
        distributed_sampler_kwargs = {"num_replicas": dp_size, "rank": 2}

    assert data.data_parallel_rank_size(_Strategy()) == (2, 3)
    assert data.data_parallel_rank_size(None) == (0, 1)
    with pytest.raises(ValueError, match="only one"):
        data.token_dataloader(corpus, SEQ_LEN, strategy=_Strategy(), dp_rank=0, dp_size=1)
    with pytest.raises(ValueError, match="dp_rank"):
        data.token_dataset(corpus, SEQ_LEN, dp_rank=3, dp_size=3)


def _cp_worker(rank: int, world_size: int, corpus: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))
    epochs = []
    loader = data.token_dataloader(corpus, SEQ_LEN, batch_size=3, mesh=mesh, shuffle=True, seed=7)
    for _ in range(2):  # two epochs: the shuffle changes, the CP agreement must not
        epochs.append(_window_keys(loader))
    try:
        data.token_dataloader(corpus, SEQ_LEN)  # no DP information under a process group of 4
        missing_error = ""
    except ValueError as e:
        missing_error = str(e)
    return {
        "dp": mesh.get_local_rank("dp"),
        "cp": mesh.get_local_rank("cp"),
        "epochs": epochs,
        "len": len(loader),
        "missing_error": missing_error,
    }


def test_context_parallel_ranks_share_samples_and_dp_groups_do_not(corpus):
    results = run_distributed(_cp_worker, 4, corpus)
    groups: dict[int, list[dict]] = {}
    for r in results:
        groups.setdefault(r["dp"], []).append(r)
    assert sorted(groups) == [0, 1] and all(len(g) == 2 for g in groups.values())
    for g in groups.values():  # both CP ranks of a DP group: the same samples in the same order
        assert g[0]["epochs"] == g[1]["epochs"]
        assert len(g[0]["epochs"][0]) == 3 * g[0]["len"] > 0
    a, b = groups[0][0]["epochs"], groups[1][0]["epochs"]
    for epoch in range(2):
        assert len(a[epoch]) == len(b[epoch])
        assert not set(a[epoch]) & set(b[epoch])  # DP groups: disjoint
    assert a[0] != a[1]  # reshuffled between epochs
    assert all("data-parallel" in r["missing_error"] for r in results)


def test_resume_from_loader_state_twice(corpus):
    """Checkpoint -> resume -> checkpoint -> resume gives the uninterrupted sample order.

    The loader's DP world (2) differs from the detected one (1 process here), the same mismatch as
    under context parallelism; without DataParallelStreamingDataLoader's fix the second resume
    starts at the wrong sample.
    """
    kwargs = dict(batch_size=2, dp_rank=1, dp_size=2, shuffle=True, seed=3)

    def take(loader, n, state=None):
        if state is not None:
            loader.load_state_dict(state)
        it = iter(loader)
        keys = [k for _ in range(n) for k in _window_keys([next(it)])]
        return keys, loader.state_dict()

    full, _ = take(data.token_dataloader(corpus, SEQ_LEN, **kwargs), 10)
    first, state = take(data.token_dataloader(corpus, SEQ_LEN, **kwargs), 4)
    middle, state = take(data.token_dataloader(corpus, SEQ_LEN, **kwargs), 3, state)
    last, _ = take(data.token_dataloader(corpus, SEQ_LEN, **kwargs), 3, state)
    assert first + middle + last == full


def _resume_worker(rank: int, world_size: int, corpus: str, ckpt_dir: str) -> dict:
    """Trainer + litdata + sparse attention with a dense warm-up: 5 steps straight, and 1 step, a checkpoint, then
    the rest resumed from it (inside the warm-up); each run's per-step losses and pattern estimations."""
    import glob

    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint

    from helpers.training import elastic_env, make_model, quiet
    from lightning_mtraining import MTrainingStrategy, SparsityConfig

    elastic_env(rank, world_size, world_size)
    quiet()
    cfg = SparsityConfig(top_p=0.9, max_vertical=6, max_slash=10, last_q=8, sink_tokens=2, local_window=16,
                         tile_size=16, dense_warmup_steps=2)

    class LM(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = make_model("llama", vocab_size=data.BYTE_VOCAB)
            self.records: list[tuple[int, float]] = []

        def train_dataloader(self):
            return data.token_dataloader(corpus, SEQ_LEN, batch_size=1, strategy=self.trainer.strategy, seed=5)

        def training_step(self, batch, batch_idx):
            loss = self.model(**batch).loss
            self.records.append((self.global_step, float(loss.detach())))
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    def run(max_steps: int, ckpt: str | None = None, save: bool = False):
        module = LM()
        strategy = MTrainingStrategy(block_size=16, sparsity=cfg)
        callbacks = [ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=1, save_top_k=-1)] if save else []
        trainer = L.Trainer(accelerator="cpu", devices=world_size, strategy=strategy, max_steps=max_steps, logger=False,
                            enable_checkpointing=save, callbacks=callbacks, enable_progress_bar=False,
                            enable_model_summary=False)
        trainer.fit(module, ckpt_path=ckpt)
        return module.records, strategy.attention_schedule.estimations

    full, est_full = run(5)
    first, _ = run(1, save=True)
    (ckpt,) = glob.glob(f"{ckpt_dir}/*step=1*.ckpt")
    rest, est_rest = run(5, ckpt=ckpt)
    return {"full": full, "first": first, "rest": rest, "est_full": est_full, "est_rest": est_rest}


@pytest.mark.parametrize("world_size", [1, 2])
def test_resume_inside_the_dense_warmup_with_litdata_is_exact(corpus, tmp_path, world_size):
    """A Trainer checkpoint taken inside the dense warm-up resumes the uninterrupted run exactly, on one process and
    with the sequence split over 2 (context parallel, sparse ring): the same losses bit for bit (the same float32
    ops in the same order), the switch to sparse at the same step (2 layers estimated at each of steps 2, 3, 4 in
    both), the litdata loader at the same sample."""
    for res in run_distributed(_resume_worker, world_size, corpus, str(tmp_path), timeout=600):
        assert [s for s, _ in res["full"]] == [0, 1, 2, 3, 4]
        assert res["first"] + res["rest"] == res["full"], (res["first"], res["rest"], res["full"])
        assert res["est_full"] == 6 and res["est_rest"] == 6, (res["est_full"], res["est_rest"])


def test_document_position_ids_restart_after_each_end_token():
    eos = data.EOS_TOKEN
    tokens = torch.tensor([[5, 6, eos, 7, 8, 9, eos, eos, 1], [eos, 2, 3, 4, 5, 6, 7, 8, 9]])
    assert data.document_position_ids(tokens).tolist() == [[0, 1, 2, 0, 1, 2, 3, 0, 0], [0, 0, 1, 2, 3, 4, 5, 6, 7]]


def test_packed_documents_option(corpus):
    """documents=True: the same windows, with position_ids that restart after every package's EOS; the
    document boundaries read back from them are exactly the tokens after an EOS."""
    from lightning_mtraining.core.layouts import document_starts

    plain = data.token_dataloader(corpus, SEQ_LEN, batch_size=2, shuffle=False)
    packed = data.token_dataloader(corpus, SEQ_LEN, batch_size=2, shuffle=False, documents=True)
    boundaries = 0
    for a, b in zip(plain, packed):
        assert set(a) == {"input_ids", "labels"} and set(b) == {"input_ids", "labels", "position_ids"}
        assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["labels"], b["labels"])
        ids, pid = b["input_ids"], b["position_ids"]
        assert pid.dtype == torch.int64 and pid.shape == ids.shape
        doc = document_starts(pid)
        idx = torch.arange(ids.shape[1])
        first = torch.zeros_like(ids, dtype=torch.bool)
        first[:, 1:] = ids[:, :-1] == data.EOS_TOKEN
        if doc is None:
            assert not first.any()
        else:
            assert torch.equal((doc == idx) & (idx > 0), first)
            boundaries += int(first.sum())
    assert boundaries > 0  # some window spans two packages: the option is exercised
