"""Model folders: GGUF checkpoints turned into Hugging Face folders that vLLM and the trainer share.

transformers loads a GGUF file (dequantized to the requested dtype) with ``gguf_file=``; vLLM wants
a Hugging Face folder, so ``convert_gguf`` writes one once (``alfrl convert-gguf``), and the vLLM
engine converts into a cache folder beside the GGUF file when a recipe names ``model.gguf_file``.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from contextlib import contextmanager
from pathlib import Path


def convert_gguf(model_dir: str, gguf_file: str, out_dir: str | Path, dtype: str = "bfloat16") -> Path:
    """Load ``model_dir/gguf_file`` with transformers and save it as a Hugging Face folder (atomically)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = Path(out_dir)
    if (out / "config.json").exists():
        return out
    src = Path(model_dir) / gguf_file
    if not src.is_file():
        raise FileNotFoundError(f"GGUF file {src} not found: pass the folder that holds it and its file name")
    with gguf_read_once():
        tokenizer = AutoTokenizer.from_pretrained(model_dir, gguf_file=gguf_file)
        model = AutoModelForCausalLM.from_pretrained(model_dir, gguf_file=gguf_file, dtype=getattr(torch, dtype))
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer.remove_quantization_config(model)  # else save_pretrained refuses ("quantized with gguf")
    tmp = out.with_name(out.name + f".converting-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    out.parent.mkdir(parents=True, exist_ok=True)
    os.replace(tmp, out)
    return out


@contextmanager
def gguf_read_once():
    """Within it, transformers parses a GGUF file once and reads plain arrays.

    transformers builds a ``gguf.GGUFReader`` for the config, the tokenizer and the weights, parsing the metadata (a
    151k-token vocabulary) each time, and reads metadata and tensors through ``numpy.memmap`` slices, whose per-slice
    subclass bookkeeping is much of the time. Here a reader is built once per file, and its metadata parts and the
    tensors handed to ``gguf.dequantize`` are plain ndarrays (views of the same bytes, no copy). The tensors written
    are the same (``bench/gguf_convert_bench.py`` compares them and times both ways). Both patches wrap ``gguf``'s own
    functions and are undone on exit; where a transformers version imports them otherwise, it runs as before.
    (Dequantizing row blocks on 2 threads gained nothing on a 2-core machine: not kept.)"""
    import gguf
    import numpy as np

    real_reader, real_dequantize = gguf.GGUFReader, gguf.dequantize
    readers: dict[tuple[str, str], object] = {}

    def reader(path, mode="r"):
        key = (os.path.realpath(path), mode)
        if key not in readers:
            r = real_reader(path, mode)
            for field in r.fields.values():
                field.parts[:] = [np.asarray(p) for p in field.parts]
            readers[key] = r
        return readers[key]

    def dequantize(data, qtype):
        return real_dequantize(np.asarray(data), qtype)

    gguf.GGUFReader, gguf.dequantize = reader, dequantize
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.dequantize = real_reader, real_dequantize


def hf_folder_for(model_name: str, gguf_file: str | None) -> str:
    """A Hugging Face folder for the model: ``model_name`` itself, or a converted GGUF in a cache beside it."""
    if not gguf_file:
        return model_name
    digest = hashlib.sha1(f"{Path(model_name).resolve()}|{gguf_file}".encode()).hexdigest()[:10]
    out = Path(model_name) / f"hf-{Path(gguf_file).stem}-{digest}"
    return str(convert_gguf(model_name, gguf_file, out))


def linear_module_names(model_name: str) -> set[str]:
    """The short names of the model's linear layers (``q_proj``, ``in_proj_qkv`` ...), from its config alone:
    the model is built on the meta device, so no weights load and no memory is taken."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = text_config_of(AutoConfig.from_pretrained(model_name))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return {name.rsplit(".", 1)[-1] for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)} - {"lm_head"}


VL_KEY_MAPPING = {r"^model\.language_model\.": "model."}
"""A vision-language checkpoint's text-stack names -> a causal LM's (Qwen3.5: ``model.language_model.*``)."""


def text_config_of(config):
    """The text model's config of a vision-language config (the config itself otherwise)."""
    return getattr(config, "text_config", None) or config


def read_config(model_name: str):
    """The checkpoint's transformers config, or None when it cannot be read (the engine start reports that)."""
    try:
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(model_name)
    except Exception:  # noqa: BLE001 - an unreadable config: the engine start reports it
        return None


def is_vision_language(config) -> bool:
    """Whether a checkpoint's config (``read_config``; None when unreadable) is a vision-language model's:
    a text config inside."""
    return getattr(config, "text_config", None) is not None


def has_linear_attention(config) -> bool:
    """Whether some layers are linear attention (Gated DeltaNet: state runs along a row, so no packing)."""
    return "linear_attention" in (getattr(text_config_of(config), "layer_types", None) or [])


def set_gradient_checkpointing(model, on: bool) -> None:
    """Recompute each decoder layer's activations in backward (non-reentrant), or stop; ``model`` is the causal
    LM. transformers applies it only to layers in train mode."""
    if on:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.enable_input_require_grads()
    else:
        model.gradient_checkpointing_disable()


COMPILED_PARTS = ("mlp", "input_layernorm", "post_attention_layernorm")
"""What ``model.compile_layers`` compiles (``bench/update_bench.py`` can add ``self_attn``, compiled in pieces around
``sdpa_varlen``'s per-sequence attention, which stays out of the compile)."""


def compile_layers(model, on: bool = True, parts: tuple[str, ...] = COMPILED_PARTS) -> int:
    """torch.compile each decoder layer's MLP and norms in place (``nn.Module.compile``: parameter names and the
    adapter's state dict stay as they are), with dynamic shapes (rows differ in length); ``on=False`` undoes it.
    Inductor fuses their elementwise work (the norms' float32 steps, SiLU x up, the LoRA's scale-and-add) in forward
    and backward; attention stays eager (its per-sequence split is data-dependent). ``model`` is the causal LM.
    Returns how many modules it covers (already compiled ones stay as they are); raises if the model has none of these parts."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    modules = [getattr(layer, name) for layer in getattr(decoder, "layers", []) for name in parts if hasattr(layer, name)]
    if not modules:
        raise ValueError(f"model.compile_layers: {type(model).__name__} has no decoder layers with "
                         f"{', '.join(parts)}: set them to false")
    for module in modules:
        if on and module._compiled_call_impl is None:
            module.compile(dynamic=True)
        elif not on:
            module._compiled_call_impl = None  # what nn.Module.compile set
    return len(modules)


def load_causal_lm(model_name: str, dtype, attn_implementation: str | None = None, gguf_file: str | None = None):
    """The causal LM the trainer trains: a plain causal LM, or the text stack of a vision-language
    checkpoint (its vision tower is never loaded).

    The text stack loads through the causal-LM class of the text config with the checkpoint's names
    mapped (``model.language_model.*`` -> ``model.*``), which works on every transformers version the
    project allows (5.17's ``AutoModelForCausalLM`` cannot build Qwen3.5 from the VL config). Every
    text weight must be read from the checkpoint: a missing one raises instead of staying random.
    """
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    kwargs = {"dtype": dtype}
    if attn_implementation:
        if attn_implementation == "sdpa_varlen":
            from alfrl.attention import register

            register()
        kwargs["attn_implementation"] = attn_implementation
    if gguf_file:
        with gguf_read_once():
            return AutoModelForCausalLM.from_pretrained(model_name, gguf_file=gguf_file, **kwargs)
    config = AutoConfig.from_pretrained(model_name)
    text = getattr(config, "text_config", None)
    if text is None:
        return AutoModelForCausalLM.from_pretrained(model_name, **kwargs)
    text.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False) or getattr(text, "tie_word_embeddings", False))
    cls = MODEL_FOR_CAUSAL_LM_MAPPING[type(text)]
    model, info = cls.from_pretrained(model_name, config=text, key_mapping=VL_KEY_MAPPING, output_loading_info=True, **kwargs)
    missing = [k for k in info.get("missing_keys", []) if not (k == "lm_head.weight" and text.tie_word_embeddings)]
    if missing:
        raise RuntimeError(f"{model_name}: {len(missing)} text weights were not in the checkpoint (e.g. {sorted(missing)[:3]}): "
                           "is it a vision-language checkpoint with a model.language_model.* text stack?")
    return model


PEAK_BF16_TFLOPS = (("H200", 989.0), ("H100 PCIe", 756.0), ("H100 80GB HBM3", 989.0), ("H100 SXM", 989.0), ("A100", 312.0))
"""NVIDIA's dense (no sparsity) bf16 tensor-core figures by device name (``torch.cuda.get_device_name``), first match;
``train/mfu`` is logged only on these (a bf16 matmul measured 769-798 TFLOP/s on the H200 here)."""


def peak_bf16_tflops(device_name: str) -> float | None:
    """The device's dense bf16 peak in TFLOP/s, or None for a device not in ``PEAK_BF16_TFLOPS``."""
    return next((tflops for key, tflops in PEAK_BF16_TFLOPS if key in device_name), None)


def parameter_counts(model) -> tuple[float, float]:
    """(body, output layer) parameter counts of a causal LM (or its peft wrapper) for the 6N flop count: the body (every
    weight but the LoRA's, the input embeddings and the output layer) runs on every token, the output layer only on
    the trained ones (the log-probs are taken there alone)."""
    lm = model.get_base_model() if hasattr(model, "get_base_model") else model
    head = float(lm.get_output_embeddings().weight.numel())
    body = float(sum(p.numel() for n, p in lm.named_parameters() if "lora_" not in n and "embed_tokens" not in n and "lm_head" not in n))
    return body, head


def update_flops(body: float, head: float, tokens: float, trained: float, passes: int = 1, recompute: bool = False,
                 scored: bool = False) -> float:
    """Model flops of a PPO update, 6N: forward and backward (2 + 4 per parameter and token) over ``passes`` epochs,
    plus the decoder layers' forward once more with gradient checkpointing (``recompute``; the output layer is not
    checkpointed) and a forward for the trainer's old log-probs (``scored``). Attention's own flops are left out (they
    grow with the trajectory's length; the figure is a lower bound)."""
    per_pass = body * tokens + head * trained
    return per_pass * (6 * passes + (2 if scored else 0)) + (2 * passes * body * tokens if recompute else 0.0)
