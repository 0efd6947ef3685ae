"""Packages on the wire: protobuf, compressed with zstd, identified by a deterministic message id."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import zstandard

from siphon_core.wire import siphon_pb2 as pb

ZSTD_LEVEL = 1  # fast: the producer is CPU-bound, the queue is not short of space
_local = threading.local()


class PackageError(ValueError):
    """A message that is not a valid Siphon package; the message says where it came from."""


def _compressor() -> zstandard.ZstdCompressor:
    if not hasattr(_local, "compressor"):
        _local.compressor = zstandard.ZstdCompressor(level=ZSTD_LEVEL)
        _local.decompressor = zstandard.ZstdDecompressor()
    return _local.compressor


def _decompressor() -> zstandard.ZstdDecompressor:
    _compressor()
    return _local.decompressor


def encode_package(package: pb.Package) -> bytes:
    return _compressor().compress(package.SerializeToString())


def decode_package(data: bytes, where: str = "message") -> pb.Package:
    return parse_package(decompress_package(data, where), where)


def decompress_package(data: bytes, where: str = "message", max_bytes: int | None = None) -> bytes:
    """The serialized package inside a message; more than `max_bytes` of it is refused before it
    is produced (a few kilobytes of zstd can claim, or expand to, gigabytes)."""
    try:
        if max_bytes is None:
            return _decompressor().decompress(data)
        declared = zstandard.frame_content_size(data)
        if declared > max_bytes:
            raise PackageError(f"{where}: the package would decompress to {declared:,} bytes, more than the "
                               f"{max_bytes:,} bytes any producer writes")
        if declared >= 0:
            return _decompressor().decompress(data)
        # No declared size: read at most one byte past the limit, never the whole expansion.
        with _decompressor().stream_reader(data) as reader:
            serialized = reader.read(max_bytes + 1)
        if len(serialized) > max_bytes:
            raise PackageError(f"{where}: the package decompresses to more than the {max_bytes:,} bytes any "
                               "producer writes")
        return serialized
    except zstandard.ZstdError as error:
        raise PackageError(f"{where}: not a zstd-compressed package ({error})") from None


def parse_package(serialized: bytes, where: str = "message") -> pb.Package:
    package = pb.Package()
    try:
        package.ParseFromString(serialized)
    except Exception as error:  # protobuf raises DecodeError, a plain Exception subclass
        raise PackageError(f"{where}: not a Siphon package ({error})") from None
    return package


def message_id(package: pb.Package) -> str:
    """The same data gets the same id, so JetStream drops a resend within its duplicate window."""
    chunk = f":{package.chunk.index}/{package.chunk.count}" if package.HasField("chunk") else ""
    return (f"{package.schema}.{package.table}:{package.first_commit_lsn:x}.{package.first_position}"
            f"-{package.last_commit_lsn:x}.{package.last_position}{chunk}")


@dataclass
class ChunkReassembler:
    """Joins the slices of an event too large for one message (see `Chunk` in the proto)."""

    _parts: dict[tuple[str, str], list[bytes]] = field(default_factory=dict)

    def accept(self, package: pb.Package) -> pb.Package | None:
        """Returns a whole package, or None while slices are still missing."""
        if not package.HasField("chunk"):
            return package
        key = (package.schema, package.table)
        index, count = package.chunk.index, package.chunk.count
        parts = self._parts.setdefault(key, [])
        if index == 0:
            parts.clear()
        if index != len(parts):
            # A redelivery restarted the sequence; wait for slice 0 again.
            parts.clear()
            return None
        parts.append(package.event_chunk)
        if index + 1 < count:
            return None
        event = pb.Event()
        event.ParseFromString(b"".join(parts))
        del self._parts[key]
        whole = pb.Package()
        whole.CopyFrom(package)
        whole.ClearField("chunk")
        whole.ClearField("event_chunk")
        whole.events.append(event)
        return whole
