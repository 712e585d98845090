"""An imported Hugging Face checkpoint brings its tokenizer: the run names it, it round-trips
text as `transformers` tokenizes it, generation decodes through it (the same greedy text as
`transformers`), and analysis reads real text tokenized with it, measured per byte."""

import json
import shutil

import numpy as np
import pytest
import torch
import transformers

from tests.test_shards import kjv_texts
from train.data.tokenizer import load_tokenizer, train_bpe
from train.interop import import_hf
from train.restore import bytes_per_token, restore_for_analysis, restore_run
from train.sampling import generate_text

PROMPT = "And God said, Let there be light"


@pytest.mark.slow
def test_imported_checkpoint_tokenizes_generates_and_evaluates_with_its_tokenizer(tmp_path):
    tokenizer_json = train_bpe(kjv_texts(60), 300, tmp_path / "bpe")
    torch.manual_seed(0)
    reference = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_embd=32, n_layer=2, n_head=4, vocab_size=300, n_positions=64, bos_token_id=0,
        eos_token_id=0)).eval()
    checkpoint = tmp_path / "checkpoint"
    reference.save_pretrained(checkpoint, safe_serialization=True)
    shutil.copyfile(tokenizer_json, checkpoint / "tokenizer.json")
    run = tmp_path / "run"
    import_hf.import_checkpoint(checkpoint, run, seq_len=32)

    spec = json.loads((run / "config.json").read_text())["data"]["tokenizer"]
    assert spec == f"hf:{(run / 'tokenizer.json').absolute()}"
    tokenizer = load_tokenizer(spec)
    reference_tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(checkpoint / "tokenizer.json"))
    for text in (PROMPT, "héllo wörld — 世界 🙂\n\nx"):
        ids = tokenizer.encode(text)
        assert ids.tolist() == reference_tokenizer.encode(text)
        assert tokenizer.decode(ids) == text

    program, _, state = restore_run(run)
    sample = generate_text(program, state, PROMPT, 8, temperature=0)
    with torch.no_grad():
        greedy = reference.generate(torch.as_tensor(tokenizer.encode(PROMPT))[None].long(),
                                    max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert sample == PROMPT + tokenizer.decode(greedy[0, len(tokenizer.encode(PROMPT)):].numpy())

    text_file = tmp_path / "eval.txt"
    text_file.write_text(" ".join(kjv_texts(3)))
    _, _, _, tokens_BxT1 = restore_for_analysis(run, batch=8, seq_len=16, text=text_file)
    document = tokenizer.encode(text_file.read_text())
    windows = {tuple(document[w * 16:w * 16 + 17]) for w in range((len(document) - 1) // 16)}
    assert all(tuple(row) in windows for row in np.asarray(tokens_BxT1))
    per_token = bytes_per_token(tokens_BxT1, program.config)
    decoded = sum(len(tokenizer.decode(row[1:]).encode()) for row in np.asarray(tokens_BxT1))
    assert per_token == decoded / tokens_BxT1[:, 1:].size and per_token > 1.5
