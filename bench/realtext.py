"""Real text for the drafting benchmarks: token streams of source code and prose on this machine.

Code: the Python standard library sources. Prose: the package documentation under
/usr/share/doc (changelogs, copyright texts, plain-text manuals; gzip files are read too).
Tokens come from the model's tokenizer (SmolLM2, rebuilt from the GGUF file by
:mod:`ngram_hal.engine.tokenizer`); where the model file or the tokenizer is missing, a
word-level split (words, single punctuation marks, runs of spaces) numbered in first-seen order
stands in, and the result says so. Token streams are cached as .npy under the cache folder.
"""

from __future__ import annotations

import gzip
import re
import sys
from pathlib import Path

import numpy as np

SOURCES = {
    "code": (Path(sys.base_prefix) / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}",
             ("*.py",)),
    "prose": (Path("/usr/share/doc"), ("*.txt", "copyright", "changelog*.gz", "NEWS*", "README*")),
}
_WORD = re.compile(r"\w+|\s+|[^\w\s]")


def _files(kind: str) -> list[Path]:
    root, patterns = SOURCES[kind]
    found = {p for pattern in patterns for p in root.rglob(pattern) if p.is_file()}
    return sorted(found)


def _read(path: Path) -> str:
    data = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    return data.decode("utf-8", errors="replace")


def _encoder():
    """(encode, name): the SmolLM2 tokenizer where it loads, else a word-level split."""
    try:
        from ngram_hal.engine.tokenizer import Tokenizer
        tok = Tokenizer.from_gguf()
        return (lambda text: tok.encode(text, add_special_tokens=False)), "smollm2"
    except Exception as e:  # the model file or the tokenizer is not there: say so, fall back
        print(f"note: SmolLM2 tokenizer unavailable ({type(e).__name__}: {e}); using word-level tokens",
              file=sys.stderr)
    vocab: dict[str, int] = {}
    return (lambda text: [vocab.setdefault(w, len(vocab)) for w in _WORD.findall(text)]), "words"


def load_tokens(kind: str, count: int, cache_dir: Path) -> tuple[np.ndarray, str]:
    """At least ``count`` tokens of ``kind`` ("code" or "prose") as int64, and the tokenizer's name.

    Files are read in sorted path order and their tokens concatenated; fewer tokens come back
    only when the files run out.
    """
    cache_dir.mkdir(parents=True, exist_ok=True)
    for cached in sorted(cache_dir.glob(f"{kind}-*-*.npy")):
        _, name, n = cached.stem.split("-", 2)
        if int(n) >= count:
            return np.load(cached)[:count], name
    encode, name = _encoder()
    parts, total = [], 0
    for path in _files(kind):
        ids = encode(_read(path))
        parts.append(np.asarray(ids, np.int64))
        total += len(ids)
        if total >= count:
            break
    tokens = np.concatenate(parts)
    np.save(cache_dir / f"{kind}-{name}-{tokens.size}.npy", tokens)
    return tokens[:count], name
