"""Why `alfrl sft` runs at 7% MFU where the RL update of the same model runs at 15-20% (issue "The reference recipe at full
speed", item 3): one warm-start batch's rows, forward and backward, three ways on the same weights and samples.

- ``loop``: the packed rows as `alfrl sft` runs them (``sdpa_varlen``: one SDPA call per sequence of a row, a Python loop
  per layer; an expert plan is ~1,000 tokens, so a 16,384-token row holds ~16 and a step ~65).
- ``fused``: the same rows through torch's variable-length FlashAttention (``torch.nn.attention.varlen.varlen_attn``), one
  kernel per layer for all the row's sequences; CUDA only. Its log-probs are compared with the loop's on the same rows.
- ``unpacked``: one sequence a row (the RL update's layout, where a trajectory of ~6,400 tokens fills its row alone).

Each way: ``--warmup`` steps, then ``--steps`` timed (CUDA synchronized), no optimizer step. Written to ``--out`` (JSON)
and printed: seconds a step, sequence tokens a second, model TFLOP/s and MFU by 6N (alfrl.models), peak memory.

``--host-cpu`` runs on any machine: the model's structure (layers, heads, LoRA on every linear) at a width of 96 on this
CPU, one thread, each of the batch's sequences (the expert file's, packed into its rows) cut to a few tokens: the ATen
operations of the decoder's forward and backward, counted, and the time the host takes to issue them with next to no
arithmetic. That is the work the CPU must do however fast the GPU is (CUDA's launch cost comes on top); where it exceeds
the GPU's, the GPU waits. (PyTorch's meta device, used for this before 2026-12-07f, runs Python meta kernels and
decompositions: 55% of its time, and 1.1-2.4x the operations; its seconds overstated the host's.)

    python bench/sft_rows.py --model .cache/qwen15b-coder-hf --expert .cache/expert/expert_qwen15b_all.jsonl --out sft_rows.json
    python bench/sft_rows.py --model DIR [--gguf-file F] --expert FILE --host-cpu --out sft_rows_host.json
"""

from __future__ import annotations

import argparse
import inspect
import json
import time

import torch

FUSED = "sdpa_varlen_fused"
HOST_TOKENS = 8
"""--host-cpu: each sequence's tokens (the operations a row issues depend on its sequences and layers, not their length)."""


def fused_forward(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    """``sdpa_varlen`` with one ``varlen_attn`` call for a packed row's sequences (transformers' attention interface:
    query (1, H, T, D), key / value (1, KV, T, D) -> ((1, T, H, D), None)); anything else goes to ``sdpa_varlen``."""
    from torch.nn.attention.varlen import varlen_attn

    from alfrl.attention import sdpa_varlen_forward, segment_lengths

    position_ids = kwargs.get("position_ids")
    if (attention_mask is not None or not query.is_cuda or position_ids is None or query.shape[0] != 1
            or query.shape[2] != key.shape[2] or kwargs.get("sliding_window") is not None):
        return sdpa_varlen_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    lengths = segment_lengths(position_ids)
    q, k, v = (x[0].transpose(0, 1).contiguous() for x in (query, key, value))  # (T, heads, D)
    params = inspect.signature(varlen_attn).parameters
    extra = {}
    if k.shape[1] != q.shape[1]:
        if "enable_gqa" in params:
            extra["enable_gqa"] = True
        else:  # this torch's varlen_attn wants as many key / value heads as query heads
            k, v = (x.repeat_interleave(q.shape[1] // x.shape[1], dim=1) for x in (k, v))
    if "window_size" in params:
        extra["window_size"] = (-1, 0)  # causal
    else:
        extra["is_causal"] = True
    if "scale" in params:
        extra["scale"] = scaling
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=q.device)
    out = varlen_attn(q, k, v, cu, cu, max(lengths), max(lengths), **extra)
    return out.unsqueeze(0), None


def register_fused() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    from alfrl.attention import _mask

    AttentionInterface.register(FUSED, fused_forward)
    AttentionMaskInterface.register(FUSED, _mask)


def step(policy, samples) -> tuple[float, int]:
    """Forward and backward over every row of ``samples`` (as `alfrl sft`'s step, without the optimizer); seconds."""
    cuda = policy.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
    started = time.perf_counter()
    n_tok = sum(s.trained_tokens for s in samples)
    rows = policy.microbatches(samples, list(range(len(samples))))
    for mb in rows:
        (-policy.logprobs_of(mb).sum() / n_tok).backward()
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    for p in policy.trainable_parameters():
        p.grad = None
    return seconds, len(rows)


class _CountOps:
    """A dispatch mode counting the ATen operations run under it (forward and backward)."""

    def __init__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        counter = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                counter.n += 1
                return func(*args, **(kwargs or {}))

        self.n, self.mode = 0, Mode()


def host_cpu(args) -> dict:
    """Host seconds of the decoder's forward and backward over one batch's rows, each way, on this CPU (one thread) with
    the model's structure (layers, heads, LoRA r32 on every linear) at a width of 96 and every sequence cut to
    ``HOST_TOKENS`` tokens: the operations a GPU's host issues, with next to no arithmetic; CUDA's own launch cost is not
    in it. The fused way needs CUDA (its attention is one call a layer, as a row of one sequence)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    from alfrl.attention import register
    from alfrl.ppo import pack_microbatches
    from alfrl.sft import ExpertDataModule

    register()
    torch.set_num_threads(1)
    kwargs = {"gguf_file": args.gguf_file} if args.gguf_file else {}
    config = AutoConfig.from_pretrained(args.model, **kwargs)
    shape = {k: getattr(config, k) for k in ("num_hidden_layers", "num_attention_heads", "num_key_value_heads", "hidden_size",
                                             "intermediate_size", "vocab_size")}
    config.hidden_size, config.intermediate_size, config.vocab_size, config.pad_token_id = 96, 128, 512, 0
    config.head_dim = 96 // config.num_attention_heads
    model = get_peft_model(AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16),
                           LoraConfig(r=32, lora_alpha=64, target_modules="all-linear"))
    model.train()
    model.get_base_model().set_attn_implementation("sdpa_varlen")
    decoder = model.get_base_model().get_decoder()
    dm = ExpertDataModule(args.expert, validation_fraction=0.0, tokens_per_step=args.tokens_per_step)
    dm.setup("fit")
    lengths = [len(s) for s in dm.next_batch().samples]
    result = {"device": f"cpu, 1 thread, width 96, sequences cut to {HOST_TOKENS} tokens (host time only)", "torch": torch.__version__,
              "model": args.model, "structure": shape, "row_tokens": args.row_tokens, "sequences": len(lengths),
              "sequence_tokens": sum(lengths), "ways": {}}

    def batch(rows):
        for row in rows:
            pos = torch.arange(HOST_TOKENS).repeat(len(row)).unsqueeze(0)
            hidden = decoder(input_ids=torch.zeros_like(pos), position_ids=pos, use_cache=False).last_hidden_state
            hidden.float().sum().backward()

    for way in args.ways.split(","):
        if way == "fused":
            result["ways"][way] = {"skipped": "varlen_attn runs on CUDA only"}
            continue
        rows = pack_microbatches(lengths, args.row_tokens, pack=way != "unpacked")
        count = _CountOps()
        with count.mode:
            batch(rows)
        times = []
        for _ in range(args.warmup + args.steps):
            started = time.perf_counter()
            batch(rows)
            times.append(time.perf_counter() - started)
        best = min(times[args.warmup:])
        result["ways"][way] = {"rows": len(rows), "aten_ops": count.n, "host_seconds": best, "microseconds_per_op": best / count.n * 1e6}
        print(f"{way}: {len(rows)} rows, {count.n} operations, host time {best:.3f} s for the batch's decoder forward and backward")
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="a Hugging Face folder (the converted GGUF on the GPU machine)")
    ap.add_argument("--expert", required=True, help="the expert file written for that model (alfrl expert)")
    ap.add_argument("--tokens-per-step", type=int, default=65536, help="recipes/sft_qwen15b.yaml's data.tokens_per_step")
    ap.add_argument("--row-tokens", type=int, default=16384, help="the packed row (the warm start's --model.ppo.microbatch_tokens)")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--ways", default="loop,fused,unpacked")
    ap.add_argument("--host-cpu", action="store_true", help="the host's time alone: the structure at a tiny width on this CPU")
    ap.add_argument("--gguf-file", default=None, help="with --host-cpu: read the model's structure from this GGUF in --model")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    if args.host_cpu:
        result = host_cpu(args)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
        print(f"written: {args.out}")
        return

    from alfrl.attention import register
    from alfrl.logprobs import causal_lm_of
    from alfrl.models import parameter_counts, peak_bf16_tflops, update_flops
    from alfrl.policy import LoRAConfig
    from alfrl.ppo import PPOConfig
    from alfrl.sft import ExpertDataModule, SFTPolicy

    cuda = torch.cuda.is_available()
    register()
    register_fused()
    policy = SFTPolicy(model_name=args.model, attn_implementation="sdpa_varlen", adapter_dtype="bfloat16" if cuda else "float32",
                       lora=LoRAConfig(rank=32, alpha=64), ppo=PPOConfig(microbatch_tokens=args.row_tokens))
    policy.configure_model()
    policy.to("cuda" if cuda else "cpu")
    policy.prepare_training()
    dm = ExpertDataModule(args.expert, validation_fraction=0.0, tokens_per_step=args.tokens_per_step)
    dm.setup("fit")
    batches = [dm.next_batch().samples for _ in range(args.warmup + args.steps)]
    lm = causal_lm_of(policy.model)
    body, head = parameter_counts(policy.model)
    peak = peak_bf16_tflops(torch.cuda.get_device_name()) if cuda else None
    result = {"device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__, "model": args.model,
              "row_tokens": args.row_tokens, "tokens_per_step": args.tokens_per_step, "ways": {}}
    reference = None
    for way in args.ways.split(","):
        if way == "fused" and not cuda:
            result["ways"][way] = {"skipped": "varlen_attn runs on CUDA only"}
            print(f"{way}: skipped (CUDA only)")
            continue
        lm.set_attn_implementation(FUSED if way == "fused" else "sdpa_varlen")
        policy.packable = way != "unpacked"
        with torch.no_grad():  # the first row's log-probs, against the loop's
            row = policy.microbatches(batches[0], list(range(len(batches[0]))))[0] if way != "unpacked" else None
            lp = policy.logprobs_of(row).float().cpu() if row is not None else None
        if way == "loop":
            reference = lp
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        runs = []
        try:
            for i, samples in enumerate(batches):
                seconds, rows = step(policy, samples)
                if i >= args.warmup:
                    tokens = sum(len(s) for s in samples)
                    trained = sum(s.trained_tokens for s in samples)
                    tflops = update_flops(body, head, tokens, trained) / seconds / 1e12
                    runs.append({"seconds": seconds, "rows": rows, "sequences": len(samples), "sequence_tokens": tokens,
                                 "tokens_per_second": tokens / seconds, "model_tflops": tflops,
                                 **({"mfu": tflops / peak} if peak else {})})
        except Exception as e:  # a way that cannot run here is reported, the others still run
            result["ways"][way] = {"error": f"{type(e).__name__}: {e}"[:500]}
            print(f"{way}: {type(e).__name__}: {e}"[:300])
            continue
        entry = {"steps": runs, "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0}
        if lp is not None and reference is not None and way != "loop":
            diff = (lp - reference).abs()
            entry["first_row_logprob_vs_loop"] = {"max_abs": float(diff.max()), "mean_abs": float(diff.mean()), "tokens": int(lp.numel())}
        result["ways"][way] = entry
        mean = sum(r["seconds"] for r in runs) / len(runs)
        print(f"{way}: {mean:.3f} s a step (rows {runs[0]['rows']}, sequences {runs[0]['sequences']}), "
              f"{sum(r['tokens_per_second'] for r in runs) / len(runs):.0f} tokens/s"
              + (f", MFU {sum(r['mfu'] for r in runs) / len(runs):.3f}" if peak else "")
              + (f", first row vs loop max |d log-prob| {entry['first_row_logprob_vs_loop']['max_abs']:.4f}" if "first_row_logprob_vs_loop" in entry else ""))
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"written: {args.out}")


if __name__ == "__main__":
    main()
