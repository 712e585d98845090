"""The training-length study (experiments/attnres_length.py, issue 41 item 3): the KJV split by
whole books, the default split unchanged, the study's cells and the report's length section."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import ml_collections
import numpy as np
import pytest

from arch.accounting import parameter_count
from config import ConfigError, resolve
from config.defaults import base_config
from config.validate import KJV_BOOKS, VALIDATION_BOOKS, check_fields, check_training
from train.data import in_memory
from train.studies import study as studies
from train.studies.report import describe, write_report

ROOT = Path(__file__).resolve().parents[1]
STUDY = "experiments/attnres_length.py"
# sha256 of the default (every 20th chapter) split's tokens and of 12 of its batches (steps 0,
# 1, 799 at seeds 0, 3; batch 32 × 128), recorded from the code before data.validation existed.
DEFAULT_SPLIT = {
    "train": (3935430, "2bc31e218d1418f5f01d560c815354dd7a1fdd8374245ef4d65a304e1b7a5fa6",
              "65711e1a0393cd7e0a8908fd388e7731446267e36f484983a5f1bc4d04345798"),
    "validation": (202020, "fbd0e22062f6e1a103f05bc17bb1d1fd7d5b5435aa5c05949057ceb01b024c2b",
                   "573518811f0fe0aee393b444399db8dea291dcbf8e1a224a17c95a3bce3a8d2d"),
}


def _data(**fields) -> ml_collections.ConfigDict:
    data = base_config().data
    data.update(fields)
    return data


def _sha(array) -> str:
    return hashlib.sha256(np.ascontiguousarray(array).tobytes()).hexdigest()


@pytest.fixture(scope="module")
def chapters() -> list[tuple[str, int, str]]:
    return in_memory.kjv_chapters()


def test_the_book_names_are_the_corpus_books_in_order(chapters):
    assert tuple(dict.fromkeys(book for book, _, _ in chapters)) == KJV_BOOKS
    assert len(chapters) == 1189 and set(VALIDATION_BOOKS) <= set(KJV_BOOKS)


@pytest.mark.parametrize("books", [(), ("Jude", "Genesis")])
def test_the_book_split_holds_out_whole_books_that_never_train(tmp_path, chapters, books):
    data = _data(data_dir=str(tmp_path), validation="books", validation_books=books)
    held_out = set(books or VALIDATION_BOOKS)
    train, validation = (in_memory.load(data, split) for split in ("train", "validation"))
    # Chapter ids (book, number) of each split, recovered from its documents.
    ids = {text: (book, number) for book, number, text in chapters}
    split_ids = {split: [ids[text] for text in in_memory.decode(ds.tokens).split("\n")]
                 for split, ds in (("train", train), ("validation", validation))}
    assert {book for book, _ in split_ids["validation"]} == held_out
    assert not {book for book, _ in split_ids["train"]} & held_out
    assert not set(split_ids["train"]) & set(split_ids["validation"])
    assert len(split_ids["train"]) + len(split_ids["validation"]) == len(chapters)
    # Every training window lies inside the train stream, which holds no held-out text.
    assert len(train.tokens) + len(validation.tokens) + 2 == sum(  # a separator fewer each
        len(text.encode()) + 1 for _, _, text in chapters)
    batch = train.batch(5, 4, 128, seed=1)
    stream = train.tokens.tobytes()
    assert all(row.astype(np.uint8).tobytes() in stream for row in batch)
    np.testing.assert_array_equal(batch, train.batch(5, 4, 128, seed=1))  # pure in (seed, step)


def test_the_default_chapter_split_is_unchanged(tmp_path):
    for validation in (None, "chapters"):
        data = _data(data_dir=str(tmp_path))
        if validation:
            data.validation = validation
        for split, (size, tokens, batches) in DEFAULT_SPLIT.items():
            ds = in_memory.load(data, split)
            assert len(ds.tokens) == size and _sha(ds.tokens) == tokens
            batch = np.concatenate([ds.batch(step, 32, 128, seed) for step in (0, 1, 799)
                                    for seed in (0, 3)])
            assert _sha(batch) == batches


def test_a_tuning_split_cuts_the_tail_of_the_book_train_split(tmp_path):
    books = _data(data_dir=str(tmp_path), validation="books")
    train = in_memory.load(books, "train").tokens
    books.tuning_fraction = 0.1
    tuned, tuning = (in_memory.load(books, split).tokens for split in ("train", "validation"))
    np.testing.assert_array_equal(np.concatenate([tuned, tuning]), train)
    assert len(tuning) == int(len(train) * 0.1)


@pytest.mark.parametrize("fields, message", [
    (dict(validation="verses"), "data.validation='verses' is invalid: valid splits: chapters, "
     "books"),
    (dict(validation_books=("Ruth",)), "is only read with data.validation='books'"),
    (dict(validation="books", name="text", path="*.txt"), "needs data.name='kjv', not 'text'"),
    (dict(validation="books", validation_books=("Ruth", "Enoch")), "names 'Enoch', not a book"),
    (dict(validation="books", validation_books=("Ruth", "Ruth")), "repeats a book"),
    (dict(validation="books", validation_books=KJV_BOOKS), "leaving none to train on"),
])
def test_a_bad_validation_option_is_a_one_line_error(fields, message):
    config = base_config()
    config.data.update(fields)
    with pytest.raises(ConfigError) as error:
        check_training(config)
    assert message in str(error.value) and "\n" not in str(error.value)


def test_the_study_declares_lengths_and_every_cell_builds():
    from experiments import attnres_length as module

    study = studies.load_study(STUDY)
    assert study.scaling_axis == "steps" and study.scaling == tuple(module.LENGTHS)
    assert len(study.cells()) == 12 and study.seeds == (0, 1, 2)
    assert [c.check() for c in study.claims] == ["block@steps3200 < baseline@steps3200",
                                                 "full@steps3200 < baseline@steps3200"]
    assert {c.n for c in study.claims} == {3} and {c.family for c in study.claims} == {
        "AttnRes length"}
    per_parameter = {}
    for cell in study.cells():
        arm, size = studies.split_cell(cell)
        config = module.get_config(f"{cell},cpu")
        check_fields(config)
        resolved = resolve(config, 1)
        assert config.steps == module.LENGTHS[size] and config.optimizer.schedule == "cosine"
        assert config.data.validation == "books" and resolved.model.num_layers == 8
        tokens = config.steps * config.batch_size * config.seq_len
        per_parameter[cell] = tokens / parameter_count(resolved.model)
    baseline = [per_parameter[f"baseline@{size}"] for size in study.scaling]
    assert baseline == pytest.approx([3.764, 7.528, 15.057, 30.113], abs=1e-3)  # docstring
    assert min(per_parameter[f"{arm}@steps3200"] for arm in study.arms) >= 20


def test_a_scaling_study_claim_names_cells(tmp_path):
    text = (ROOT / STUDY).read_text().replace('"block@steps3200", "<"', '"block", "<"')
    (tmp_path / "bad.py").write_text(text)
    with pytest.raises(Exception, match="not in a scaling study") as error:
        studies.load_study(str(tmp_path / "bad.py"))
    assert "\n" not in str(error.value)


def _write_runs(root: Path, study: studies.Study) -> None:
    """Run directories by hand: each cell's resolved config.json and a metrics.jsonl whose final
    loss falls with length; Block's gain shrinks from 0.05 to 0.01, Full's stays at 0.03."""
    from experiments import attnres_length as module

    gains = {"baseline": [0.0] * 4, "block": [-0.05, -0.03, -0.02, -0.01], "full": [-0.03] * 4}
    for cell in study.cells():
        arm, size = studies.split_cell(cell)
        config = resolve(module.get_config(f"{cell},cpu"), 1)
        index = study.scaling.index(size)
        for seed in study.seeds:
            workdir = studies.run_dir(root, cell, seed)
            workdir.mkdir(parents=True)
            (workdir / "config.json").write_text(config.to_json_best_effort())
            noise = np.random.default_rng([seed, index, len(arm)]).normal(0, 0.002)
            loss = 2.0 - 0.1 * index + 0.01 * seed + gains[arm][index] + noise
            (workdir / "metrics.jsonl").write_text(json.dumps(
                {"step": config.steps, "train_loss": loss, "eval_loss": loss}) + "\n")


@pytest.mark.slow
def test_the_report_tables_delta_per_length_and_plots_it(tmp_path):
    study = studies.load_study(STUDY)
    root = tmp_path / "root"
    studies.record(root, study, "cpu", study.cells(), list(study.seeds), [])
    _write_runs(root, study)
    write_report(root, describe(root, None))
    report = (root / "report.md").read_text()
    assert "## Training length" in report and (root / "delta_vs_tokens.png").stat().st_size
    rows = {line.split(" | ")[0][2:]: line.split(" | ")[1:] for line in report.splitlines()
            if line.startswith("| steps")}
    assert rows["steps400"][:4] == ["400", "1,638,400", "3.8", "0.42"]
    assert rows["steps3200"][:4] == ["3200", "13,107,200", "30.1", "3.36"]
    block, full = rows["steps400"][4], rows["steps3200"][5].rstrip(" |")
    def final(cell):
        return [json.loads((studies.run_dir(root, cell, seed) / "metrics.jsonl").read_text())
                ["eval_loss"] for seed in study.seeds]

    base = np.mean(final("baseline@steps400"))
    relative = 100 * (np.mean(final("block@steps400")) - base) / base
    assert block.startswith("-0.05") and block.endswith(f"(3); {relative:+.1f}%")
    assert full.startswith("-0.03") and " [" in full
    trend = {line.split(" | ")[0][2:]: line for line in report.splitlines()
             if line.startswith(("| block | +", "| full | +", "| full | -"))}
    assert trend["block"].endswith("| shrinks |") and trend["full"].endswith("| stays |")
    assert "| block@steps3200 < baseline@steps3200 |" in report  # the registered claims

    del_axis = json.loads((root / "study.json").read_text())
    del del_axis["scaling_axis"]  # the same sweep as a scaling study over model sizes
    (root / "study.json").write_text(json.dumps(del_axis))
    write_report(root, describe(root, None))
    assert "## Training length" not in (root / "report.md").read_text()


@pytest.mark.slow
def test_a_report_with_only_the_first_length_trained_leaves_the_others_empty(tmp_path):
    """A sweep part of the way through: the lengths without runs are rows of dashes."""
    study = studies.load_study(STUDY)
    root = tmp_path / "root"
    studies.record(root, study, "cpu", study.cells(), list(study.seeds), [])
    _write_runs(root, study)
    for cell in study.cells():
        if not cell.endswith("@steps400"):
            shutil.rmtree(root / cell)
    write_report(root, describe(root, None))
    rows = {line.split(" | ")[0][2:]: line.split(" | ")[1:] for line in
            (root / "report.md").read_text().splitlines() if line.startswith("| steps")}
    assert rows["steps400"][:4] == ["400", "1,638,400", "3.8", "0.42"]
    assert rows["steps800"][:4] == ["—"] * 4
