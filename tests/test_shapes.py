"""Qwen3.5's structure on the CPU: a vision-language checkpoint's text stack trains, and its names reach vLLM's loaders."""

from pathlib import Path

import torch
from safetensors.torch import load_file

from alfrl.models import has_linear_attention, is_vision_language, linear_module_names, load_causal_lm, read_config
from alfrl.policy import AlfrlPolicy
from alfrl.policy import LoRAConfig
from alfrl.shapes import build_config

GDN = {"in_proj_qkv", "in_proj_z", "in_proj_a", "in_proj_b", "out_proj"}
ATTENTION_AND_MLP = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}


def test_the_4b_shape_is_the_reference_structure():
    from alfrl.tiny import build_tokenizer

    config = build_config("qwen3.5-4b", build_tokenizer())
    text = config.text_config
    assert type(config).__name__ == "Qwen3_5Config" and config.vision_config.depth == 24
    assert text.layer_types.count("linear_attention") == 24 and text.layer_types.count("full_attention") == 8
    assert (text.hidden_size, text.num_attention_heads, text.num_key_value_heads, text.head_dim) == (2560, 16, 4, 256)
    assert (text.linear_num_key_heads, text.linear_num_value_heads, text.linear_key_head_dim, text.intermediate_size) == (16, 32, 128, 9216)
    assert text.vocab_size == 248320 and config.tie_word_embeddings
    # as the released configs: vLLM reads mamba_ssm_dtype for the Gated DeltaNet state (bf16 without it); the rotary
    # settings of the real checkpoint (a quarter of each 256-wide head: 32 frequencies in sections of 11 / 11 / 10)
    assert text.mamba_ssm_dtype == "float32"
    rope = text.rope_parameters
    assert rope["rope_theta"] == 10_000_000 and rope["mrope_interleaved"] and sum(rope["mrope_section"]) == text.head_dim * rope["partial_rotary_factor"] / 2


def test_the_written_checkpoint_names_the_state_dtype_vllm_reads(qwen35_small_dir):
    import json

    text = json.loads((Path(qwen35_small_dir) / "config.json").read_text())["text_config"]
    assert text["mamba_ssm_dtype"] == "float32"


def test_fewer_layers_keep_every_size_and_the_layer_pattern():
    import pytest

    from alfrl.tiny import build_tokenizer

    text = build_config("qwen3.5-4b", build_tokenizer(), layers=4).text_config
    assert text.layer_types == ["linear_attention"] * 3 + ["full_attention"]
    assert (text.hidden_size, text.linear_num_value_heads, text.head_dim) == (2560, 32, 256)
    assert build_config("qwen3-4b", build_tokenizer(), layers=2).num_hidden_layers == 2
    with pytest.raises(ValueError, match="--layers 0: give at least 1"):
        build_config("qwen3.5-4b", build_tokenizer(), layers=0)


def test_the_text_stack_of_a_vision_language_checkpoint_loads_every_weight(qwen35_small_dir):
    assert is_vision_language(read_config(qwen35_small_dir))
    model = load_causal_lm(qwen35_small_dir, torch.float32, "sdpa")
    assert type(model).__name__ == "Qwen3_5ForCausalLM" and has_linear_attention(model.config)
    checkpoint = load_file(f"{qwen35_small_dir}/model.safetensors")
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight":
            assert torch.equal(tensor, checkpoint["model.language_model.embed_tokens.weight"])  # tied
        else:
            assert torch.equal(tensor, checkpoint["model.language_model." + name.removeprefix("model.")]), name
    assert GDN | ATTENTION_AND_MLP <= linear_module_names(qwen35_small_dir)


def test_lora_targets_every_linear_of_both_layer_kinds_and_names_map_to_the_checkpoint(qwen35_small_dir):
    from alfrl.vllm_engine import VLLMEngine

    policy = AlfrlPolicy(model_name=qwen35_small_dir, dtype="float32", lora=LoRAConfig(rank=4, alpha=8))
    policy.configure_model()
    assert not policy.packable  # linear attention carries state along a row
    merged = dict(policy.merged_weights())
    assert {name.split(".")[-2] for name in merged} == GDN | ATTENTION_AND_MLP
    engine = VLLMEngine.__new__(VLLMEngine)  # only its name mapping, no GPU
    engine.vision_language = True
    checkpoint = set(load_file(f"{qwen35_small_dir}/model.safetensors"))
    assert {engine.checkpoint_name(n) for n in merged} <= checkpoint  # what vLLM's loader reads (model.language_model.*)
    adapter = policy.adapter_weights()
    assert len(adapter.modules) == len(merged)
    for key in adapter.tensors:
        module = engine.checkpoint_name(key).removeprefix("base_model.model.").rsplit(".lora_", 1)[0]
        assert module + ".weight" in checkpoint, key


def test_the_engine_settings_of_a_gdn_checkpoint_pick_a_prefill_kernel_that_is_installed(qwen35_small_dir, tiny_model_dir, monkeypatch):
    import sys
    import types

    import torch

    from alfrl.sampler_config import EngineConfig, auto_gdn_prefill_backend

    extra = EngineConfig(kind="vllm").vllm_extra(qwen35_small_dir)
    assert extra["language_model_only"] is True
    # no GPU here: FlashInfer's kernel for this GPU cannot be the one, so triton (what the offline kit needs on the H200)
    assert extra["additional_config"] == {"gdn_prefill_backend": "triton"}
    assert EngineConfig(kind="vllm", gdn_prefill_backend="flashinfer").vllm_extra(qwen35_small_dir)["additional_config"] == {"gdn_prefill_backend": "flashinfer"}
    assert "additional_config" not in EngineConfig(kind="vllm").vllm_extra(tiny_model_dir)  # no linear attention: vLLM's own choice
    # a Hopper GPU: FlashInfer only when its SM90 kernel imported (vLLM would choose it either way)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    for kernel, expected in ((None, "triton"), (object(), "flashinfer")):
        fake = types.ModuleType("flashinfer")
        fake.gdn_kernels = types.SimpleNamespace(chunk_gated_delta_rule_sm90=kernel)
        monkeypatch.setitem(sys.modules, "flashinfer", fake)
        assert auto_gdn_prefill_backend() == expected
