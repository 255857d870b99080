"""Reading a zstd file, and seeing when it was cut.

zstandard's stream reader ends quietly where the input ends, mid-frame or not, so a truncated
file would read as a shorter, valid-looking text. :class:`FrameWalk` follows the frames' own
structure (RFC 8878: each frame's header, then block headers whose sizes say where the next one
starts, then the optional checksum; skippable frames by their size) on the compressed bytes as
the decompressor reads them, so the file is read once; at the end it says whether the last frame
is complete. A cut that falls exactly between two frames leaves a valid zstd file and cannot be
seen. (zstandard's ``decompressobj`` would say whether a frame ended, but it returns all that a
piece of input decompresses to at once, unbounded; the stream reader keeps each read to its size.)
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, BinaryIO

ZSTD_MAGIC = 0xFD2FB528
_SKIPPABLE = 0x184D2A50  # .. 0x184D2A5F: a skippable frame (magic, 4-byte size, data)
_DICT_ID = (0, 1, 2, 4)
_CONTENT_SIZE = (0, 2, 4, 8)  # by the descriptor's two top bits; 0 with a single segment means 1 byte


def is_zstd(head: bytes) -> bool:
    """Whether a file starting with ``head`` (its first 4 bytes) is zstd: a frame or a skippable one."""
    value = int.from_bytes(head[:4], "little") if len(head) >= 4 else -1
    return value == ZSTD_MAGIC or value & 0xFFFFFFF0 == _SKIPPABLE


class FrameWalk:
    """The zstd frame structure of a stream of compressed bytes, fed in any pieces."""

    def __init__(self) -> None:
        self.pos = 0  # bytes fed so far
        self.frame_at = 0  # where the frame being read starts
        self._state = "magic"
        self._want = 4  # header bytes needed before the next decision
        self._head = b""
        self._skip = 0  # bytes to pass over (a block's content, a header's fixed fields, a checksum)
        self._checksum = False
        self.error: str | None = None

    def feed(self, data: bytes) -> None:
        i, n = 0, len(data)
        while i < n and self.error is None:
            if self._skip:
                step = min(self._skip, n - i)
                self._skip -= step
                i += step
                continue
            take = min(self._want - len(self._head), n - i)
            self._head += data[i : i + take]
            i += take
            if len(self._head) == self._want:
                self._decide(self.pos + i)
        self.pos += n

    def _decide(self, at: int) -> None:
        head, self._head = self._head, b""
        value = int.from_bytes(head, "little")
        if self._state == "magic":
            self.frame_at = at - 4
            if value == ZSTD_MAGIC:
                self._state, self._want = "descriptor", 1
            elif value & 0xFFFFFFF0 == _SKIPPABLE:
                self._state, self._want = "skippable", 4
            else:
                self.error = f"no zstd frame at byte {self.frame_at} (it reads {head.hex()})"
        elif self._state == "skippable":
            self._skip, self._state, self._want = value, "magic", 4
        elif self._state == "descriptor":
            single = bool(value & 0x20)
            self._checksum = bool(value & 0x04)
            size = _CONTENT_SIZE[value >> 6] or int(single)
            self._skip = (not single) + _DICT_ID[value & 0x03] + size
            self._state, self._want = "block", 3
        else:  # a block header: last-block bit, type (0 raw, 1 RLE, 2 compressed, 3 reserved), size
            kind, size = (value >> 1) & 0x03, value >> 3
            if kind == 3:
                self.error = f"a block of the reserved type in the zstd frame at byte {self.frame_at}"
                return
            self._skip = 1 if kind == 1 else size
            if value & 1:  # the frame's last block: then its checksum, and the next frame
                self._skip += 4 * self._checksum
                self._state, self._want = "magic", 4

    @property
    def complete(self) -> bool:
        """Whether the bytes fed end exactly where a frame ends."""
        return self.error is None and self._state == "magic" and not self._head and not self._skip

    def problem(self) -> str | None:
        """What is wrong with the bytes fed as a whole zstd file, in words; None when they are one."""
        if self.error is not None:
            return self.error
        if self.complete:
            return None
        return f"truncated: the zstd frame at byte {self.frame_at} runs past the file's end ({self.pos:,} bytes)"


class _Watched:
    """A file whose bytes, as they are read, are fed to a :class:`FrameWalk`."""

    def __init__(self, f: BinaryIO, walk: FrameWalk) -> None:
        self.f, self.walk = f, walk

    def read(self, size: int = -1) -> bytes:
        data = self.f.read(size)
        self.walk.feed(data)
        return data

    def close(self) -> None:
        self.f.close()


def zstd_blocks(f: BinaryIO, block: int) -> Iterator[bytes]:
    """The decompressed bytes of the zstd file ``f`` (read from its start), ``block`` bytes at a
    time; ValueError (the problem in words) when its last frame is incomplete or it holds no zstd
    frames. ImportError without zstandard, naming the extra that brings it."""
    try:
        import zstandard
    except ImportError:
        raise ImportError("reading zstd needs zstandard: pip install 'portapipe[data]'") from None

    walk = FrameWalk()
    watched = _Watched(f, walk)
    reader: Any = zstandard.ZstdDecompressor().stream_reader(watched, read_across_frames=True, closefd=False)
    try:
        while data := reader.read(block):
            if walk.error is not None:
                break
            yield data
    except zstandard.ZstdError:
        if walk.error is None:
            raise  # the walk read the same bytes: where it found no frame, its words say where
    problem = walk.problem()
    if problem is None and f.read(1):  # the decompressor stopped before the file's end: never quietly
        problem = f"the zstd reader stopped at byte {walk.pos:,}, before the file's end"
    if problem is not None:
        raise ValueError(problem)
