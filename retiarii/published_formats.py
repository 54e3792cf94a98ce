"""Readers of the published benchmark files' formats that never run what a file names.

Two formats carry the published tabular NAS benchmarks, and neither is read here with the
library that wrote it:

- **torch pickles** (``torch.save``: NAS-Bench-201's ``.pth``). :func:`load_torch_pickle`
  unpickles with :class:`RestrictedUnpickler`, which builds only Python's containers, numbers
  and strings. A pickle can name any importable callable (``os.system``) and have it called
  while loading; here every name is refused with :class:`UnsafePickleError` except a short
  list mapped to our own inert stand-ins (``OrderedDict``, ``set``, numpy scalars decoded from
  their bytes, tensors kept as :class:`TensorRef` whose data is not read). Both of torch's
  layouts are read: the zip archive (torch >= 1.6) and the legacy sequence of pickles.
- **TFRecords of protobufs** (NAS-Bench-101's ``.tfrecord``). :func:`read_tfrecords` reads
  the framing itself (length, masked CRC32C of the length, data, masked CRC32C of the data)
  and refuses a record whose CRC does not match (:class:`CorruptRecordError`);
  :func:`decode_protobuf` decodes the protobuf wire format into ``{field: [values]}``.

Example::

    >>> obj = load_torch_pickle("NAS-Bench-201-v1_0-e61699.pth")   # dicts, lists, floats
    >>> for record in read_tfrecords("nasbench_only108.tfrecord"):  # bytes, CRC checked
    ...     ...
"""
from __future__ import annotations

import collections
import dataclasses
import io
import pickle
import struct
import zipfile
from typing import Any, Iterator

__all__ = ["CorruptRecordError", "RestrictedUnpickler", "TensorRef", "UnsafePickleError",
           "crc32c", "decode_protobuf", "load_torch_pickle", "masked_crc32c", "read_tfrecords",
           "tfrecord"]

# torch's legacy layout starts with this number pickled (torch/serialization.py's MAGIC_NUMBER)
TORCH_LEGACY_MAGIC = 0x1950A86A20F9469CFC6C


class UnsafePickleError(pickle.UnpicklingError):
    """A pickle names something other than plain data; nothing it names was imported."""


class CorruptRecordError(ValueError):
    """A TFRecord's framing is damaged: a CRC mismatch or a truncated record."""


# ---- pickles ---------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class StorageRef:
    """A tensor storage a pickle refers to (its bytes are never read)."""

    key: str
    dtype: str
    numel: int | None


@dataclasses.dataclass(frozen=True)
class TensorRef:
    """A tensor of the pickle, kept as a reference: shape and storage, no data. The tables
    hold numbers as Python floats; a tensor in one is trained weights we do not need."""

    storage: StorageRef
    offset: int
    size: tuple
    stride: tuple


def _rebuild_tensor(storage, offset, size, stride, *rest) -> TensorRef:
    return TensorRef(storage, int(offset), tuple(size), tuple(stride))


class _DType:
    """numpy.dtype as a pickle describes it: its name, then its byte order by BUILD."""

    def __init__(self, name, align=False, copy=True):
        self.name, self.order = str(name), "<"

    def __setstate__(self, state) -> None:
        if isinstance(state, tuple) and len(state) > 1 and state[1] in "<>|=":
            self.order = "<" if state[1] in "|=" else state[1]


_SCALARS = {"f8": "d", "f4": "f", "f2": "e", "i8": "q", "i4": "i", "i2": "h", "i1": "b",
            "u8": "Q", "u4": "I", "u2": "H", "u1": "B", "b1": "?", "float64": "d",
            "float32": "f", "int64": "q", "int32": "i", "bool": "?"}


def _numpy_scalar(dtype: _DType, data: bytes = b"") -> float | int | bool:
    """A numpy scalar decoded from its bytes (numpy pickles ``scalar(dtype, bytes)``)."""
    code = _SCALARS.get(dtype.name.lstrip("<>|="))
    if code is None or not isinstance(data, bytes):
        raise UnsafePickleError(f"a numpy scalar of dtype {dtype.name!r}: only numbers are read")
    return struct.unpack(dtype.order + code, data)[0]


def _latin1_bytes(text: str, encoding: str = "latin1") -> bytes:
    """How protocol 2 pickles bytes: ``_codecs.encode(text, "latin1")``; nothing else."""
    if not isinstance(text, str) or encoding not in ("latin1", "latin-1"):
        raise UnsafePickleError(f"_codecs.encode({type(text).__name__}, {encoding!r}): only "
                                f"latin1 text to bytes is read")
    return text.encode("latin1")


# The only names a table's pickle may use, each mapped to something that builds plain data.
_ALLOWED = {
    ("collections", "OrderedDict"): collections.OrderedDict,
    ("builtins", "set"): set, ("builtins", "frozenset"): frozenset,
    ("__builtin__", "set"): set, ("__builtin__", "frozenset"): frozenset,
    ("torch._utils", "_rebuild_tensor"): _rebuild_tensor,
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor,
    ("_codecs", "encode"): _latin1_bytes,
    ("numpy", "dtype"): _DType,
    ("numpy.core.multiarray", "scalar"): _numpy_scalar,
    ("numpy._core.multiarray", "scalar"): _numpy_scalar,
}


class RestrictedUnpickler(pickle.Unpickler):
    """An unpickler that builds plain data only: see the module docstring.

    Args:
        file: the pickle's stream.
        source: how errors name the file.
    """

    def __init__(self, file, source: str = "the pickle"):
        super().__init__(file)
        self.source = source

    def find_class(self, module: str, name: str):
        if (module, name) in _ALLOWED:
            return _ALLOWED[(module, name)]
        if module == "torch" and name.endswith("Storage"):
            return name  # a storage's type in a tensor's persistent id: only its name is kept
        raise UnsafePickleError(
            f"{self.source} names {module}.{name}, which a table of results has no use for: "
            f"refused unread (nothing it names was imported or called). A benchmark table "
            f"holds only dicts, lists, numbers and strings; check where the file came from")

    def persistent_load(self, pid):
        # ('storage', type, key, location, numel[, view]): a tensor's storage, never read
        if isinstance(pid, tuple) and len(pid) >= 4 and pid[0] == "storage":
            numel = pid[4] if len(pid) > 4 and isinstance(pid[4], int) else None
            return StorageRef(str(pid[2]), str(pid[1]), numel)
        raise UnsafePickleError(f"{self.source}: unknown persistent id {pid!r}")


def load_torch_pickle(path: str) -> Any:
    """The object a ``torch.save`` file holds, unpickled by :class:`RestrictedUnpickler`.

    Raises:
        UnsafePickleError: the file names anything but plain data.
        ValueError: the file is neither of torch's layouts.
    """
    if zipfile.is_zipfile(path):
        with zipfile.ZipFile(path) as archive:
            names = [n for n in archive.namelist() if n.endswith("data.pkl")]
            if not names:
                raise ValueError(f"{path}: a zip archive without data.pkl is not a torch file")
            with archive.open(names[0]) as f:
                return RestrictedUnpickler(io.BufferedReader(f), path).load()
    with open(path, "rb") as f:
        first = RestrictedUnpickler(f, path).load()
        if first != TORCH_LEGACY_MAGIC:
            raise ValueError(f"{path}: not a torch file (no zip archive, no legacy magic "
                             f"number; it starts with {type(first).__name__})")
        RestrictedUnpickler(f, path).load()  # the protocol version
        RestrictedUnpickler(f, path).load()  # sys info: byte order, type sizes
        return RestrictedUnpickler(f, path).load()  # storages' bytes follow: not read


# ---- TFRecords -------------------------------------------------------------------------------


def _crc_table() -> list[int]:
    table = []
    for n in range(256):
        c = n
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1  # Castagnoli, reflected
        table.append(c)
    return table


_CRC_TABLE = _crc_table()


def crc32c(data: bytes) -> int:
    """CRC-32C (Castagnoli) of ``data``: ``crc32c(b"123456789") == 0xE3069283``."""
    crc, table = 0xFFFFFFFF, _CRC_TABLE
    for byte in data:
        crc = table[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def masked_crc32c(data: bytes) -> int:
    """TFRecord's masked CRC: the CRC rotated right by 15 bits plus a constant, so that a CRC
    of bytes holding CRCs stays well distributed."""
    crc = crc32c(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def tfrecord(data: bytes) -> bytes:
    """One record framed as TFRecord files frame it (for writing fixtures and tests)."""
    length = struct.pack("<Q", len(data))
    return (length + struct.pack("<I", masked_crc32c(length)) + data
            + struct.pack("<I", masked_crc32c(data)))


def read_tfrecords(path: str, check_crc: bool = True) -> Iterator[bytes]:
    """The records of a TFRecord file, each checked against its two CRCs.

    Raises:
        CorruptRecordError: a CRC does not match, or the file ends inside a record.
    """
    with open(path, "rb") as f:
        index = 0
        while True:
            offset = f.tell()
            head = f.read(12)
            if not head:
                return
            if len(head) < 12:
                raise CorruptRecordError(f"{path}: record {index} at byte {offset}: the file "
                                         f"ends inside its header (truncated download?)")
            length_bytes, (length_crc,) = head[:8], struct.unpack("<I", head[8:])
            if check_crc and masked_crc32c(length_bytes) != length_crc:
                raise CorruptRecordError(
                    f"{path}: record {index} at byte {offset}: the CRC of its length does not "
                    f"match: the file is damaged (download it again)")
            (length,) = struct.unpack("<Q", length_bytes)
            data, tail = f.read(length), f.read(4)
            if len(data) < length or len(tail) < 4:
                raise CorruptRecordError(f"{path}: record {index} at byte {offset}: the file "
                                         f"ends inside it (truncated download?)")
            if check_crc and masked_crc32c(data) != struct.unpack("<I", tail)[0]:
                raise CorruptRecordError(
                    f"{path}: record {index} at byte {offset}: the CRC of its {length} bytes "
                    f"is {masked_crc32c(data):#010x}, the file says "
                    f"{struct.unpack('<I', tail)[0]:#010x}: the file is damaged (download it "
                    f"again)")
            yield data
            index += 1


# ---- protobuf wire format --------------------------------------------------------------------


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= len(data):
            raise ValueError("protobuf: the message ends inside a varint")
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos
        shift += 7
        if shift > 63:
            raise ValueError("protobuf: a varint longer than 10 bytes")


def decode_protobuf(data: bytes) -> dict[int, list]:
    """``{field number: [raw values in order]}`` of a protobuf message: varints as ints,
    64- and 32-bit fields as their 8 or 4 bytes, length-delimited fields as bytes (a nested
    message, a string or packed numbers: the schema says which). Decode a double with
    ``struct.unpack("<d", value)``.

    Raises:
        ValueError: the bytes are not a well-formed message.
    """
    fields: dict[int, list] = {}
    pos = 0
    while pos < len(data):
        key, pos = _varint(data, pos)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, pos = _varint(data, pos)
        elif wire in (1, 5):
            size = 8 if wire == 1 else 4
            value, pos = data[pos:pos + size], pos + size
            if len(value) < size:
                raise ValueError(f"protobuf: field {number} ends early")
        elif wire == 2:
            size, pos = _varint(data, pos)
            value, pos = data[pos:pos + size], pos + size
            if len(value) < size:
                raise ValueError(f"protobuf: field {number} ends early")
        else:  # 3, 4: groups (deprecated, unused by the benchmarks); 6, 7: not wire types
            raise ValueError(f"protobuf: field {number} has wire type {wire}, not read here")
        if number == 0:
            raise ValueError("protobuf: field number 0")
        fields.setdefault(number, []).append(value)
    return fields
