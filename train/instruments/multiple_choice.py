"""Multiple-choice evaluation by log-likelihood, as lm-eval-harness scores its multiple-choice
tasks: accuracy beside loss.

A run scores every choice c of an item (`train.data.tasks`: context, choices, gold) by the
log-likelihood of its tokens after the context,

    ℓ(c) = Σ_i log p(c_i | context, c_<i),

reading the context from the left until context and choice fit the model's window (lm-eval's
truncation). The item counts for `acc` when the gold choice has the largest ℓ, and for
`acc_norm` when it has the largest ℓ per UTF-8 byte of the choice (lm-eval's length
normalization). Each accuracy comes with its Wilson 95% interval over the items.

`next_verse_items` builds the shipped task (experiments/tasks/kjv_next_verse.jsonl, by
`scripts/evaluate.py --make_task`): how a verse of a held-out chapter goes on after its first
half, against the same span of three other verses of the same book.

Cost: one forward pass of the window per choice.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from scipy import stats

from config import ConfigError
from config.validate import VALIDATION_BOOKS
from train import restore
from train.data import in_memory, tasks
from train.data.tasks import Item
from train.data.tokenizer import tokenizer_of


def encode_choices(items: Sequence[Item], encode, window: int
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(inputs, targets, mask), each (Σ choices)×`window`, one row per (item, choice) in
    order: context + choice tokens, left-truncated to `window` + 1 and right-padded; `mask` is 1
    where the target is one of the choice's tokens. `encode`: text → token ids."""
    rows = sum(len(item.choices) for item in items)
    inputs = np.zeros((rows, window), np.int32)
    targets = np.zeros((rows, window), np.int32)
    mask = np.zeros((rows, window), np.float32)
    row = 0
    for item in items:
        context = np.asarray(encode(item.context), np.int32)
        for choice in item.choices:
            continuation = np.asarray(encode(choice), np.int32)
            sequence = np.concatenate([context, continuation])[-(window + 1):]
            length = len(sequence) - 1
            inputs[row, :length], targets[row, :length] = sequence[:-1], sequence[1:]
            mask[row, max(length - len(continuation), 0):length] = 1
            row += 1
    return inputs, targets, mask


def choice_loglikelihoods(model: nnx.Module, inputs: np.ndarray, targets: np.ndarray,
                          mask: np.ndarray, batch: int = 64) -> np.ndarray:
    """ℓ of every row of `encode_choices`: Σ of the masked targets' log-probabilities, in float32,
    `batch` rows per forward pass (the last batch padded)."""
    graphdef, state = nnx.split(model)

    @jax.jit
    def score(state, inputs_BxT, targets_BxT, mask_BxT):
        logits = nnx.merge(graphdef, state)(inputs_BxT).astype(jnp.float32)
        picked = jnp.take_along_axis(jax.nn.log_softmax(logits), targets_BxT[..., None], -1)
        return jnp.sum(picked[..., 0] * mask_BxT, axis=-1)

    rows = len(inputs)
    padded = -(-rows // batch) * batch
    pad = [(0, padded - rows), (0, 0)]
    arrays = [np.pad(array, pad) for array in (inputs, targets, mask)]
    return np.concatenate([np.asarray(score(state, *(a[start:start + batch] for a in arrays)))
                           for start in range(0, padded, batch)])[:rows]


def wilson(correct: int, total: int) -> tuple[float, float]:
    """The Wilson 95% interval of a proportion correct / total."""
    interval = stats.binomtest(correct, total).proportion_ci(0.95, method="wilson")
    return float(interval.low), float(interval.high)


def accuracy(items: Sequence[Item], loglikelihoods: np.ndarray) -> dict:
    """{"items", "acc", "acc_interval", "acc_norm", "acc_norm_interval"} of the scores ℓ, one per
    (item, choice) in order (`encode_choices`)."""
    correct = normalized = 0
    start = 0
    for item in items:
        scores = loglikelihoods[start:start + len(item.choices)]
        start += len(item.choices)
        per_byte = scores / np.array([len(c.encode("utf-8")) for c in item.choices])
        correct += int(np.argmax(scores) == item.gold)
        normalized += int(np.argmax(per_byte) == item.gold)
    total = len(items)
    return {"items": total, "acc": correct / total, "acc_interval": wilson(correct, total),
            "acc_norm": normalized / total, "acc_norm_interval": wilson(normalized, total)}


# The shipped task ------------------------------------------------------------------------------

HELD_OUT = ("chapters", "books")  # data.validation's splits of the KJV


def _held_out_chapter(index: int, book: str, held_out: str) -> bool:
    """Whether chapter `index` (canonical order) of `book` is in the validation split of
    `data.validation=held_out`: every 20th chapter (`in_memory.KjvBible`) or the held-out
    books (`config.validate.VALIDATION_BOOKS`)."""
    return index % 20 == 19 if held_out == "chapters" else book in VALIDATION_BOOKS


def _first_words(text: str, limit: int) -> str:
    """The longest run of `text`'s first words within `limit` UTF-8 bytes (at least one word)."""
    words, kept = text.split(), []
    for word in words:
        if kept and len(" ".join([*kept, word]).encode("utf-8")) > limit:
            break
        kept.append(word)
    return " ".join(kept)


def _continuation(words: list[str], start: int, limit: int) -> str:
    """" " + the words of `words` from `start` on, as many as fit `limit` UTF-8 bytes (one at
    least)."""
    return " " + _first_words(" ".join(words[start:]), limit)


def next_verse_items(held_out: str = "chapters", distractors: int = 3, prefix_bytes: int = 32,
                     seed: int = 0) -> list[Item]:
    """The verse-continuation task: for each verse of every chapter in the validation split of
    `data.validation=held_out` that has a verse before it and at least 8 words, the context is
    the verse before it and the first half of its words, and the choices are " " + the words
    that follow (≤ `prefix_bytes` bytes) and the same span from `distractors` other verses of
    the same book (each from a random word after its first), all different, each of at least
    2/3 of `prefix_bytes` (so that length does not decide raw accuracy), in a seeded random
    order. A byte-level run reads a chapter's verses joined by spaces, so the true choice is the
    text that follows the context."""
    if held_out not in HELD_OUT:
        raise ConfigError(f"--held_out={held_out} is invalid: one of {HELD_OUT}")
    with in_memory.kjv_file().open("rb") as handle:
        verses = [json.loads(line) for line in handle if line.strip()]
    rng = np.random.default_rng(seed)
    shortest = 2 * prefix_bytes // 3  # every choice of about one length: raw acc not by length
    by_book: dict[str, list[list[str]]] = {}
    chapters: list[tuple[tuple[str, int], list[str]]] = []
    for verse in verses:
        by_book.setdefault(verse["book"], []).append(verse["text"].split())
        key = (verse["book"], verse["chapter"])
        if not chapters or chapters[-1][0] != key:
            chapters.append((key, []))
        chapters[-1][1].append(verse["text"])
    items = []
    for index, ((book, _), texts) in enumerate(chapters):
        if not _held_out_chapter(index, book, held_out):
            continue
        for previous, verse in zip(texts, texts[1:], strict=False):
            words = verse.split()
            if len(words) < 8:
                continue
            half = len(words) // 2
            choices, tries = [_continuation(words, half, prefix_bytes)], 0
            if len(choices[0].encode("utf-8")) < shortest:
                continue
            while len(choices) <= distractors and tries < 100:
                tries += 1
                other = by_book[book][rng.integers(len(by_book[book]))]
                if len(other) < 4:
                    continue
                candidate = _continuation(other, int(rng.integers(1, len(other) - 2)),
                                          prefix_bytes)
                if candidate not in choices and len(candidate.encode("utf-8")) >= shortest:
                    choices.append(candidate)
            if len(choices) <= distractors:
                continue
            order = rng.permutation(len(choices))
            items.append(Item(f"{previous} {' '.join(words[:half])}",
                              tuple(choices[i] for i in order),
                              int(np.flatnonzero(order == 0)[0])))
    return items


def chance(items: Sequence[Item]) -> float:
    """The accuracy of guessing: the mean of 1 / (number of choices)."""
    return float(np.mean([1 / len(item.choices) for item in items])) if items else math.nan


def evaluate_run(workdir: str | Path, task: str | Path, *, ema: bool = False,
                 batch: int = 64) -> dict:
    """The run's newest checkpoint (its EMA with `ema`) scored on the task file `task` at the
    run's seq_len: `accuracy`, with the task's name and SHA-256, the step, chance and `ema`.
    Raises FileNotFoundError or ConfigError in one line."""
    items = tasks.load_task(task)
    program, step, state = restore.restore_run(workdir)
    if ema:
        state = restore.with_ema_params(state, workdir)
    model = nnx.merge(program.graphdef, state["params"], state["model_state"])
    model.eval()
    config = program.config
    arrays = encode_choices(items, tokenizer_of(config.data).encode, config.seq_len)
    scores = choice_loglikelihoods(model, *arrays, batch=batch)
    return {"task": Path(task).stem, "sha256": tasks.task_digest(task), "step": int(step),
            "ema": ema, "chance": chance(items), **accuracy(items, scores)}
