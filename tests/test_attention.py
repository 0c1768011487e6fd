"""``sdpa_varlen``: the packed rows' attention without a T x T mask, exactly sdpa's with the mask."""

import pytest
import torch

from alfrl.advantages import sample_of
from alfrl.attention import segment_lengths
from alfrl.policy import AlfrlPolicy
from alfrl.ppo import PPOConfig, collate
from alfrl.policy import LoRAConfig
from alfrl.types import TokenSequence


def _policy(model_dir: str, attn: str, checkpointing: bool = False) -> AlfrlPolicy:
    p = AlfrlPolicy(model_name=model_dir, dtype="float32", attn_implementation=attn, lora=LoRAConfig(rank=8, alpha=16),
                    gradient_checkpointing=checkpointing,
                    ppo=PPOConfig(microbatch_tokens=4096, logprob_chunk_size=16))
    torch.manual_seed(0)  # the same LoRA A for both implementations
    p.configure_model()
    for name, param in p.model.named_parameters():
        if "lora_B" in name:
            param.data.normal_(0, 0.02)
    return p


def _samples(lengths):
    torch.manual_seed(3)
    out = []
    for k, n in enumerate(lengths):
        ids = torch.randint(0, 1000, (n,)).tolist()
        seq = TokenSequence(tuple(ids), tuple(-1.0 if i >= n // 3 else 0.0 for i in range(n)), ((0, n // 3, n),))
        out.append(sample_of(seq, [1.0], 0, k))
    return out


def test_segment_lengths_split_where_positions_restart():
    assert segment_lengths(torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3]])) == (3, 2, 4)
    assert segment_lengths(torch.arange(7)[None]) == (7,)
    assert segment_lengths(torch.tensor([[0, 0, 0]])) == (1, 1, 1)


@pytest.mark.parametrize("checkpointing", [False, True])
def test_packed_rows_score_and_train_exactly_as_sdpa_with_its_mask(tiny_model_dir, monkeypatch, checkpointing):
    import transformers.masking_utils as masking

    samples = _samples((37, 64, 5, 23))
    row = collate(samples, [0, 1, 2, 3], "cpu")
    alone = [collate(samples, [i], "cpu") for i in range(4)]
    results = {}
    for attn in ("sdpa", "sdpa_varlen"):
        policy = _policy(tiny_model_dir, attn, checkpointing)
        policy.model.train()  # as in an update: checkpointed layers recompute (with the row's boundaries) in backward
        built = []  # the sizes of the masks transformers materialized for this implementation
        real = masking.AttentionMaskInterface._global_mapping[attn]

        def counted(*a, real=real, built=built, **k):
            mask = real(*a, **k)
            if mask is not None:
                built.append(mask.shape[-1])
            return mask

        monkeypatch.setitem(masking.AttentionMaskInterface._global_mapping, attn, counted)
        packed = policy.logprobs_of(row)
        packed.sum().backward()
        grads = {n: p.grad.clone() for n, p in policy.model.named_parameters() if p.grad is not None}
        with torch.no_grad():
            single = torch.cat([policy.logprobs_of(mb) for mb in alone])
        results[attn] = (packed.detach(), single, grads, built)
    (p_sdpa, s_sdpa, g_sdpa, built_sdpa), (p_var, s_var, g_var, built_var) = results["sdpa"], results["sdpa_varlen"]
    assert torch.allclose(p_var, p_sdpa, atol=1e-5) and torch.allclose(p_var, s_var, atol=1e-5) and torch.allclose(s_var, s_sdpa, atol=1e-5)
    assert set(g_var) == set(g_sdpa) and len(g_var) > 0
    for name in g_sdpa:
        assert torch.allclose(g_var[name], g_sdpa[name], atol=1e-5, rtol=1e-4), name
    assert 129 in built_sdpa  # sdpa materializes the packed row's 129 x 129 mask
    assert built_var == []  # sdpa_varlen builds no mask at all


def test_padded_generation_is_unchanged(tiny_model_dir):
    # generation (left padding, a KV cache) is not a packed row: it takes sdpa's mask path
    outs = {}
    for attn in ("sdpa", "sdpa_varlen"):
        model = _policy(tiny_model_dir, attn).model
        ids = torch.tensor([[0, 0, 0, 5, 6, 7], [8, 9, 10, 11, 12, 13]])
        mask = torch.tensor([[0, 0, 0, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
        outs[attn] = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(outs["sdpa"], outs["sdpa_varlen"])


def test_a_sliding_window_longer_than_a_sequence_is_refused():
    from alfrl.attention import sdpa_varlen_forward

    q = torch.zeros(1, 2, 6, 4)
    module = torch.nn.Module()
    module.is_causal = True
    with pytest.raises(ValueError, match="sliding windows.*model.attn_implementation: sdpa"):
        sdpa_varlen_forward(module, q, q, q, None, position_ids=torch.tensor([[0, 1, 2, 3, 4, 0]]), sliding_window=3)
