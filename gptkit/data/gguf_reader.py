"""gguf's GGUFReader with its metadata arrays read in one pass: what open_gguf opens a file with.

Why: gguf.GGUFReader reads an array element by element, a numpy view (sliced from its memmap, viewed and byte-ordered)
and a recursive call for each, so a file's tokenizer arrays (a token, type and score per vocabulary entry, a merge
each) took seconds to read before the first weight: longer the larger the vocabulary. Here an array of numbers is one
view, cut into its elements' one-element views in C, and an array of strings is one walk over its lengths. The
field holds the very parts the library would build (two views a string: its length and its bytes; one a number), so
ReaderField.contents(), the tensors and everything else read the file as gguf itself does. Files of the other byte
order, and arrays of arrays, go the library's own way.
"""

from __future__ import annotations

import sys
from typing import Any

import gguf
import numpy as np
from gguf import GGUFValueType

HEADER_BYTES = 12  # an array's item type (uint32) and length (uint64)
LENGTH_BYTES = 8  # a string's length (uint64) before its bytes


class OnePassGGUFReader(gguf.GGUFReader):
    """gguf.GGUFReader whose metadata arrays of numbers or strings are read in one pass (see the module's docstring)."""

    def _get_field_parts(self, orig_offs: int, raw_type: int) -> tuple[int, list[Any], list[int], list[Any]]:
        if raw_type != GGUFValueType.ARRAY or self.byte_order != "I" or sys.byteorder != "little":
            return super()._get_field_parts(orig_offs, raw_type)
        item_type, count = self._get(orig_offs, np.uint32), self._get(orig_offs + 4, np.uint64)
        if len(item_type) < 1 or len(count) < 1:
            raise ValueError(f"the array at byte {orig_offs} is cut short: the file ends inside it")
        kind, start = int(item_type[0]), orig_offs + HEADER_BYTES
        if kind == GGUFValueType.STRING:
            parts, end = self._string_parts(start, int(count[0]))
        elif kind in self.gguf_scalar_to_np:
            parts, end = self._number_parts(start, int(count[0]), self.gguf_scalar_to_np[GGUFValueType(kind)])
        else:
            return super()._get_field_parts(orig_offs, raw_type)
        if not parts:  # as the library gives an empty array: its type alone
            return end - orig_offs, [item_type, count], [], [GGUFValueType.ARRAY]
        step = 2 if kind == GGUFValueType.STRING else 1  # a string's parts: its length, then its bytes (the data)
        data = list(range(2 + step - 1, 2 + len(parts), step))
        return end - orig_offs, [item_type, count, *parts], data, [GGUFValueType.ARRAY, GGUFValueType(kind)]

    def _number_parts(self, start: int, count: int, dtype: Any) -> tuple[list[np.ndarray], int]:
        """Each of `count` numbers from byte `start` as a one-element view, and the byte after the last."""
        if count * np.dtype(dtype).itemsize > len(self.data) - start:
            raise ValueError(f"an array of {count} numbers at byte {start} is cut short: the file ends inside it")
        values = self._get(start, dtype, count).view(np.ndarray)  # a plain array: its views skip memmap's bookkeeping
        return list(values.reshape(count, 1)), start + int(values.nbytes)

    def _string_parts(self, start: int, count: int) -> tuple[list[np.ndarray], int]:
        """Each of `count` strings from byte `start` as its length's view and its bytes' view, and the byte after the
        last. The lengths are read from the file's bytes directly; the views are cut from a plain array over the same
        memory, which slices many times faster than the memmap object itself."""
        memory, size = self.data.view(np.ndarray), len(self.data)
        raw = memoryview(memory)
        parts: list[np.ndarray] = []
        offset = start
        for _ in range(count):
            if offset + LENGTH_BYTES > size:
                raise ValueError(f"an array of {count} strings at byte {start} is cut short: the file ends inside it")
            length = int.from_bytes(raw[offset : offset + LENGTH_BYTES], "little")
            text = offset + LENGTH_BYTES
            if length > size - text:
                raise ValueError(f"a string at byte {offset} claims {length} bytes: more than the file holds")
            parts += (memory[offset:text].view(np.uint64), memory[text : text + length])
            offset = text + length
        return parts, offset
