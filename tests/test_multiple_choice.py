"""Multiple-choice accuracy by log-likelihood (train/data/tasks.py,
train/instruments/multiple_choice.py, scripts/evaluate.py): the scores equal the model's own
log-probabilities read one row at a time, the accuracies equal a hand count, the shipped task's
gold choice is the text that follows, and bad input is one line."""

from __future__ import annotations

import json
import math
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx

from config import ConfigError
from scripts import evaluate as evaluate_script
from tests.helpers import tiny_config, tiny_model, write_run
from train import restore
from train.data import tasks
from train.data.tasks import Item
from train.instruments import multiple_choice
from train.instruments.multiple_choice import accuracy, choice_loglikelihoods, encode_choices

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = ROOT / "experiments" / "tasks" / "kjv_next_verse.jsonl"


def byte_encode(text: str) -> np.ndarray:
    return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32)


def test_choices_are_masked_after_the_context_and_the_context_is_cut_from_the_left():
    def text(row):
        return bytes(row.astype(np.uint8)).decode()

    items = [Item("abcdef", (" xy", " z"), 0)]
    inputs, targets, mask = encode_choices(items, byte_encode, window=6)
    # "abcdef xy": its last window + 1 = 7 tokens, "cdef xy", as inputs and shifted targets
    assert text(inputs[0]) == "cdef x" and text(targets[0]) == "def xy"
    assert mask[0].tolist() == [0, 0, 0, 1, 1, 1]  # " xy" are the last three targets
    assert text(inputs[1]) == "bcdef " and mask[1].tolist() == [0, 0, 0, 0, 1, 1]
    short = encode_choices([Item("ab", (" c",), 0)], byte_encode, window=6)
    assert short[2][0].tolist() == [0, 1, 1, 0, 0, 0]  # "ab c": targets "b c", padded


def test_the_scores_equal_the_models_log_probabilities_row_by_row():
    """Batched, padded scoring equals each row's log-probabilities read from an unpadded
    forward pass of that row alone (separately compiled programs: a tolerance)."""
    _, model = tiny_model()
    items = [Item("In the beginning", (" God", " man", " was the word"), 0),
             Item("And he said", (" unto them", " nothing"), 1)]
    arrays = encode_choices(items, byte_encode, window=16)
    scores = choice_loglikelihoods(model, *arrays, batch=4)  # 5 rows: the last batch padded
    for row, (item, choice) in enumerate((i, c) for i in items for c in i.choices):
        sequence = np.concatenate([byte_encode(item.context), byte_encode(choice)])[-17:]
        logits = model(sequence[None, :-1])[0]
        log_probs = np.asarray(jax.nn.log_softmax(logits.astype(np.float32)))
        picked = log_probs[np.arange(len(sequence) - 1), sequence[1:]]
        expected = picked[-len(byte_encode(choice)):].sum()
        assert scores[row] == pytest.approx(expected, rel=1e-5, abs=1e-5)


def test_accuracy_counts_the_gold_choice_raw_and_per_byte():
    items = [Item("c", (" a", " bbbb"), 1), Item("c", (" a", " bb"), 0)]
    # item 1: raw picks " a" (−1 > −2), per byte " bbbb" (−2/5 > −1/2): gold 1 → norm only
    # item 2: raw picks " a" (−1 > −3), per byte " a" (−1/2 > −3/3): gold 0 → both
    result = accuracy(items, np.array([-1.0, -2.0, -1.0, -3.0]))
    assert (result["acc"], result["acc_norm"], result["items"]) == (0.5, 1.0, 2)
    low, high = result["acc_interval"]
    assert low < 0.5 < high and result["acc_norm_interval"][1] == pytest.approx(1.0)


def test_the_shipped_task_is_built_from_held_out_chapters_with_the_true_continuation():
    """Rebuilding gives the committed file byte for byte; every item's context + gold choice is
    text of a held-out chapter (every 20th, the validation split of data.validation="chapters"),
    and its choices are distinct and of comparable length."""
    items = multiple_choice.next_verse_items("chapters")
    assert items == tasks.load_task(SHIPPED) and len(items) > 1000
    from train.data import in_memory

    held_out = " ".join(text for index, (_, _, text) in enumerate(in_memory.kjv_chapters())
                        if index % 20 == 19)
    for item in items[::50]:
        assert item.context + item.choices[item.gold] in held_out
        assert len(set(item.choices)) == 4
        assert all(21 <= len(c.encode()) <= 33 for c in item.choices)
    assert multiple_choice.chance(items) == 0.25
    books = multiple_choice.next_verse_items("books")
    assert {item.context.split()[0] for item in books} and books != items


@pytest.mark.parametrize("line, message", [
    ("not json", "line 1 is not an item"),
    ('{"context": "a", "choices": ["b"], "gold": 0}', "line 1 is not an item"),
    ('{"context": "a", "choices": ["b", "c"], "gold": 2}', "line 1 is not an item"),
    ("", "holds no items"),
])
def test_a_bad_task_file_is_one_line(tmp_path, line, message):
    path = tmp_path / "task.jsonl"
    path.write_text(line + "\n")
    with pytest.raises(ConfigError, match=message) as error:
        tasks.load_task(path)
    assert "\n" not in str(error.value)


def test_evaluate_scores_a_run_and_writes_its_result(tmp_path, capsys):
    """scripts/evaluate.py on a run: the JSON holds the library's accuracy of the run's model;
    bad arguments are one line, exit 2, before JAX loads."""
    config = tiny_config()
    config.mesh.data = -1  # the 8 simulated devices
    write_run(config, tmp_path / "run", step=4)
    task = tmp_path / "task.jsonl"
    tasks.write_task([Item("And God said", (" Let there be", " xq zv"), 0),
                      Item("the heaven", (" and the earth.", " qqq"), 0),
                      Item("light", (" zz", " and it was good"), 1)], task)
    assert evaluate_script.main(["--workdir", str(tmp_path / "run"), "--task", str(task)]) == 0
    line = capsys.readouterr().out.strip()
    result = json.loads((tmp_path / "run" / "eval_task.json").read_text())
    assert result["step"] == 4 and result["items"] == 3 and result["chance"] == 0.5
    assert result["sha256"] == tasks.task_digest(task) and not result["ema"]
    assert line.startswith(f"task at step 4: acc {result['acc']:.4f}")
    again = multiple_choice.evaluate_run(tmp_path / "run", task)
    assert again["acc"] == result["acc"] and again["acc_norm"] == result["acc_norm"]
    assert not math.isnan(result["acc_interval"][0])

    assert evaluate_script.main(["--workdir", str(tmp_path / "run"), "--task",
                                 str(tmp_path / "none.jsonl")]) == 2
    assert capsys.readouterr().err.strip() == (f"error: --task={tmp_path / 'none.jsonl'} is not "
                                               "a file; pass a JSON-lines task "
                                               '({"context": ..., "choices": [...], "gold": k} '
                                               "a line)")
    assert evaluate_script.main(["--workdir", str(tmp_path), "--task", str(task)]) == 2
    assert "holds no config.json" in capsys.readouterr().err


def test_the_study_report_tables_accuracy_beside_loss_paired_by_seed(tmp_path):
    """Two arms scored on one task: the report's acc Δ is the paired mean with its t interval;
    runs scored on different versions of a task are not tabled together."""
    from train.studies import report

    def scored(acc, acc_norm, digest="d"):
        return {"task": "t", "sha256": digest, "items": 100, "chance": 0.25, "acc": acc,
                "acc_norm": acc_norm}

    def run(*accuracies, digest="d"):
        return {seed: report.Result(1.0, [], None, [], {"t": scored(*pair, digest)})
                for seed, pair in enumerate(accuracies)}

    results = {"base": run((0.30, 0.32), (0.34, 0.30), (0.32, 0.31)),
               "arm": run((0.35, 0.33), (0.36, 0.36), (0.38, 0.34))}
    lines = report.accuracy_section(results, {"baseline": "base"})
    [row] = [line for line in lines if line.startswith("| arm |")]
    differences = [0.05, 0.02, 0.06]
    mean, std, n = np.mean(differences), np.std(differences, ddof=1), 3
    assert row.split(" | ")[3] == report.interval_text(mean, std, n)
    assert row.split(" | ")[2] == report.value_text(np.mean([0.35, 0.36, 0.38]),
                                                np.std([0.35, 0.36, 0.38], ddof=1), 3)
    assert "| base | 3 |" in "\n".join(lines) and "(baseline)" in "\n".join(lines)
    results["arm"] = run((0.35, 0.33), digest="other")
    assert "scored on 2 versions of the task file" in "\n".join(
        report.accuracy_section(results, {"baseline": "base"}))
    workdir = tmp_path / "run"
    workdir.mkdir()
    (workdir / "eval_t.json").write_text(json.dumps(scored(0.3, 0.3)))
    (workdir / "eval_broken.json").write_text("{")
    assert report.read_accuracy(workdir) == {"t": scored(0.3, 0.3)}


LM_EVAL_TASK = """task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {path}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{gold}}}}"
target_delimiter: ""
metric_list:
  - metric: acc
  - metric: acc_norm
"""


@pytest.mark.slow
def test_lm_eval_harness_on_the_exported_run_scores_every_choice_as_we_do(tmp_path,
                                                                         monkeypatch):
    """The recipe of docs/instruments.md: the run exported with scripts/export_hf.py, the task
    file as a local lm-eval-harness task. Its per-choice log-likelihoods equal ours (two
    programs, two frameworks: a tolerance), and so do acc and acc_norm."""
    lm_eval = pytest.importorskip("lm_eval")
    from lm_eval.tasks import TaskManager

    from scripts import export_hf

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    config = tiny_config()
    config.mesh.data, config.seq_len = -1, 64
    write_run(config, tmp_path / "run", step=4)
    task = tmp_path / "kjv_few.jsonl"
    tasks.write_task(tasks.load_task(SHIPPED)[:12], task)
    assert export_hf.main(["--workdir", str(tmp_path / "run"), "--out", str(tmp_path / "hf")]) \
        == 0
    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / "kjv_few.yaml").write_text(LM_EVAL_TASK.format(name="kjv_few",
                                                                         path=task))
    results = lm_eval.simple_evaluate(
        model="hf", model_args=f"pretrained={tmp_path / 'hf'},dtype=float32,max_length=64,"
        "prefix_token_id=10", tasks=["kjv_few"], device="cpu", batch_size=4, log_samples=True,
        task_manager=TaskManager(include_path=str(tmp_path / "tasks")))
    theirs = [float(choice[0]) for sample in results["samples"]["kjv_few"]
              for choice in sample["filtered_resps"]]
    ours = multiple_choice.evaluate_run(tmp_path / "run", task)
    program, _, state = restore.restore_run(tmp_path / "run")
    model = nnx.merge(program.graphdef, state["params"], state["model_state"])
    scores = choice_loglikelihoods(model, *encode_choices(tasks.load_task(task), byte_encode,
                                                          64))
    np.testing.assert_allclose(scores, theirs, rtol=1e-4, atol=1e-4)
    metrics = results["results"]["kjv_few"]
    assert (metrics["acc,none"], metrics["acc_norm,none"]) == pytest.approx(
        (ours["acc"], ours["acc_norm"]))
