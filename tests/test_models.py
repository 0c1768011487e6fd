"""alfrl.models.gguf_read_once: one GGUF parse per file, plain arrays, the same values, undone on exit."""

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")


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
