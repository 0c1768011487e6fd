"""Tune vLLM's LoRA shrink / expand Triton kernels for one model's layers on this GPU; write vLLM's config folder.

    python bench/lora_tune.py --model-config .cache/qwen15b-coder-hf/config.json --rank 32 --out /tmp/lora-configs \
        [--rows 1 2 4 8 16 32 64 128 256 512 1024 2048] [--budget-seconds 420] [--report tune.json] [--dry]
    # then serve with --data.engine.lora_kernel_configs /tmp/lora-configs (vLLM reads <GPU>_SHRINK.json, <GPU>_EXPAND_TRUE.json)

Why: every engine step runs, per decoder layer, a shrink (x A^T) and an expand (y += buffer B^T) kernel for each of the
LoRA's packed projections (qkv, o, gate_up, down), with vLLM's default launch configs ("Using default LoRA kernel
configs" in a fit's log). On the H200 the same turns replayed 1.95x faster on merged weights than with the LoRA served
(bench/leases/2026-12-03c.md); where that goes is what the decode side by side measures (sampler_bench --phases decode).

How: for each kernel, each packed projection's shape and each row count (vLLM pads a step's rows to a captured size and
looks its config up by the nearest row count), a coordinate search from vLLM's default, or from the last row count's best
where that is faster here: one parameter at a time over its values, the best kept, twice over. Each candidate is timed
as the engine runs it, replayed in a CUDA graph (20 calls, best of 5 replays; the shrink's zeroing of its buffer
included), and checked against a matmul in float32 first. Row counts go smallest first (a rollout's tail), and the
search stops at ``--budget-seconds``; shapes not reached keep vLLM's default, and so do 127 and 128 rows where
``--rows`` leaves them out (``LOOKUP_GUARD_ROWS``). ``--report`` gets every shape's default and tuned microseconds and
a decode step's LoRA time per row count (the layers' sum). ``--dry`` (no GPU): the shapes, keys and files, every
config vLLM's default.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections.abc import Callable
from pathlib import Path

SEARCH = {
    "shrink": {"block_m": [16, 32, 64], "block_n": [16, 32, 64], "block_k": [32, 64, 128, 256],
               "split_k": [1, 2, 4, 8, 16, 32, 64], "num_warps": [1, 2, 4, 8], "num_stages": [1, 2, 3, 4]},
    "expand": {"block_m": [16, 32, 64], "block_n": [32, 64, 128, 256], "block_k": [16, 32],
               "num_warps": [1, 2, 4, 8], "num_stages": [1, 2, 3, 4]},
}


LOOKUP_GUARD_ROWS = (127, 128)
"""Row counts written with vLLM's default where ``--rows`` has none: the sixth lease of 2026-12-04 tuned 1-16 rows (the
default at 32 and 64, the budget spent), and vLLM ran every prefill step of up to 2,048 tokens with the 64-row shrink
config (its default below 128 rows: split_k 64) instead of its own for 128 and more (alfrl checks this:
``alfrl.engines.tuned_lora_folder``)."""


def default_config(op: str, rows: int, num_slices: int) -> dict:
    """vLLM 0.26's own choice when no tuned file is found (vllm/lora/ops/triton_ops/utils.py, get_lora_op_configs)."""
    if op == "shrink":
        return {"block_m": 32, "block_n": 16, "block_k": 256 if rows < 128 else 32, "split_k": 64 if rows < 128 else 8,
                "num_warps": 4, "num_ctas": 1, "group_size_m": 8, "num_stages": 2}
    return {"block_m": 64, "block_n": 64 if num_slices > 1 else 128, "block_k": 32, "num_warps": 4, "num_ctas": 1, "num_stages": 2}


def layer_shapes(config: dict) -> dict[str, dict]:
    """A dense decoder layer's LoRA projections as vLLM packs them: (num_slices, input size, output slices)."""
    try:
        h, inter, heads = config["hidden_size"], config["intermediate_size"], config["num_attention_heads"]
    except KeyError as e:
        raise SystemExit(f"lora_tune: the model config has no {e}: give a dense decoder's config.json (hidden_size, "
                         "intermediate_size, num_attention_heads)") from None
    head_dim = config.get("head_dim") or h // heads
    q, kv = heads * head_dim, config.get("num_key_value_heads", heads) * head_dim
    return {"qkv_proj": {"slices": (q, kv, kv), "in": h}, "o_proj": {"slices": (h,), "in": q},
            "gate_up_proj": {"slices": (inter, inter), "in": h}, "down_proj": {"slices": (h,), "in": inter}}


def kernel_keys(shapes: dict[str, dict], rank: int) -> dict[tuple, list[str]]:
    """(op, num_slices, k, n) -> the projections using it: vLLM's config lookup is [max_loras][num_slices][m][k][n],
    k, n = (input size, rank) for the shrink and (rank, the widest output slice) for the expand."""
    keys: dict[tuple, list[str]] = {}
    for name, s in shapes.items():
        keys.setdefault(("shrink", len(s["slices"]), s["in"], rank), []).append(name)
        keys.setdefault(("expand", len(s["slices"]), rank, max(s["slices"])), []).append(name)
    return keys


def coordinate_search(start: dict, space: dict[str, list[int]], cost: Callable[[dict], float], rounds: int = 2,
                      start_cost: float | None = None) -> tuple[dict, float]:
    """The lowest-cost config found moving one parameter at a time from ``start`` (``cost`` inf: a config that fails;
    ``start_cost``: ``start``'s, when already known)."""
    best, best_cost = dict(start), cost(start) if start_cost is None else start_cost
    for _ in range(rounds):
        moved = False
        for param, values in space.items():
            for v in values:
                if v == best.get(param):
                    continue
                c = cost({**best, param: v})
                if c < best_cost:
                    best, best_cost, moved = {**best, param: v}, c, True
        if not moved:
            break
    return best, best_cost


def starting_point(default: dict, previous: dict | None, cost: Callable[[dict], float]) -> tuple[dict, float, float]:
    """Where a row count's search starts: vLLM's default, or the last row count's best (the tuned configs of 2-16 rows were
    nearly alike, bench/leases/2026-12-04e.md) where that costs less at this one. Returns (start, its cost, the default's)."""
    default_cost = cost(default)
    if previous is None or previous == default:
        return default, default_cost, default_cost
    previous_cost = cost(previous)
    return (previous, previous_cost, default_cost) if previous_cost < default_cost else (default, default_cost, default_cost)


def nest(found: dict[tuple, dict], max_loras_key: int) -> dict[str, dict]:
    """{(op, num_slices, m, k, n): config} -> {op: vLLM's nested [max_loras][num_slices][m][k][n] dict}."""
    out: dict[str, dict] = {}
    for (op, slices, m, k, n), cfg in sorted(found.items()):
        out.setdefault(op, {}).setdefault(str(max_loras_key), {}).setdefault(str(slices), {}).setdefault(str(m), {}) \
            .setdefault(str(k), {})[str(n)] = cfg
    return out


class Harness:
    """One kernel shape's inputs on the GPU as vLLM's PunicaWrapperGPU passes them (one adapter, every row on it)."""

    def __init__(self, op: str, slices: tuple[int, ...], k_in: int, rank: int, rows: int):
        import torch
        from vllm.lora.ops.triton_ops import lora_expand_op, lora_shrink_op, utils
        from vllm.lora.ops.triton_ops.lora_kernel_metadata import LoRAKernelMeta

        # vLLM caches the weights' pointers and strides by address: a new shape at a freed address must not find the old ones
        utils._LORA_A_PTR_DICT.clear()
        utils._LORA_B_PTR_DICT.clear()
        self.torch, self.op, self.rows = torch, op, rows
        self.module = lora_shrink_op if op == "shrink" else lora_expand_op
        meta = LoRAKernelMeta.make(max_loras=1, max_num_tokens=rows, device="cuda")
        meta.prepare_tensors(torch.zeros(rows, dtype=torch.int32, device="cuda"))
        self.meta = meta.meta_args(rows, False)
        self.max_loras_key = int(meta.active_lora_ids.size(0))  # what the kernels look configs up by
        g = torch.Generator(device="cuda").manual_seed(0)
        if op == "shrink":
            self.x = torch.randn(rows, k_in, device="cuda", dtype=torch.bfloat16, generator=g)
            self.w = [torch.randn(1, 1, rank, k_in, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02 for _ in slices]
            self.out = torch.zeros(len(slices), rows, rank, device="cuda", dtype=torch.float32)
            self.want = torch.stack([self.x.float() @ w[0, 0].float().T * 0.5 for w in self.w])
        else:
            self.x = torch.randn(len(slices), rows, rank, device="cuda", dtype=torch.float32, generator=g)
            self.w = [torch.randn(1, 1, n, rank, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02 for n in slices]
            self.out = torch.zeros(rows, sum(slices), device="cuda", dtype=torch.bfloat16)
            self.want = torch.cat([self.x[i] @ w[0, 0].float().T for i, w in enumerate(self.w)], dim=1)

    def call(self) -> None:
        if self.op == "shrink":
            self.module._lora_shrink(self.x, self.w, self.out, *self.meta, 0.5)
        else:
            self.module._lora_expand(self.x, self.w, self.out, *self.meta, offset_start=0, add_inputs=True)

    def microseconds(self, cfg: dict) -> float:
        """``cfg``'s time per call replayed in a CUDA graph; inf if it fails or computes something else."""
        torch = self.torch
        self.module.get_lora_op_configs = lambda *a, **k: cfg  # the op module's own name for vLLM's lookup
        try:
            self.out.zero_()
            self.call()
            torch.cuda.synchronize()
            if not torch.allclose(self.out.float(), self.want, rtol=2e-2, atol=2e-2):
                return math.inf
            stream = torch.cuda.Stream()
            with torch.cuda.stream(stream):
                self.call()
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for _ in range(20):
                    self.call()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            best = math.inf
            for _ in range(5):
                start.record()
                graph.replay()
                end.record()
                end.synchronize()
                best = min(best, 1000 * start.elapsed_time(end) / 20)
            del graph
            return best
        except Exception:  # noqa: BLE001 - a config Triton cannot build or run is one that is not chosen
            return math.inf


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-config", required=True, help="the served model's config.json")
    p.add_argument("--rank", type=int, required=True, help="the LoRA's rank (model.lora.rank)")
    p.add_argument("--out", required=True, help="the folder to write (VLLM_TUNED_CONFIG_FOLDER)")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048])
    p.add_argument("--budget-seconds", type=float, default=420.0)
    p.add_argument("--report", default=None, help="a JSON of every shape's default and tuned microseconds")
    p.add_argument("--dry", action="store_true", help="no GPU: write vLLM's defaults under the tuned keys")
    args = p.parse_args(argv)
    if args.rank < 1 or min(args.rows) < 1 or args.budget_seconds <= 0:
        p.error(f"--rank {args.rank} --rows {args.rows} --budget-seconds {args.budget_seconds}: give positive values")
    config = json.loads(Path(args.model_config).read_text())
    shapes = layer_shapes(config)
    keys = kernel_keys(shapes, args.rank)
    started, found, last_best, report = time.monotonic(), {}, {}, {"shapes": shapes, "rank": args.rank, "kernels": []}
    gpu, max_loras_key = "NVIDIA_H200", 2
    if not args.dry:
        from alfrl.engines import vllm_gpu_name

        gpu = vllm_gpu_name()
    for m in sorted(args.rows):  # the tail's row counts first
        for (op, slices, k, n), names in keys.items():
            start = default_config(op, m, slices)
            if args.dry or time.monotonic() - started > args.budget_seconds:
                found[(op, slices, m, k, n)] = start
                continue
            shape = shapes[names[0]]
            harness = Harness(op, shape["slices"], shape["in"], args.rank, m)
            max_loras_key = harness.max_loras_key
            start, from_us, default_us = starting_point(start, last_best.get((op, slices, k, n)), harness.microseconds)
            best, best_us = coordinate_search(start, SEARCH[op], harness.microseconds, start_cost=from_us)  # moves only if faster
            found[(op, slices, m, k, n)] = last_best[(op, slices, k, n)] = best
            report["kernels"].append({"op": op, "rows": m, "num_slices": slices, "k": k, "n": n, "projections": names,
                                      "default_us": default_us, "tuned_us": best_us, "config": best})
            print(f"{op} {'+'.join(names)} rows {m}: {default_us:.2f} -> {best_us:.2f} us", flush=True)
    for m in sorted(set(LOOKUP_GUARD_ROWS) - set(args.rows)):  # vLLM takes the nearest row count's config, and its own default
        for (op, slices, k, n) in keys:  # changes at 128 rows: no larger step may run the largest tuned row count's config
            found[(op, slices, m, k, n)] = default_config(op, m, slices)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    nested = nest(found, max_loras_key)
    (out / f"{gpu}_SHRINK.json").write_text(json.dumps(nested["shrink"], indent=1))
    (out / f"{gpu}_EXPAND_TRUE.json").write_text(json.dumps(nested["expand"], indent=1))
    layers = config.get("num_hidden_layers", 1)
    per_step = {}
    for m in sorted({r["rows"] for r in report["kernels"]}):
        ks = [r for r in report["kernels"] if r["rows"] == m]
        if len(ks) == len(keys):  # every kernel of a layer timed at this row count: a decode step's LoRA time
            per_step[str(m)] = {f"{w}_us": layers * sum(r[f"{w}_us"] * len(r["projections"]) for r in ks) for w in ("default", "tuned")}
    report.update(per_step_lora_us=per_step, seconds=time.monotonic() - started, files=sorted(str(f) for f in out.iterdir()))
    if args.report:
        Path(args.report).write_text(json.dumps(report, indent=1))
    cut = lambda x: f"{math.floor(10 * x) / 10:.1f}"  # noqa: E731 - truncated, never rounded up
    steps = "; ".join(f"rows {m} {cut(v['default_us'])} -> {cut(v['tuned_us'])}" for m, v in per_step.items()) or "none timed"
    print(f"lora_tune: {len(report['kernels'])} kernel shapes timed in {cut(report['seconds'])} s; a decode step's LoRA kernels (us, "
          f"vLLM's default -> tuned): {steps}; wrote {', '.join(report['files'])}")


if __name__ == "__main__":
    main()
