"""Encoding a turn's feedback: transformers' ``encode`` against the fast tokenizer's Rust backend, side by side.

    python bench/encode_bench.py --tokenizer .cache/qwen15b-coder-hf --expert .cache/expert/expert_qwen15b.jsonl \
        --out bench/out/encode_bench.json

The texts are what the rollout encodes after every turn (``ChatFormat.feedback_ids``: the template's close of
the assistant turn, the observation of a real game, the next generation prompt), from the observations of an
expert-trajectory file (``alfrl expert``). Both ways run over the same texts in alternating rounds; their ids
are checked equal.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="encode_bench", description=__doc__.splitlines()[0])
    parser.add_argument("--tokenizer", required=True, help="a Hugging Face folder with a fast tokenizer and a chat template")
    parser.add_argument("--expert", required=True, help="an expert-trajectory JSONL (alfrl expert), for real observations")
    parser.add_argument("--turns", type=int, default=2000, help="how many observations to encode per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)

    from transformers import AutoTokenizer

    from alfrl.chat import chat_format

    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    fmt = chat_format(tokenizer, "tool_call")
    texts = []
    with open(args.expert) as f:
        for line in f:
            for turn in json.loads(line)["turns"]:
                texts.append(fmt.between_text + turn["observation"] + fmt.after_text)
                if len(texts) == args.turns:
                    break
            if len(texts) == args.turns:
                break
    if not texts:
        parser.error(f"--expert {args.expert}: no turns with observations in it; give a file alfrl expert wrote")
    backend = tokenizer.backend_tokenizer
    ways = {
        "transformers encode": lambda t: list(tokenizer.encode(t, add_special_tokens=False)),
        "Rust backend encode (alfrl)": lambda t: backend.encode(t, add_special_tokens=False).ids,
    }
    equal = all(ways["transformers encode"](t) == ways["Rust backend encode (alfrl)"](t) for t in texts)
    ms: dict[str, list[float]] = {name: [] for name in ways}
    for _ in range(args.rounds):
        for name, way in ways.items():
            start = time.perf_counter()
            for t in texts:
                way(t)
            ms[name].append((time.perf_counter() - start) / len(texts) * 1e3)
    medians = {name: statistics.median(v) for name, v in ms.items()}
    result = {"tokenizer": args.tokenizer, "texts": len(texts), "mean_chars": sum(map(len, texts)) / len(texts), "ids_equal": equal,
              "ms_per_call": ms, "median_ms_per_call": medians,
              "ratio": medians["transformers encode"] / medians["Rust backend encode (alfrl)"]}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(result, indent=1))
    return 0 if equal else 1


if __name__ == "__main__":
    raise SystemExit(main())
