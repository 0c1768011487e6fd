"""alfrl.models: the update's FLOP counts and known peaks; gguf_read_once: one GGUF parse per file, plain arrays, the same
values, undone on exit."""

import gguf  # a dependency of the project (pyproject.toml)
import numpy as np
import pytest
import torch

from alfrl.models import parameter_counts, peak_bf16_tflops, update_flops


@pytest.fixture
def gguf_path(tmp_path):
    path = tmp_path / "t.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_string("general.name", "tiny")
    w.add_token_list(["a", "bb", "ccc"])
    rows = np.random.default_rng(0).standard_normal((4, 64)).astype(np.float32)
    w.add_tensor("w", gguf.quantize(rows, gguf.GGMLQuantizationType.Q8_0), raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def test_one_reader_per_file_plain_arrays_the_same_values_and_undone_on_exit(gguf_path):
    from alfrl.models import gguf_read_once

    plain = gguf.GGUFReader(gguf_path)
    (tensor,) = plain.tensors
    expected = gguf.dequantize(tensor.data, tensor.tensor_type)
    real_reader, real_dequantize = gguf.GGUFReader, gguf.dequantize
    with gguf_read_once():
        from gguf import GGUFReader, dequantize  # as transformers imports them, inside its loader

        first = GGUFReader(gguf_path)
        assert GGUFReader(gguf_path) is first  # parsed once
        assert all(type(p) is np.ndarray for f in first.fields.values() for p in f.parts)  # no memmap slices
        assert first.fields["tokenizer.ggml.tokens"].contents() == ["a", "bb", "ccc"]
        assert first.fields["general.name"].contents() == "tiny"
        (t,) = first.tensors
        got = dequantize(t.data, t.tensor_type)
        assert got.shape == (4, 64) and np.array_equal(got, expected)
    assert (gguf.GGUFReader, gguf.dequantize) == (real_reader, real_dequantize)
    assert gguf.GGUFReader(gguf_path) is not gguf.GGUFReader(gguf_path)


def test_flop_counts_and_known_peaks(random_model_dir):
    from transformers import AutoModelForCausalLM

    lm = AutoModelForCausalLM.from_pretrained(random_model_dir, dtype=torch.float32)
    body, head = parameter_counts(lm)
    embed = lm.get_input_embeddings().weight.numel()
    tied = lm.get_output_embeddings().weight is lm.get_input_embeddings().weight
    assert head == lm.get_output_embeddings().weight.numel()
    assert body == sum(p.numel() for p in lm.parameters()) - embed - (0 if tied else head)
    assert update_flops(10.0, 2.0, 100, 5) == 6 * (10 * 100 + 2 * 5)
    # the recompute is the decoder layers' forward (the body on every token), not the output layer's
    assert update_flops(10.0, 2.0, 100, 5, passes=2, recompute=True, scored=True) == (12 + 2) * (10 * 100 + 2 * 5) + 4 * 10 * 100
    assert peak_bf16_tflops("NVIDIA H200") == 989.0 and peak_bf16_tflops("NVIDIA H100 PCIe") == 756.0
    assert peak_bf16_tflops("NVIDIA H100 80GB HBM3") == 989.0 and peak_bf16_tflops("NVIDIA A100-SXM4-80GB") == 312.0
    assert peak_bf16_tflops("NVIDIA GeForce RTX 4090") is None
