"""Long-context tasks generated locally (no downloads), and their scorers.

Three task kinds, in the spirit of RULER's synthetic tasks, each hidden in a haystack of real text or code:

- ``"passkey"``: one sentence holding a 5-digit pass key at the given depth; the prompt ends asking for it.
- ``"multikey"``: several "special magic number" needles, each under its own key; the queried one sits at the
  given depth, the distractors at other random depths.
- ``"vartrack"``: variable tracking: ``VAR A = 12345`` at the given depth, then a chain of ``VAR B = A`` hops at
  later depths; the answer is every variable holding the value, in order of assignment.

Haystacks come from files every machine with a Python has (the project's embedded-corpus idea, see
:mod:`lightning_mtraining.data.corpus`): ``"text"`` is English prose, the language reference topics shipped in the
standard library (``pydoc_data.topics``, ~465 KB on CPython 3.11); ``"code"`` is the standard library's own
top-level modules (``*.py``), in sorted order. In code haystacks the needles are comments.

Tokens: byte level by default (token id = byte, the embedded corpus's ids 0..255, ``data.VOCAB_SIZE = 258``), or any
``encode(str) -> list[int]`` (an HF tokenizer's ``encode`` without special tokens). A prompt is built in token
space: haystack lines (each encoded on its own, long lines cut to :data:`MAX_PIECE` tokens), needles inserted
between lines, the last line cut so that the prompt has exactly ``length`` tokens. So lengths are exact, and a
needle starts within one line (at most :data:`MAX_PIECE` tokens) of ``depth * (haystack tokens)``.

Determinism: a task is a pure function of (kind, haystack, length, depth, seed) and the haystack files; the files
differ between Python versions, so the *text* around the needles does, while the needles, keys and answers are
drawn from ``random.Random(seed)`` only.

Scoring: a task is solved when greedy decoding produces exactly the answer tokens. That happens iff, teacher
forcing the answer, every answer token is the argmax of its position's logits, so :func:`score_tasks` needs one
forward per task (``method="teacher_forced"``, which also gives the answer's log-probability); ``method="generate"``
runs ``model.generate`` (and so a registered sparse prefill, :mod:`lightning_mtraining.hf.prefill`) and compares.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import random
import sysconfig
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

__all__ = ["HAYSTACKS", "KINDS", "LongTask", "haystack_lines", "make_task", "make_tasks", "score_tasks",
           "summarize"]

KINDS = ("passkey", "multikey", "vartrack")
HAYSTACKS = ("text", "code")
MAX_PIECE = 256  # longest haystack piece in tokens: bounds how far a needle may sit from its stated depth
_CODE_BYTES = 4 << 20  # read this much of the standard library for code haystacks (enough for ~4M byte tokens)

Encode = Callable[[str], Sequence[int]]


def _bytes(text: str) -> list[int]:
    return list(text.encode("utf-8"))


@dataclasses.dataclass(frozen=True)
class LongTask:
    """One generated task.

    Attributes:
        kind, haystack, length, depth, seed: what it was generated from (``length`` = prompt tokens, exact).
        input_ids: ``[length]`` int64 prompt: haystack with needles, then the question, ending where the answer
            starts.
        answer_ids: ``[A]`` int64 answer tokens.
        answer: the answer text.
        needle_positions: token index where each needle starts, the queried one first (``vartrack``: the value's
            assignment first, then the hops).
    """

    kind: str
    haystack: str
    length: int
    depth: float
    seed: int
    input_ids: torch.Tensor
    answer_ids: torch.Tensor
    answer: str
    needle_positions: tuple[int, ...]

    def full_ids(self) -> torch.Tensor:
        """Prompt and answer, ``[length + A]``: a training sample."""
        return torch.cat([self.input_ids, self.answer_ids])


@functools.lru_cache(maxsize=2)
def haystack_lines(haystack: str) -> tuple[str, ...]:
    """The haystack's lines (each ending in a newline), in a fixed order."""
    if haystack == "text":
        from pydoc_data.topics import topics

        text = "\n".join(topics[name] for name in sorted(topics))
    elif haystack == "code":
        root = sysconfig.get_paths()["stdlib"]
        parts, size = [], 0
        for name in sorted(os.listdir(root)):
            if not name.endswith(".py"):
                continue
            try:
                with open(os.path.join(root, name), encoding="utf-8") as f:
                    src = f.read()
            except (OSError, UnicodeDecodeError):
                continue
            parts.append(f"# file: {name}\n{src}")
            size += len(src)
            if size >= _CODE_BYTES:
                break
        text = "\n".join(parts)
    else:
        raise ValueError(f"haystack must be one of {HAYSTACKS}, got {haystack!r}")
    lines = tuple(line + "\n" for line in text.split("\n") if line.strip())
    if not lines:
        raise RuntimeError(f"the {haystack!r} haystack is empty on this machine ({sysconfig.get_paths()['stdlib']})")
    return lines


_WORDS = ("amber", "birch", "cobalt", "dune", "ember", "fjord", "garnet", "harbor", "indigo", "juniper", "kestrel",
          "lagoon", "meadow", "nectar", "onyx", "pepper", "quartz", "raven", "saffron", "tundra", "umber", "violet",
          "willow", "yarrow", "zephyr")


def _needles(kind: str, rng: random.Random, n_keys: int, hops: int) -> tuple[list[str], str, str]:
    """(needle sentences, the queried one first; the question; the answer)."""
    if kind == "passkey":
        key = f"{rng.randrange(10000, 100000)}"
        return ([f"The pass key is {key}. Remember it. {key} is the pass key."],
                "What is the pass key? The pass key is ", key)
    if kind == "multikey":
        names = rng.sample(_WORDS, n_keys)
        names = [f"{w}-{rng.randrange(10, 100)}" for w in names]
        values = [f"{rng.randrange(1000000, 10000000)}" for _ in names]
        sentences = [f"One of the special magic numbers for {k} is: {v}." for k, v in zip(names, values)]
        return (sentences, f"What is the special magic number for {names[0]}? The special magic number for "
                           f"{names[0]} is: ", values[0])
    if kind == "vartrack":
        value = f"{rng.randrange(10000, 100000)}"
        names = ["".join(rng.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZ") for _ in range(5)) for _ in range(hops + 1)]
        while len(set(names)) < len(names):
            names = ["".join(rng.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZ") for _ in range(5)) for _ in range(hops + 1)]
        sentences = [f"VAR {names[0]} = {value}."] + [f"VAR {b} = {a}." for a, b in zip(names, names[1:])]
        return (sentences, f"Find all variables that are assigned the value {value}. Answer: ", " ".join(names))
    raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")


def make_task(
    kind: str,
    haystack: str,
    length: int,
    depth: float,
    seed: int,
    *,
    encode: Encode | None = None,
    n_keys: int = 4,
    hops: int = 2,
) -> LongTask:
    """Generate one task (see the module docstring).

    Args:
        kind: ``"passkey"``, ``"multikey"`` or ``"vartrack"``.
        haystack: ``"text"`` or ``"code"``.
        length: prompt tokens (exact); must leave room for the needles and question plus 2 * :data:`MAX_PIECE`.
        depth: where the (queried) needle starts, as a share of the haystack, in [0, 1].
        seed: the random draw (needles, keys, values, the haystack's starting line, distractor depths).
        encode: text -> token ids; default byte level.
        n_keys: needles of a ``multikey`` task (the queried one and ``n_keys - 1`` distractors).
        hops: ``vartrack`` chain length after the first assignment (``hops + 1`` variables).
    """
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must lie in [0, 1], got {depth}")
    if n_keys < 1 or n_keys > len(_WORDS) or hops < 0:
        raise ValueError(f"n_keys must lie in [1, {len(_WORDS)}] and hops >= 0; got n_keys={n_keys}, hops={hops}")
    encode = encode or _bytes
    rng = random.Random(f"{kind}/{haystack}/{length}/{depth}/{seed}")
    sentences, question, answer = _needles(kind, rng, n_keys, hops)
    comment = "# " if haystack == "code" else ""
    needle_ids = [list(encode(f"{comment}{s}\n")) for s in sentences]
    question_ids = list(encode(f"\n{comment}{question}" if comment else f"\n{question}"))
    answer_ids = list(encode(answer))
    budget = length - len(question_ids) - sum(map(len, needle_ids))
    if budget < 2 * MAX_PIECE:
        raise ValueError(f"length={length} is too short for a {kind} task (needles and question take "
                         f"{length - budget} tokens; need at least {2 * MAX_PIECE} haystack tokens)")
    # haystack pieces from a random starting line, wrapping around
    lines = haystack_lines(haystack)
    start = rng.randrange(len(lines))
    pieces: list[list[int]] = []
    total = 0
    i = start
    while total < budget:
        ids = list(encode(lines[i % len(lines)]))
        for c in range(0, len(ids), MAX_PIECE):
            pieces.append(ids[c:c + MAX_PIECE])
            total += len(pieces[-1])
        i += 1
    excess = total - budget
    while excess:  # cut the tail to the exact budget
        cut = min(excess, len(pieces[-1]))
        pieces[-1] = pieces[-1][:len(pieces[-1]) - cut]
        excess -= cut
        if not pieces[-1]:
            pieces.pop()
    starts = [0]
    for p in pieces:
        starts.append(starts[-1] + len(p))

    def slot(share: float) -> int:  # the piece boundary nearest to share * budget
        target = share * budget
        return min(range(len(starts)), key=lambda j: (abs(starts[j] - target), j))

    if kind == "vartrack":  # the chain follows the first assignment, spread over the rest of the haystack
        shares = [depth] + [depth + (1.0 - depth) * (h + 1) / (hops + 1) for h in range(hops)]
    else:
        shares = [depth] + [rng.random() for _ in sentences[1:]]
    slots = [slot(s) for s in shares]
    # insert from the back so earlier slots keep their meaning; equal slots keep the sentence order
    order = sorted(range(len(sentences)), key=lambda n: (slots[n], n))
    inserted: dict[int, list[int]] = {}
    for n in order:
        inserted.setdefault(slots[n], []).append(n)
    out: list[int] = []
    positions = [0] * len(sentences)
    for j in range(len(pieces) + 1):
        for n in inserted.get(j, []):
            positions[n] = len(out)
            out += needle_ids[n]
        if j < len(pieces):
            out += pieces[j]
    out += question_ids
    assert len(out) == length, (len(out), length)
    return LongTask(kind, haystack, length, float(depth), seed, torch.tensor(out, dtype=torch.int64),
                    torch.tensor(answer_ids, dtype=torch.int64), answer, tuple(positions))


def make_tasks(
    lengths: Iterable[int],
    depths: Iterable[float],
    *,
    kinds: Iterable[str] = KINDS,
    haystacks: Iterable[str] = HAYSTACKS,
    samples: int = 1,
    seed: int = 0,
    encode: Encode | None = None,
) -> list[LongTask]:
    """Every (kind, haystack, length, depth) combination, ``samples`` tasks each (seeds ``seed, seed + 1, ...``)."""
    return [make_task(kind, hay, length, depth, seed + s, encode=encode)
            for kind in kinds for hay in haystacks for length in lengths for depth in depths for s in range(samples)]


@torch.no_grad()
def score_tasks(model: Any, tasks: Sequence[LongTask], *, method: str = "teacher_forced") -> list[dict]:
    """Score each task on ``model`` (a causal LM returning ``.logits``), one task per forward.

    Args:
        method: ``"teacher_forced"``: one forward over prompt + answer; solved iff every answer token is its
            position's argmax (the same outcome as greedy decoding), plus the answer's log-probability;
            ``"generate"``: ``model.generate`` greedily for the answer's length and compare (serves the prompt
            through the model's attention implementation, e.g. a registered sparse prefill).

    Returns:
        One dict per task: kind, haystack, length, depth, seed, correct (bool), token_accuracy (share of answer
        tokens right), logprob (teacher-forced only, else None).
    """
    if method not in ("teacher_forced", "generate"):
        raise ValueError(f"method must be 'teacher_forced' or 'generate', got {method!r}")
    device = next(model.parameters()).device
    results = []
    for task in tasks:
        a = task.answer_ids.numel()
        if method == "teacher_forced":
            ids = task.full_ids().to(device)[None]
            logits = _answer_logits(model, ids, task.length, a)
            target = task.answer_ids.to(device)
            hit = logits.argmax(-1) == target
            logprob = float(torch.log_softmax(logits, -1).gather(-1, target[:, None]).sum())
        else:
            ids = task.input_ids.to(device)[None]
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=a,
                                 min_new_tokens=a, do_sample=False)
            got = out[0, task.length:task.length + a].cpu()
            hit = got == task.answer_ids
            logprob = None
        results.append(dict(kind=task.kind, haystack=task.haystack, length=task.length, depth=task.depth,
                            seed=task.seed, correct=bool(hit.all()), token_accuracy=float(hit.float().mean()),
                            logprob=logprob))
    return results


def _answer_logits(model: Any, ids: torch.Tensor, length: int, a: int) -> torch.Tensor:
    """``[a, V]`` float32 logits at positions ``length - 1 .. length + a - 2`` (each predicts an answer token). Only
    the last ``a + 1`` positions go through the LM head (``logits_to_keep``): the full logits of a 64K-token prompt
    would take GBs; a model whose forward does not take it computes them all."""
    try:
        logits = model(input_ids=ids, logits_to_keep=a + 1).logits[0]
    except TypeError:
        return model(input_ids=ids).logits[0, length - 1:length - 1 + a].float()
    if logits.shape[0] != a + 1:  # the argument was accepted but not applied
        return logits[length - 1:length - 1 + a].float()
    return logits[:a].float()


def summarize(results: Sequence[dict], by: Sequence[str] = ("length",)) -> dict[str, float]:
    """Exact-match accuracy grouped by the given fields (e.g. ``("length",)`` or ``("length", "depth")``): keys are
    the field values joined by ``/``."""
    groups: dict[str, list[bool]] = {}
    for r in results:
        groups.setdefault("/".join(str(r[f]) for f in by), []).append(r["correct"])
    return {k: sum(v) / len(v) for k, v in sorted(groups.items())}
