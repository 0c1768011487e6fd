"""The trainer's log-probs (alfrl.logprobs): the chunked log-softmax equals the full one."""

import torch

from alfrl.logprobs import predicted_logprobs
from alfrl.policy import AlfrlPolicy, LoRAConfig


def test_chunked_logprobs_equal_full_logits(tiny_model_dir):
    policy = AlfrlPolicy(model_name=tiny_model_dir, dtype="float32", lora=LoRAConfig(rank=8, alpha=16))
    policy.configure_model()
    torch.manual_seed(1)
    ids = torch.randint(0, 1000, (2, 40))
    predict = torch.ones_like(ids, dtype=torch.bool)
    predict[:, :4] = False
    predict[:, -1] = False
    chunked = predicted_logprobs(policy.model, ids, predict, chunk_size=7)
    logits = policy.model(input_ids=ids).logits[:, :-1].float()
    full = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)[predict[:, :-1]]
    assert chunked.shape == full.shape
    assert torch.allclose(chunked, full, atol=1e-5)
