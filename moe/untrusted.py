"""Reading files that may have been tampered with (checkpoint metadata, HF indexes and
safetensors headers, settings files, cost profiles).

Only regular files are opened (a FIFO would block, /dev/zero would never end), optionally
only inside a directory (no link leading out), at most `max_bytes` are read, and JSON is
parsed in time linear in the file with a bounded nesting depth (deep nesting would exhaust
Python's stack), without duplicate keys (json keeps the last silently), without NaN or
infinite numbers (not JSON; Python's json accepts them) and without integers of more than
MAX_INT_DIGITS digits (no number a file of ours holds needs more; 10**400 overflows a float).
A read that fails (EIO from /proc/self/mem, a failing disk) is an error naming the file too.
Every problem is one error, of the caller's type, naming the file and what is wrong.
"""

import json
import math
import os
import re
import stat

import numpy as np

MAX_DEPTH = 64
MAX_INT_DIGITS = 20  # 2**64 has 20 digits (safetensors offsets are u64)
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')  # a JSON string, escapes included
_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


class UntrustedFileError(ValueError):
    """An untrusted file is missing, not a regular file, too large or malformed."""


def _where(path, what: str) -> str:
    return f"{what} {os.fspath(path)!r}" if what else repr(os.fspath(path))


_HUB_REPOSITORY = ("models--", "datasets--", "spaces--")


def containing_folder(directory) -> str:
    """The real folder that files read from `directory` must resolve inside: the directory
    itself, or, for a snapshot of a Hugging Face hub cache
    (`<cache>/models--org--name/snapshots/<hash>/...`, whose files are links to
    `../../blobs/<sha>`), its cache repository `<cache>/models--org--name`. A link out of that
    repository (another repository's blob, /etc/passwd) still leads outside."""
    real = os.path.realpath(directory)
    parts = real.split(os.sep)
    for i in range(len(parts) - 2, 0, -1):  # a snapshot: .../<repo>/snapshots/<hash>[/...]
        if parts[i] == "snapshots" and parts[i - 1].startswith(_HUB_REPOSITORY):
            repository = os.sep.join(parts[:i]) or os.sep
            if os.path.isdir(os.path.join(repository, "blobs")):
                return repository
    return real


class UntrustedFile:
    """A regular file opened by open_regular, for binary reading: a read that fails is the
    caller's error naming the file (not OSError: /proc/self/mem is a regular file whose
    reads fail with EIO). A context manager, like the file it wraps."""

    def __init__(self, f, name: str, error: type):
        self._f, self.name, self._error = f, name, error

    def _failed(self, e: OSError):
        return self._error(f"{self.name}: cannot read: {e.strerror or e}")

    def read(self, n: int = -1) -> bytes:
        try:
            return self._f.read(n)
        except OSError as e:
            raise self._failed(e) from None

    def readline(self, n: int = -1) -> bytes:
        try:
            return self._f.readline(n)
        except OSError as e:
            raise self._failed(e) from None

    def __iter__(self):
        return iter(self.readline, b"")

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        try:
            return self._f.seek(offset, whence)
        except OSError as e:
            raise self._failed(e) from None

    def tell(self) -> int:
        return self._f.tell()

    def fileno(self) -> int:
        return self._f.fileno()

    def close(self) -> None:
        self._f.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self._f.close()


def open_regular(
    path, *, root=None, error: type = UntrustedFileError, what: str = ""
) -> UntrustedFile:
    """Open `path` for binary reading if it is a regular file (and, with `root`, if its real
    path lies inside containing_folder(root): `root`, or the hub-cache repository of a
    snapshot); anything else, and a read that fails, is `error` naming the file."""
    name = _where(path, what)
    target = os.fspath(path)
    flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
    if root is not None:
        top, target = containing_folder(root), os.path.realpath(path)
        if os.path.commonpath([top, target]) != top or target == top:
            raise error(f"{name}: resolves to {target!r}, outside {top!r}")
        flags |= getattr(os, "O_NOFOLLOW", 0)  # the resolved path holds no link at its end
    try:
        fd = os.open(target, flags)
    except FileNotFoundError:
        raise error(f"{name}: no such file") from None
    except OSError as e:
        raise error(f"{name}: cannot open: {e.strerror or e}") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        kind = next((k for test, k in _KINDS if test(mode)), "not a regular file")
        raise error(f"{name}: is {kind}, not a regular file")
    return UntrustedFile(os.fdopen(fd, "rb"), name, error)


def read_bytes(
    path, max_bytes: int, *, root=None, error: type = UntrustedFileError, what: str = ""
) -> bytes:
    """The whole content of a regular file of at most `max_bytes` bytes."""
    with open_regular(path, root=root, error=error, what=what) as f:
        size = os.fstat(f.fileno()).st_size
        data = f.read(max_bytes + 1) if size <= max_bytes else b""
    if size > max_bytes or len(data) > max_bytes:
        raise error(f"{_where(path, what)}: larger than the limit of {max_bytes} bytes")
    return data


def json_depth(data: bytes) -> int:
    """Deepest nesting of [ and { outside strings, in linear time without recursion."""
    code = np.frombuffer(_STRING.sub(b'""', data), dtype=np.uint8)
    opens = (code == ord("[")) | (code == ord("{"))
    closes = (code == ord("]")) | (code == ord("}"))
    step = opens.astype(np.int8) - closes.astype(np.int8)
    step = step[opens | closes]
    return int(np.cumsum(step, dtype=np.int64).max()) if step.size else 0


class _DuplicateKey(Exception):
    pass


class _NotANumber(Exception):
    pass


def _first_non_finite(doc, infinity: bool = False) -> str:
    """Where the first NaN or infinite float (NaN only, with `infinity`) of a parsed document
    sits, e.g. "objects.extra.loss" (document order; iterative: the depth is already bounded)."""
    stack: list[tuple[str, object]] = [("", doc)]
    while stack:
        where, value = stack.pop()
        if isinstance(value, float) and (math.isnan(value) or not infinity and math.isinf(value)):
            return where or "the document"
        if isinstance(value, dict):
            items = [(f"{where}.{k}" if where else str(k), v) for k, v in value.items()]
        elif isinstance(value, list):
            items = [(f"{where}[{i}]", v) for i, v in enumerate(value)]
        else:
            continue
        stack.extend(reversed(items))
    return "the document"


def _float(text: str, non_finite: list[str]) -> float:
    value = float(text)
    if not math.isfinite(value):  # 1e999
        non_finite.append(text)
    return value


def _int(text: str) -> int:
    digits = len(text.lstrip("-"))
    if digits > MAX_INT_DIGITS:
        raise _NotANumber(f"an integer of {digits} digits (at most {MAX_INT_DIGITS} allowed)")
    return int(text)


def _unique_object(pairs: list) -> dict:
    obj = dict(pairs)
    if len(obj) != len(pairs):
        seen: set = set()
        raise _DuplicateKey(next(k for k, _ in pairs if k in seen or seen.add(k)))
    return obj


def parse_json(
    data: bytes,
    where: str,
    *,
    max_depth: int = MAX_DEPTH,
    error: type = UntrustedFileError,
    infinity: bool = False,
):
    """Decode JSON bytes from an untrusted source named `where`; `infinity`: Infinity and
    -Infinity accepted (transformers writes a float("inf") default so), NaN still refused."""
    depth = json_depth(data)
    non_finite: list[str] = []
    if depth > max_depth:
        raise error(f"{where}: JSON nested {depth} levels deep (at most {max_depth} allowed)")
    try:
        doc = json.loads(
            data.decode("utf-8"),
            object_pairs_hook=_unique_object,
            parse_constant=lambda name: non_finite.append(name) or float(name),
            parse_float=lambda text: _float(text, non_finite),
            parse_int=_int,
        )
    except UnicodeDecodeError as e:
        raise error(f"{where}: not UTF-8 text ({e})") from None
    except _DuplicateKey as e:
        raise error(f"{where}: key {e.args[0]!r:.100} appears twice in one JSON object") from None
    except _NotANumber as e:
        raise error(f"{where}: {e}") from None
    except (ValueError, RecursionError) as e:  # JSONDecodeError; an int of too many digits
        raise error(f"{where}: not valid JSON ({e})") from None
    non_finite = [t for t in non_finite if not (infinity and math.isinf(float(t)))]
    if non_finite:  # NaN, Infinity, 1e999: not JSON numbers (Python's json accepts them)
        kind = "a number" if infinity else "a finite number"
        raise error(
            f"{where}: {_first_non_finite(doc, infinity)} is {non_finite[0][:40]}, not {kind} "
            f"({'NaN is' if infinity else 'non-finite numbers are'} refused)"
        )
    return doc


def read_json(
    path,
    max_bytes: int,
    *,
    max_depth: int = MAX_DEPTH,
    root=None,
    error: type = UntrustedFileError,
    what: str = "",
    infinity: bool = False,
):
    """Parse the JSON file `path`: a regular file (inside `root` if given) of at most
    `max_bytes` bytes, nested at most `max_depth` deep, without duplicate keys."""
    data = read_bytes(path, max_bytes, root=root, error=error, what=what)
    return parse_json(data, _where(path, what), max_depth=max_depth, error=error, infinity=infinity)


SAFETENSORS_MAX_HEADER_BYTES = 100_000_000  # safetensors' own limit


def safetensors_header(f, where: str, error=UntrustedFileError) -> tuple[dict, int]:
    """(header, header bytes n) of an open safetensors file: its 8-byte length checked against
    the file's size before the JSON is read; the tensor data starts at byte 8 + n."""
    size = os.fstat(f.fileno()).st_size
    prefix = f.read(8)
    n = int.from_bytes(prefix, "little") if len(prefix) == 8 else -1
    if not 2 <= n <= min(SAFETENSORS_MAX_HEADER_BYTES, size - 8):
        raise error(f"{where}: header length {n} does not fit the file ({size} bytes)")
    header = parse_json(f.read(n), where, error=error)
    if not isinstance(header, dict):
        raise error(f"{where}: the header is not a JSON object")
    return header, n
