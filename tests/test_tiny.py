"""The tiny model: loadable by transformers, reproducible, and it speaks the protocol now and then."""

import hashlib
from pathlib import Path

from transformers import AutoModelForCausalLM, AutoTokenizer

from alfrl.tiny import write_tiny_model


def _digests(folder: Path) -> dict:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir()) if p.is_file()}


def test_same_seed_same_files_other_seed_other_weights(tmp_path):
    a = write_tiny_model(tmp_path / "a", seed=0, pretrain_steps=3)
    b = write_tiny_model(tmp_path / "b", seed=0, pretrain_steps=3)
    c = write_tiny_model(tmp_path / "c", seed=1, pretrain_steps=3)
    assert _digests(a) == _digests(b)
    assert _digests(a)["model.safetensors"] != _digests(c)["model.safetensors"]
    assert _digests(a)["tokenizer.json"] == _digests(c)["tokenizer.json"]


def test_it_is_a_normal_hugging_face_folder(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert model.config.model_type == "qwen3" and model.num_parameters() < 2_000_000
    assert sum(f.stat().st_size for f in Path(tiny_model_dir).iterdir()) < 5_000_000
    for special in ("<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>", "<think>", "</think>"):
        assert len(tok.encode(special, add_special_tokens=False)) == 1, special
    text = "go to countertop 1 and take apple 1 from countertop 1"
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text
    assert len(tok.encode(text, add_special_tokens=False)) <= 14  # ALFWorld words are in the vocabulary
    assert tok.chat_template and "tool_response" in tok.chat_template


def test_the_pretrained_tiny_model_sometimes_answers_with_a_well_formed_call(tiny_model_dir):
    from alfrl import protocol
    from alfrl.chat import chat_format
    from alfrl.engines import HFEngine, SamplingRequest

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    fmt = chat_format(tok, "tool_call")
    prompt = fmt.first_prompt_ids("Your task is to: put a mug in desk.\n\nStep 1 of 50.\nObservation: You are in a room.\nAvailable actions:\ngo to desk 1\nlook")
    engine = HFEngine(AutoModelForCausalLM.from_pretrained(tiny_model_dir), tok.pad_token_id)
    (outs,) = engine.generate([SamplingRequest(tuple(prompt), 64, 1.0, 1.0, 48, fmt.stop_token_ids, seed=0)])
    valid = [protocol.parse_completion(fmt.completion_text(list(c.token_ids)), "tool_call").valid for c in outs]
    assert 1 <= sum(valid) < 64  # some valid, some not: rewards can differ inside a group
