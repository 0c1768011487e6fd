"""``sdpa_varlen``: attention over packed rows without a T x T mask.

The update packs several trajectories into one row with ``position_ids`` restarting at 0 for each
(``alfrl.ppo``). With transformers' ``sdpa``, such a row gets a materialized (T, T) block-diagonal mask,
so PyTorch cannot use its FlashAttention kernel: every query attends (masked) to every key of the row,
sequences of other trajectories included. ``sdpa_varlen`` instead runs causal SDPA on each sequence of
the row (FlashAttention where PyTorch has it), so a row of k sequences costs the sum of their squared
lengths, not the row's. The same attention as ``sdpa`` with the packed mask: equal log-probs and gradients in
float32 (tests/test_attention.py); in bf16 the two use different kernels and round differently (on the H200, a
14,074-token row of 5 sequences: mean |log-prob difference| 0.007 nats, raw-results-2026-12-06:bench/README.md).

Forwards with a padding mask or a KV cache (generation) are not packed rows: they go to ``sdpa`` with
the mask transformers builds for them. Select it with ``model.attn_implementation: sdpa_varlen``.
"""

from __future__ import annotations

import torch

NAME = "sdpa_varlen"


def segment_lengths(position_ids: torch.Tensor) -> tuple[int, ...]:
    """Lengths of the sequences of one packed row: a sequence starts where the position does not
    follow the previous one (transformers' rule for packed rows). Memoized per tensor, so the one
    host sync it needs happens once per forward, not once per layer."""
    cached = getattr(position_ids, "_alfrl_segments", None)
    if cached is not None:
        return cached
    row = position_ids.reshape(-1, position_ids.shape[-1])[0]  # (T,); multimodal rotary positions (3, 1, T): the first row
    starts = [0] + (torch.nonzero(row[1:] != row[:-1] + 1).flatten() + 1).tolist()
    lengths = tuple(b - a for a, b in zip(starts, starts[1:] + [row.numel()]))
    position_ids._alfrl_segments = lengths  # lives and dies with the tensor (every layer gets the same one)
    return lengths


@torch.compiler.disable
def sdpa_varlen_forward(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    """transformers' attention interface: query (1, H, T, D), key / value (1, KV, T, D) -> ((1, T, H, D), None).

    Never traced by torch.compile (``bench/update_bench.py``'s compiled-attention variant compiles the block around it): its loop over the row's
    sequences would make every count of sequences in a row a recompile (the H200 fit of 2026-12-03e hit dynamo's limit
    of 16 in its second update, after 406 s of compiling); each SDPA call is one fused kernel either way."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    position_ids = kwargs.pop("position_ids", None)
    kwargs.pop("is_causal", None)
    if (attention_mask is not None or query.shape[2] != key.shape[2] or position_ids is None or query.shape[0] != 1
            or position_ids.shape[-1] != query.shape[2]):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    lengths = segment_lengths(position_ids)
    window = kwargs.get("sliding_window")
    if window is not None and max(lengths) > window:
        raise ValueError(f"{NAME} does not apply sliding windows ({window} tokens) and a sequence has {max(lengths)}: "
                         "set model.attn_implementation: sdpa for this model")
    if len(lengths) == 1:
        return sdpa_attention_forward(module, query, key, value, None, dropout=dropout, scaling=scaling, is_causal=True, **kwargs)
    outputs, start = [], 0
    for n in lengths:
        piece = slice(start, start + n)
        out, _ = sdpa_attention_forward(module, query[:, :, piece], key[:, :, piece], value[:, :, piece], None,
                                        dropout=dropout, scaling=scaling, is_causal=True, **kwargs)
        outputs.append(out)
        start += n
    return torch.cat(outputs, dim=1), None


def _mask(*args, **kwargs):
    """The mask transformers builds for ``sdpa_varlen``: none when there is no padding mask (a training or
    scoring forward: causality and the packed rows' boundaries are the attention's), else sdpa's."""
    from transformers.masking_utils import sdpa_mask

    if kwargs.get("attention_mask") is None:
        return None
    return sdpa_mask(*args, **kwargs)


def register() -> str:
    """Make ``attn_implementation="sdpa_varlen"`` known to transformers (idempotent); returns the name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(NAME, sdpa_varlen_forward)
    AttentionMaskInterface.register(NAME, _mask)
    return NAME
