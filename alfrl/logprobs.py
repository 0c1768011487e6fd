"""Per-token log-probabilities without full-vocabulary float32 logits for a whole sequence.

The decoder runs once over the batch; the output layer and the float32 log-softmax then run only on
the positions that predict a trained token, ``chunk_size`` positions at a time. With grad, each
chunk is checkpointed, so backward recomputes one chunk's logits instead of keeping all of them:
peak memory holds one ``chunk_size x vocab`` float32 block, not ``T x vocab``.

Several sequences may share one row (packed): ``position_ids`` restart at 0 for each, no attention
mask is passed, and transformers then keeps attention inside each sequence.
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint


def causal_lm_of(model: torch.nn.Module) -> torch.nn.Module:
    """The Hugging Face causal LM inside a peft wrapper (or the model itself)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def _chunk_logprobs(lm_head: torch.nn.Module, hidden: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    logits = lm_head(hidden).float()  # (C, V)
    if temperature != 1.0:
        logits = logits / temperature  # the sampling distribution at temperature T, as the sampler's processed log-probs
    return torch.log_softmax(logits, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def predicted_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    predict_mask: torch.Tensor,
    position_ids: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
    chunk_size: int = 1024,
    temperature: float = 1.0,
    row_index: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Log-prob of token t+1 at every position t where ``predict_mask`` is True, flattened (batch, position).

    input_ids, predict_mask (bool), position_ids, attention_mask: (B, T); the last position of a
    row predicts nothing and must be False. Returns (N,) float32, N = predict_mask.sum().
    ``temperature`` scores under softmax(logits / T), the distribution a sampler at T draws from.
    ``row_index`` (one row, B = 1): (positions, targets), the mask's positions and their tokens t+1 found beforehand
    (``alfrl.ppo.collate``), so nothing here reads the device's memory back: a boolean mask's selection does, and
    waits for every kernel queued before it.
    """
    lm = causal_lm_of(model)
    decoder = lm.get_decoder() if hasattr(lm, "get_decoder") else None
    if row_index is None:
        if predict_mask[:, -1].any():
            raise ValueError("the last position of a row has no next token to predict")
        targets = torch.roll(input_ids, -1, dims=1)[predict_mask]  # (N,): token t+1
    else:
        positions, targets = row_index
    if decoder is None:  # a model without a separate decoder: plain forward (full logits)
        logits = model(input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask).logits
        return torch.log_softmax(logits[predict_mask].float() / temperature, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    hidden = decoder(input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state
    hidden = hidden[predict_mask] if row_index is None else hidden[0].index_select(0, positions)  # (N, H)
    lm_head = lm.get_output_embeddings()
    pieces = []
    for start in range(0, hidden.shape[0], chunk_size):
        h, t = hidden[start : start + chunk_size], targets[start : start + chunk_size]
        if torch.is_grad_enabled():
            pieces.append(checkpoint(_chunk_logprobs, lm_head, h, t, temperature, use_reentrant=False))
        else:
            pieces.append(_chunk_logprobs(lm_head, h, t, temperature))
    return torch.cat(pieces) if pieces else hidden.new_zeros((0,), dtype=torch.float32)


def sequence_logprobs(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, chunk_size: int = 1024) -> torch.Tensor:
    """(B, T-1) log-probs of tokens 1..T-1 given their prefixes (0 where ``attention_mask`` is 0)."""
    predict = attention_mask.bool().clone()
    predict[:, :-1] &= attention_mask[:, 1:].bool()
    predict[:, -1] = False
    flat = predicted_logprobs(model, input_ids, predict, attention_mask=attention_mask, chunk_size=chunk_size)
    out = torch.zeros(input_ids.shape[0], input_ids.shape[1] - 1, dtype=torch.float32, device=input_ids.device)
    out[predict[:, :-1]] = flat
    return out
