"""gptkit/data/gguf_reader.py: every field reads as gguf's own GGUFReader reads it, and a damaged array is refused."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest

from gptkit.core.errors import UserError
from gptkit.data.gguf_reader import OnePassGGUFReader
from gptkit.data.gguf_tokenizer import open_gguf

NUMBERS = {  # an array of each numeric item type, with values at the edges of its range
    "uint8": (gguf.GGUFValueType.UINT8, [0, 1, 255]),
    "int8": (gguf.GGUFValueType.INT8, [-128, 0, 127]),
    "uint16": (gguf.GGUFValueType.UINT16, [0, 65535]),
    "int16": (gguf.GGUFValueType.INT16, [-32768, 5]),
    "uint32": (gguf.GGUFValueType.UINT32, [0, 4294967295, 7]),
    "int32": (gguf.GGUFValueType.INT32, [-2147483648, 2147483647]),
    "uint64": (gguf.GGUFValueType.UINT64, [0, 18446744073709551615]),
    "int64": (gguf.GGUFValueType.INT64, [-9223372036854775808, 3]),
    "float32": (gguf.GGUFValueType.FLOAT32, [-1.5, 0.0, 3.25]),
    "float64": (gguf.GGUFValueType.FLOAT64, [1e300, -2.5]),
    "bool": (gguf.GGUFValueType.BOOL, [True, False, True]),
}
STRINGS = ["", "a", "Ġthe", "日本語", "e\u0301", "x" * 300]


def write_file(path: Path, endianess: gguf.GGUFEndian = gguf.GGUFEndian.LITTLE) -> Path:
    """A GGUF file of arrays of every item type (strings, numbers, nested), scalars and two tensors."""
    writer = gguf.GGUFWriter(path, "llama", endianess=endianess)
    for name, (kind, values) in NUMBERS.items():
        writer.add_key_value(f"test.{name}", values, gguf.GGUFValueType.ARRAY, sub_type=kind)
    writer.add_array("test.strings", STRINGS)
    writer.add_array("test.nested", [[1, 2], [3]])
    writer.add_string("test.text", "héllo")
    writer.add_uint32("test.count", 7)
    writer.add_float32("test.scale", 0.5)
    writer.add_tensor("a", np.arange(12, dtype=np.float32).reshape(3, 4))
    writer.add_tensor("b", np.arange(5, dtype=np.float16))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def fields_as_data(reader: gguf.GGUFReader) -> dict[str, object]:
    """Every field as the library's accessors give it: its contents, its parts' values, data indices and types."""
    return {
        name: (
            field.contents(),
            [part.tolist() for part in field.parts],
            list(field.data),
            list(field.types),
            [field.contents(index) for index in range(len(field.data))] if len(field.types) > 1 else None,
        )
        for name, field in reader.fields.items()
    }


@pytest.mark.parametrize("endianess", [gguf.GGUFEndian.LITTLE, gguf.GGUFEndian.BIG])
def test_every_field_and_tensor_reads_as_the_librarys_reader_reads_it(
    tmp_path: Path, endianess: gguf.GGUFEndian
) -> None:
    path = write_file(tmp_path / "model.gguf", endianess)
    ours, theirs = OnePassGGUFReader(path), gguf.GGUFReader(path)
    assert fields_as_data(ours) == fields_as_data(theirs)
    assert [(t.name, t.tensor_type, t.shape.tolist(), t.data.tolist()) for t in ours.tensors] == [
        (t.name, t.tensor_type, t.shape.tolist(), t.data.tolist()) for t in theirs.tensors
    ]
    # and what was written, read back
    assert ours.fields["test.strings"].contents() == STRINGS
    for name, (_, values) in NUMBERS.items():
        assert ours.fields[f"test.{name}"].contents() == values, name
    assert ours.fields["test.text"].contents() == "héllo"


def array_file(tmp_path: Path, values: list) -> tuple[Path, int]:
    """A file whose last field is an array of `values`, and the byte at which that array's items begin."""
    path = tmp_path / "array.gguf"
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_array("test.values", values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    data = path.read_bytes()
    key = b"test.values"
    return path, data.index(key) + len(key) + 4 + 12  # the key, the value's type, the array's item type and count


def test_an_empty_array_reads_as_the_librarys_reader_reads_it(tmp_path: Path) -> None:
    """gguf's writer refuses to write an empty array, llama.cpp's does not: one string array and one of numbers,
    each made empty by hand (its count set to 0, its items cut off the file's end)."""
    for values in (["x"], [7]):
        path, items = array_file(tmp_path, values)
        path.write_bytes(path.read_bytes()[: items - 8] + (0).to_bytes(8, "little"))  # the count, then nothing
        ours, theirs = OnePassGGUFReader(path), gguf.GGUFReader(path)
        assert fields_as_data(ours) == fields_as_data(theirs)
        assert ours.fields["test.values"].contents() == []


def test_a_file_cut_inside_an_array_is_refused(tmp_path: Path) -> None:
    path, items = array_file(tmp_path, ["one", "two", "three"])
    data = path.read_bytes()
    # inside a string's length, inside a string, inside the last one
    cuts = [(path, data, cut) for cut in (items + 4, items + 8 + 2, len(data) - 2)]
    (tmp_path / "numbers").mkdir()
    numbers_path, numbers_items = array_file(tmp_path / "numbers", [1.5, 2.5, 3.5])
    cuts.append((numbers_path, numbers_path.read_bytes(), numbers_items + 6))  # inside the second number
    for path, data, cut in cuts:
        path.write_bytes(data[:cut])
        with pytest.raises(ValueError, match=r"cut short|more than the file holds"):
            OnePassGGUFReader(path)
        with pytest.raises(UserError, match=r"truncated, damaged or not a GGUF file"):
            open_gguf(path)


def test_a_string_or_array_claiming_more_than_the_file_holds_is_refused_at_once(tmp_path: Path) -> None:
    path, items = array_file(tmp_path, ["one", "two", "three"])
    data = bytearray(path.read_bytes())
    data[items : items + 8] = (2**62).to_bytes(8, "little")  # the first string's length
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"claims 4611686018427387904 bytes"):
        OnePassGGUFReader(path)
    data = bytearray(array_file(tmp_path, ["one", "two", "three"])[0].read_bytes())
    data[items - 8 : items] = (2**62).to_bytes(8, "little")  # the array's count
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"an array of 4611686018427387904 strings .* is cut short"):
        OnePassGGUFReader(path)


def test_a_file_that_cannot_be_opened_says_why_not_that_it_is_damaged(tmp_path: Path) -> None:
    """A file without read permission (root reads any, so its refusal is made here as the kernel makes it)."""
    path, _ = array_file(tmp_path, ["one"])

    def refused(self, *args, **kwargs):
        raise PermissionError(13, "Permission denied", str(path))

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(OnePassGGUFReader, "__init__", refused)
        with pytest.raises(UserError) as raised:
            open_gguf(path)
    assert str(raised.value) == (
        f"cannot read {path}: Permission denied ({path}); check the permissions or choose another path"
    )
