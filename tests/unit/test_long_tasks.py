"""Locally generated long-context tasks (``lightning_mtraining.data.long_tasks``): exact lengths, needles at their
stated depth holding the answer, reproducible by seed, and the scorer's two methods agreeing."""

from __future__ import annotations

import math

import pytest
import torch

from lightning_mtraining.data.long_tasks import (
    HAYSTACKS,
    KINDS,
    MAX_PIECE,
    make_task,
    make_tasks,
    score_tasks,
    summarize,
)


def _text(ids: torch.Tensor) -> str:
    return bytes(ids.tolist()).decode("utf-8", errors="replace")


@pytest.mark.parametrize("haystack", HAYSTACKS)
@pytest.mark.parametrize("kind", KINDS)
def test_lengths_depths_answers(kind: str, haystack: str):
    for length, depth in ((3000, 0.0), (5001, 0.37), (5001, 1.0)):
        task = make_task(kind, haystack, length, depth, seed=7)
        assert task.input_ids.shape == (length,) and task.input_ids.dtype == torch.int64  # exact length
        text = _text(task.input_ids)
        pos = task.needle_positions[0]
        # the queried needle starts within one haystack piece of depth x (haystack tokens); the prompt's other
        # tokens (question, needles, which may also sit before it) are under 400 here
        assert abs(pos - depth * length) <= MAX_PIECE + 400
        line = _text(task.input_ids[pos:]).split("\n", 1)[0]
        first_answer = task.answer.split()[0]
        assert first_answer in line  # the needle at that position holds the (first) answer
        assert text.count(first_answer) >= 1 and _text(task.answer_ids) == task.answer
        if haystack == "code":
            assert line.startswith("# ")
        if kind == "vartrack":  # the hops follow in order of assignment
            assert list(task.needle_positions) == sorted(task.needle_positions)
            for name, p in zip(task.answer.split(), task.needle_positions):
                assert _text(task.input_ids[p:]).split("\n", 1)[0].split("VAR ")[1].startswith(name)


def test_reproducible_by_seed_and_custom_encode():
    a = make_task("multikey", "text", 4000, 0.5, seed=3)
    b = make_task("multikey", "text", 4000, 0.5, seed=3)
    c = make_task("multikey", "text", 4000, 0.5, seed=4)
    assert torch.equal(a.input_ids, b.input_ids) and a.answer == b.answer and a.needle_positions == b.needle_positions
    assert not torch.equal(a.input_ids, c.input_ids) and a.answer != c.answer
    # any tokenizer: lengths are counted in its tokens (here two characters per token)
    enc = lambda s: [hash(s[i:i + 2]) % 1000 for i in range(0, len(s), 2)]  # noqa: E731
    t = make_task("passkey", "code", 2500, 0.5, seed=0, encode=enc)
    assert t.input_ids.numel() == 2500 and t.answer_ids.tolist() == enc(t.answer)
    tasks = make_tasks([2048, 3000], [0.0, 0.5], kinds=["passkey"], haystacks=["text"], samples=2)
    assert len(tasks) == 8 and len({tuple(t.input_ids[:64].tolist()) for t in tasks}) == 8
    with pytest.raises(ValueError, match="too short"):
        make_task("passkey", "text", 500, 0.5, seed=0)
    with pytest.raises(ValueError, match="depth"):
        make_task("passkey", "text", 4000, 1.5, seed=0)


class _Oracle(torch.nn.Module):
    """Logits that put the maximum on the next token of the sequence it was built for."""

    def __init__(self, ids: torch.Tensor, wrong: bool = False):
        super().__init__()
        self.ids, self.wrong, self.w = ids, wrong, torch.nn.Parameter(torch.zeros(1))

    def forward(self, input_ids):
        nxt = torch.cat([self.ids[1:], self.ids[:1]])[: input_ids.shape[1]]
        logits = torch.zeros(1, input_ids.shape[1], 258)
        logits[0, torch.arange(nxt.numel()), (nxt + int(self.wrong)) % 258] = 5.0
        return type("Out", (), {"logits": logits})()


def test_scorer():
    task = make_task("passkey", "text", 2048, 0.5, seed=1)
    right = score_tasks(_Oracle(task.full_ids()), [task])[0]
    wrong = score_tasks(_Oracle(task.full_ids(), wrong=True), [task])[0]
    assert right["correct"] and right["token_accuracy"] == 1.0
    # each answer token: log(e^5 / (e^5 + 257)); float32 rounding of a log-softmax over 258 entries ~1e-6
    assert abs(right["logprob"] - 5 * (5 - math.log(math.exp(5) + 257))) < 1e-4
    assert not wrong["correct"] and wrong["token_accuracy"] == 0.0
    assert summarize([right, wrong]) == {"2048": 0.5}
    # teacher forcing decides exactly what greedy generation decides (a random tiny model: both fail, same way)
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=258, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1)).eval()
    tf = score_tasks(model, [task])[0]
    gen = score_tasks(model, [task], method="generate")[0]
    # the answer's logits through logits_to_keep (only the last positions through the LM head) are the full ones
    from lightning_mtraining.data.long_tasks import _answer_logits

    ids, a = task.full_ids()[None], task.answer_ids.numel()
    with torch.no_grad():
        full = model(input_ids=ids).logits[0, task.length - 1:task.length - 1 + a]
        assert torch.allclose(_answer_logits(model, ids, task.length, a), full, atol=1e-6, rtol=0)
    assert tf["correct"] == gen["correct"]
    with pytest.raises(ValueError, match="method"):
        score_tasks(model, [task], method="beam")
