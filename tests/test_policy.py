"""The LoRA policy (alfrl.policy): which weights train, merged weights for the sampler, adapters loaded back, Qwen3.5's
hybrid layers, the float32 matmul precision, the adapter's dtype and compiled layers. The update itself: test_ppo.py."""

import pytest
import torch

from alfrl.logprobs import predicted_logprobs
from alfrl.policy import AlfrlPolicy, LoRAConfig
from alfrl.ppo import PPOConfig, collate, ppo_update
from tests.helpers import tail_sample

LORA8 = LoRAConfig(rank=8, alpha=16)


def test_only_lora_weights_train(policy):
    trainable = [n for n, p in policy.model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)


def test_merged_weights_are_base_plus_delta_under_hugging_face_names(policy, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()
    merged = dict(policy.merged_weights())
    assert merged and set(merged) <= set(base)
    assert "model.layers.0.self_attn.q_proj.weight" in merged and "model.layers.1.mlp.down_proj.weight" in merged
    for name, tensor in merged.items():
        assert not torch.equal(tensor, base[name])  # LoRA B is non-zero here
    # loading them into a plain model gives the LoRA model's outputs
    plain = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    plain.load_state_dict({**plain.state_dict(), **merged})
    ids = torch.randint(0, 1000, (1, 12))
    policy.model.eval()
    assert torch.allclose(plain(ids).logits, policy.model(ids).logits, atol=1e-5)


def test_lora_targets_every_qwen3_projection(policy):
    targeted = {name.split(".")[-2] for name, _ in policy.merged_weights()}
    assert targeted == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    assert len(dict(policy.merged_weights())) == 2 * 7  # every projection of both layers, not the output layer


def test_problems_name_the_key_and_the_fix():
    problems = AlfrlPolicy.problems({"model_name": "x", "optim": {"lr": 0.0}, "ppo": {"clip_low": 1.1, "clip_high": 0.9, "loss_aggregation": "sum"},
                                     "lora": {"rank": 0}})
    text = "\n".join(problems)
    for key in ("model.optim.lr=0.0", "model.ppo.clip_low=1.1", "model.ppo.clip_high=0.9", "model.ppo.loss_aggregation='sum'", "model.lora.rank=0"):
        assert key in text, text
    assert len(problems) == 5


def test_qwen35_hybrid_layers_get_lora_and_chunked_logprobs(tmp_path):
    """Qwen3.5's text model mixes Gated DeltaNet (linear_attn.in_proj_*/out_proj) and full attention layers."""
    from transformers import AutoModelForCausalLM
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig

    from alfrl.tiny import build_tokenizer

    tok = build_tokenizer()
    cfg = Qwen3_5TextConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=16, linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2,
                            linear_num_value_heads=4, full_attention_interval=2, tie_word_embeddings=True)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    policy = AlfrlPolicy(model_name=str(tmp_path), dtype="float32", lora=LoRAConfig(rank=4, alpha=8))
    policy.configure_model()
    merged = dict(policy.merged_weights())
    targeted = {name.split(".")[-2] for name in merged}
    assert {"in_proj_qkv", "in_proj_z", "in_proj_a", "in_proj_b", "out_proj", "q_proj", "o_proj", "gate_proj", "down_proj"} <= targeted
    assert set(merged) <= set(AutoModelForCausalLM.from_pretrained(tmp_path).state_dict())
    assert not policy.packable  # Gated DeltaNet carries state along a row: one sequence per row
    ids = torch.randint(0, 1000, (2, 24))
    predict = torch.ones_like(ids, dtype=torch.bool)
    predict[:, :2] = False
    predict[:, -1] = False
    chunked = predicted_logprobs(policy.model, ids, predict, chunk_size=5)
    full = torch.log_softmax(policy.model(input_ids=ids).logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None]).squeeze(-1)[predict[:, :-1]]
    assert torch.allclose(chunked, full, atol=1e-5)
    # the reference recipe checkpoints (in effect since the base model trains in train mode): same gradients
    sample = tail_sample(torch.randint(0, 1000, (30,)).tolist(), 10, 1.0)
    grads = []
    for checkpointing in (False, True):
        torch.manual_seed(1)
        p = AlfrlPolicy(model_name=str(tmp_path), dtype="float32", lora=LoRAConfig(rank=4, alpha=8), gradient_checkpointing=checkpointing)
        p.configure_model()
        for name, param in p.model.named_parameters():
            if "lora_B" in name:
                param.data.normal_(0, 0.02)
        p.model.train()
        p.logprobs_of(collate([sample], [0], "cpu")).sum().backward()
        grads.append({n: q.grad for n, q in p.model.named_parameters() if q.grad is not None})
    assert set(grads[0]) == set(grads[1]) and grads[0]
    assert all(torch.allclose(grads[0][n], grads[1][n], atol=1e-6, rtol=1e-4) for n in grads[0])


def test_an_adapter_brought_back_in_bf16_loads_and_a_partial_one_is_refused(policy, tiny_model_dir, tmp_path):
    # what a GPU lease brings back through its size-limited output: the adapter's two files, tensors in bf16
    import json

    from safetensors.torch import save_file

    trained = policy.adapter_weights()
    folder = tmp_path / "a"
    folder.mkdir()
    (folder / "adapter_config.json").write_text(json.dumps(trained.config, default=list))
    save_file({k: v.to(torch.bfloat16).contiguous() for k, v in trained.tensors.items()}, str(folder / "adapter_model.safetensors"))
    fresh = AlfrlPolicy(model_name=tiny_model_dir, dtype="float32", lora=LORA8)
    fresh.load_adapter(str(folder))
    got = fresh.adapter_weights().tensors
    assert set(got) == set(trained.tensors)
    for k, v in trained.tensors.items():
        assert torch.equal(got[k], v.to(torch.bfloat16).float())
    partial = {k: v for k, v in trained.tensors.items() if "layers.1." not in k}
    save_file({k: v.contiguous() for k, v in partial.items()}, str(folder / "adapter_model.safetensors"))
    with pytest.raises(ValueError, match="lacks .* LoRA weights"):
        AlfrlPolicy(model_name=tiny_model_dir, dtype="float32", lora=LORA8).load_adapter(str(folder))


def test_the_update_sets_the_float32_matmul_precision_of_the_recipe(random_model_dir):
    # the LoRA weights are float32: peft runs the adapter's matmuls in float32 beside the bf16 base on the GPU
    before = torch.get_float32_matmul_precision()
    try:
        policy = AlfrlPolicy(model_name=random_model_dir, dtype="float32", lora=LORA8, float32_matmul_precision="high")
        policy.configure_model()
        policy.prepare_training()
        assert torch.get_float32_matmul_precision() == "high"
        policy.hparams.float32_matmul_precision = "highest"
        policy.prepare_training()
        assert torch.get_float32_matmul_precision() == "highest"
    finally:
        torch.set_float32_matmul_precision(before)
    problems = AlfrlPolicy.problems({"model_name": random_model_dir, "float32_matmul_precision": "tf32"})
    assert problems == ["model.float32_matmul_precision='tf32': choose one of highest, high, medium"]


def _adapter_inputs(policy, samples) -> set:
    """The dtypes the adapter's first matrices (lora_A) received during one update."""
    seen = set()
    hooks = [m.register_forward_hook(lambda mod, args, out: seen.add((args[0].dtype, out.dtype)))
             for n, m in policy.model.named_modules() if n.endswith("lora_A.default")]
    try:
        ppo_update(policy, torch.optim.AdamW(policy.trainable_parameters(), lr=1e-3), samples)
    finally:
        for h in hooks:
            h.remove()
    return seen


def test_adapter_dtype_bfloat16_runs_the_adapter_in_bf16_and_keeps_float32_weights(random_model_dir):
    # model.adapter_dtype: bfloat16 autocast without peft's float32 cast of the activations; the weights, their gradients
    # and AdamW's state stay float32, and the log-probs stay those of the float32 adapter within bf16 rounding
    torch.manual_seed(5)
    samples = [tail_sample(torch.randint(0, 1000, (n,)).tolist(), n // 3, a, traj=k) for k, (n, a) in enumerate(((24, 1.0), (30, -1.0)))]
    got = {}
    for adapter_dtype in ("float32", "bfloat16"):
        policy = AlfrlPolicy(model_name=random_model_dir, dtype="bfloat16", lora=LORA8, adapter_dtype=adapter_dtype,
                             ppo=PPOConfig(microbatch_tokens=256))
        torch.manual_seed(0)  # the same LoRA A for both
        policy.configure_model()
        for name, param in policy.model.named_parameters():
            if "lora_B" in name:
                param.data.normal_(0, 0.05)
        mb = policy.microbatches(samples, [0, 1])[0]
        with torch.no_grad():
            got[adapter_dtype] = policy.logprobs_of(mb).float()
        inputs = _adapter_inputs(policy, samples)
        assert inputs == ({(torch.float32, torch.float32)} if adapter_dtype == "float32" else {(torch.bfloat16, torch.bfloat16)})
        lora = [p for n, p in policy.model.named_parameters() if "lora_" in n]
        assert lora and all(p.dtype == torch.float32 and p.requires_grad for p in lora)
    assert (got["float32"] - got["bfloat16"]).abs().max() < 0.05  # 0.0049 on the CPU
    assert not torch.equal(got["float32"], got["bfloat16"])  # the two really computed differently


def test_adapter_dtype_bfloat16_needs_a_bf16_model(random_model_dir):
    problems = AlfrlPolicy.problems({"model_name": random_model_dir, "dtype": "float32", "adapter_dtype": "bfloat16"})
    assert problems == ["model.adapter_dtype=bfloat16 needs a bf16 model, and model.dtype is float32: set model.dtype to "
                        "bfloat16 (or auto on a GPU), or model.adapter_dtype to float32"]
    assert AlfrlPolicy.problems({"model_name": random_model_dir, "adapter_dtype": "fp16"}) == [
        "model.adapter_dtype='fp16': choose one of float32, bfloat16"]
    policy = AlfrlPolicy(model_name=random_model_dir, dtype="float32", lora=LORA8, adapter_dtype="bfloat16")
    policy.configure_model()
    with pytest.raises(ValueError, match="adapter_dtype=bfloat16 needs a bf16 model"):
        policy.score([1, 2, 3])


def test_compile_layers_gives_the_same_log_probs_and_gradients_and_keeps_the_names(random_model_dir, caplog):
    # model.compile_layers: each decoder layer's MLP and norms through torch.compile (dynamic shapes), in place
    from alfrl.logprobs import causal_lm_of
    from alfrl.models import COMPILED_PARTS, compile_layers

    torch.manual_seed(6)
    samples = [tail_sample(torch.randint(0, 1000, (n,)).tolist(), n // 3, a, traj=k) for k, (n, a) in enumerate(((24, 1.0), (31, -1.0), (17, 0.5)))]
    got = {}
    for compiled in (False, True):
        policy = AlfrlPolicy(model_name=random_model_dir, dtype="float32", lora=LORA8, compile_layers=compiled,
                             ppo=PPOConfig(microbatch_tokens=48))  # rows of different lengths: dynamic shapes
        torch.manual_seed(0)
        caplog.clear()
        policy.configure_model()
        for name, param in policy.model.named_parameters():
            if "lora_B" in name:
                param.data.normal_(0, 0.05)
        names = [n for n, _ in policy.model.named_parameters()]
        assert not [r for r in caplog.records if "compile in this first update" in r.getMessage()]  # not at load (alfrl eval loads too)
        stats = ppo_update(policy, torch.optim.SGD(policy.trainable_parameters(), lr=1.0), samples)  # weights move by the gradient
        ppo_update(policy, torch.optim.SGD(policy.trainable_parameters(), lr=0.0), samples[:1])  # a second update: told once
        said = [r.getMessage() for r in caplog.records if "compile in this first update" in r.getMessage()]
        layers = len(causal_lm_of(policy.model).get_decoder().layers)
        assert said == [] if not compiled else (len(said) == 1 and said[0].startswith(  # the user is told why the first update is slow
            f"model.compile_layers: {len(COMPILED_PARTS) * layers} modules ({', '.join(COMPILED_PARTS)})"))
        after = {n: p.detach().clone() for n, p in policy.model.named_parameters() if "lora_" in n}
        got[compiled] = (names, stats["loss"], policy.score(samples[0].token_ids_T.tolist()), after)
        parts = [m for layer in causal_lm_of(policy.model).get_decoder().layers for m in (layer.mlp, layer.input_layernorm)]
        assert all((m._compiled_call_impl is not None) == bool(compiled) for m in parts)
        attention = [layer.self_attn for layer in causal_lm_of(policy.model).get_decoder().layers]
        assert all(m._compiled_call_impl is None for m in attention)  # attention stays eager
    assert got[False][0] == got[True][0]  # parameter (and adapter) names unchanged
    assert got[True][1] == pytest.approx(got[False][1], abs=1e-5)
    assert got[True][2] == pytest.approx(got[False][2], abs=1e-4)
    assert max(float((got[True][3][n] - got[False][3][n]).abs().max()) for n in got[False][3]) < 1e-5
    assert compile_layers(causal_lm_of(policy.model), on=False) == 3 * len(causal_lm_of(policy.model).get_decoder().layers)
    assert all(m._compiled_call_impl is None for m in parts)
    # other parts (the benchmark's attention variant); compiling a compiled part again keeps its compiled callable
    lm = causal_lm_of(policy.model)
    assert compile_layers(lm, parts=("self_attn",)) == len(lm.get_decoder().layers)
    first = lm.get_decoder().layers[0].self_attn._compiled_call_impl
    compile_layers(lm, parts=("self_attn",))
    assert first is not None and lm.get_decoder().layers[0].self_attn._compiled_call_impl is first
    compile_layers(lm, on=False, parts=("self_attn",))
    assert all(layer.self_attn._compiled_call_impl is None for layer in lm.get_decoder().layers)
    with pytest.raises(ValueError, match="no decoder layers with nothing_here"):
        compile_layers(lm, parts=("nothing_here",))

