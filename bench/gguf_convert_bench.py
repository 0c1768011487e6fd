"""GGUF -> Hugging Face folder (``alfrl convert-gguf``): transformers as is against ``alfrl.models.gguf_read_once``.

    python bench/gguf_convert_bench.py --model-dir .gpu-model --gguf-file qwen.gguf --rounds 2 --out bench/out/gguf_convert.json

Each conversion runs in a fresh process (nothing cached in Python between them; the file's pages stay in the OS cache,
so the first run is read cold: the order alternates), the two ways alternating. The written folders are compared: every
tensor of the safetensors files equal (names, dtypes, values), and the tokenizer and config files byte-equal.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CHILD = """
import contextlib, sys, time
import alfrl.models as m
if sys.argv[1] == "as_is":
    m.gguf_read_once = contextlib.nullcontext
t = time.perf_counter()
m.convert_gguf(sys.argv[2], sys.argv[3], sys.argv[4])
print(time.perf_counter() - t)
"""


def convert(way: str, model_dir: str, gguf_file: str, out: Path) -> float:
    proc = subprocess.run([sys.executable, "-c", CHILD, way, model_dir, gguf_file, str(out)], capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{way} conversion failed:\n{proc.stderr[-3000:]}")
    return float(proc.stdout.strip().splitlines()[-1])


def same_folders(a: Path, b: Path) -> list[str]:
    """What differs between two converted folders (empty: the same)."""
    import torch
    from safetensors.torch import load_file

    diffs = []
    names_a = sorted(p.name for p in a.iterdir())
    names_b = sorted(p.name for p in b.iterdir())
    if names_a != names_b:
        return [f"files {names_a} against {names_b}"]
    tensors_a, tensors_b = {}, {}
    for name in names_a:
        if name.endswith(".safetensors"):
            tensors_a.update(load_file(a / name))
            tensors_b.update(load_file(b / name))
        elif name != "model.safetensors.index.json" and (a / name).read_bytes() != (b / name).read_bytes():
            diffs.append(f"{name} differs")
    if sorted(tensors_a) != sorted(tensors_b):
        diffs.append("tensor names differ")
    for k in sorted(set(tensors_a) & set(tensors_b)):
        if tensors_a[k].dtype != tensors_b[k].dtype or not torch.equal(tensors_a[k], tensors_b[k]):
            diffs.append(f"tensor {k} differs")
    return diffs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-dir", required=True, help="the folder holding the GGUF file")
    ap.add_argument("--gguf-file", required=True)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default="bench/out/gguf_convert.json")
    args = ap.parse_args()
    if not (Path(args.model_dir) / args.gguf_file).is_file():
        raise SystemExit(f"--model-dir/--gguf-file: {Path(args.model_dir) / args.gguf_file} not found: "
                         "pass the folder that holds the GGUF file and its name")
    seconds: dict[str, list[float]] = {"as_is": [], "read_once": []}
    diffs: list[str] = []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            folders = {}
            for way in (("as_is", "read_once") if r % 2 == 0 else ("read_once", "as_is")):
                folders[way] = Path(tmp) / f"{way}-{r}"
                seconds[way].append(round(convert(way, args.model_dir, args.gguf_file, folders[way]), 2))
                print(f"round {r + 1} {way}: {seconds[way][-1]} s", flush=True)
            diffs += same_folders(folders["as_is"], folders["read_once"])
            for folder in folders.values():  # ~3 GB each for a 1.5B model
                shutil.rmtree(folder)
    result = {"seconds": seconds, "best_ratio": round(min(seconds["as_is"]) / min(seconds["read_once"]), 3),
              "same_output": not diffs, "differences": diffs[:20], "date": time.strftime("%Y-%m-%d"),
              "gguf": str(Path(args.model_dir) / args.gguf_file)}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))
    if diffs:
        raise SystemExit(f"the two conversions differ: {diffs[:3]}")


if __name__ == "__main__":
    main()
