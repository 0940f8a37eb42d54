"""A small text-classification data set that ships with Python: docstrings of the standard library,
labelled by the family of modules they document.

Each sample is a piece of at most 16 words of a docstring (of a module, class or function) of a
standard-library module, read from its source file with :mod:`ast` (nothing is imported or
downloaded); its label is the module's family, after the chapters of the Python Library Reference:

    text      text and data formats (string, re, csv, json, email, xml, html, ...)
    network   networking and the internet (socket, ssl, asyncio, http, urllib, ...)
    develop   development and debugging tools (unittest, doctest, pdb, inspect, ast, ...)

The classes are balanced and the split is fixed (it does not depend on the training seed). The
exact samples depend on the Python version (the standard library changes); modules a version lacks
are skipped.

The tokenizer is words hashed into a fixed number of buckets: its vocabulary does not depend on the
training text. A vocabulary counted from the training set would be a computation on the private data
outside the privacy accounting (which words occur at all can reveal a sample).
"""

from __future__ import annotations

import ast
import os
import random
import re
import sysconfig
import zlib
from dataclasses import dataclass
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import torch
from torch.utils.data import Dataset

FAMILIES: Dict[str, Tuple[str, ...]] = {
    "text": ("string", "re", "textwrap", "difflib", "stringprep", "codecs", "csv", "configparser", "json", "html",
             "xml", "email", "mailbox", "mimetypes", "base64", "quopri", "gettext", "locale", "tomllib", "netrc",
             "plistlib", "encodings"),
    "network": ("socket", "ssl", "selectors", "asyncio", "http", "urllib", "ftplib", "poplib", "imaplib", "smtplib",
                "xmlrpc", "socketserver", "wsgiref", "ipaddress", "uuid", "webbrowser"),
    "develop": ("unittest", "doctest", "pdb", "bdb", "trace", "traceback", "inspect", "dis", "pydoc", "profile",
                "cProfile", "pstats", "timeit", "tracemalloc", "warnings", "code", "codeop", "importlib", "pkgutil",
                "modulefinder", "ast", "symtable", "tokenize", "tabnanny", "py_compile", "compileall", "pyclbr"),
}
LABELS: Tuple[str, ...] = tuple(FAMILIES)

PAD, CLS = 0, 1  # token ids reserved before the hashed words
NUM_RESERVED = 2
MIN_WORDS = 5  # shorter texts ("Return self.") say little about their module
CHUNK_WORDS = 16  # longer docstrings are cut into samples of at most this many words
MAX_TOKENS = 32  # CLS and the first 31 tokens of a sample (punctuation marks are tokens too): 7% are cut
TOKEN_PATTERN = re.compile(r"[a-z]+|[0-9]+|[^\sa-z0-9]")


@dataclass(frozen=True)
class TextSplit:
    """Tokenised samples of one split: ``ids[i]`` starts with CLS and has no padding."""

    texts: List[str]
    ids: List[List[int]]
    labels: List[int]


class TokenizedText(Dataset):
    """One (token ids, label) pair per sample, unpadded; :func:`pad_batch` pads a batch of them."""

    def __init__(self, split: TextSplit):
        self.split = split

    def __len__(self) -> int:
        return len(self.split.labels)

    def __getitem__(self, index: int) -> Tuple[torch.Tensor, int]:
        return torch.tensor(self.split.ids[index], dtype=torch.int64), self.split.labels[index]


class HashingTokenizer:
    """Lower-cased words, numbers and punctuation marks, each hashed (CRC-32) into one of
    ``vocab_size - NUM_RESERVED`` buckets; a sequence starts with ``CLS``. Fixed in advance, so the
    same on every machine and independent of any text it is applied to."""

    def __init__(self, vocab_size: int = 4096, max_length: int = MAX_TOKENS):
        if vocab_size <= NUM_RESERVED:
            raise ValueError(f"vocab_size must exceed the {NUM_RESERVED} reserved ids, got {vocab_size}")
        self.vocab_size = vocab_size
        self.max_length = max_length

    def words(self, text: str) -> List[str]:
        return TOKEN_PATTERN.findall(text.lower())

    def __call__(self, text: str) -> List[int]:
        buckets = self.vocab_size - NUM_RESERVED
        ids = [NUM_RESERVED + zlib.crc32(word.encode()) % buckets for word in self.words(text)]
        return [CLS] + ids[: self.max_length - 1]


def pad_batch(samples: Sequence[Tuple[torch.Tensor, int]], length: Optional[int] = MAX_TOKENS):
    """Collates ``(ids, label)`` samples into ``(input_ids, attention_mask, labels)``, each sequence padded
    with PAD to ``length`` tokens (``None``: to the longest sequence of the batch). ``attention_mask`` is
    1 on tokens and 0 on padding."""
    if length is None:
        length = max((len(ids) for ids, _ in samples), default=1)
    input_ids = torch.full((len(samples), length), PAD, dtype=torch.int64)
    attention_mask = torch.zeros((len(samples), length), dtype=torch.int64)
    for row, (ids, _) in enumerate(samples):
        ids = ids[:length]
        input_ids[row, : len(ids)] = ids
        attention_mask[row, : len(ids)] = 1
    labels = torch.tensor([label for _, label in samples], dtype=torch.int64)
    return input_ids, attention_mask, labels


def load_docstring_classification(tokenizer: HashingTokenizer, test_fraction: float = 0.2, split_seed: int = 0,
                                  chunk_words: int = CHUNK_WORDS) -> Tuple[TextSplit, TextSplit]:
    """(train, test) splits of stdlib docstrings labelled by family.

    Docstrings are split between train and test first (``test_fraction`` of each family's docstrings
    go to test), then cut into samples of at most ``chunk_words`` words, so that no docstring has
    pieces on both sides (a test piece equal to a training piece, from a near-copy of a docstring, is
    dropped too). Each split is then balanced: every class keeps as many samples as the
    smallest. A docstring that occurs twice is kept once, and not at all when it occurs in two
    families (its label would be ambiguous)."""
    by_text: Dict[str, set] = {}
    for label, family in enumerate(LABELS):
        for text in _family_docstrings(FAMILIES[family]):
            by_text.setdefault(text, set()).add(label)
    by_label: List[List[str]] = [[] for _ in LABELS]
    for text in sorted(by_text):  # sorted: the same order whatever order the file system lists files in
        labels = by_text[text]
        if len(labels) == 1:
            by_label[next(iter(labels))].append(text)

    rng = random.Random(split_seed)
    train_chunks: List[List[str]] = []
    test_chunks: List[List[str]] = []
    for texts in by_label:
        texts = rng.sample(texts, len(texts))
        num_test = round(test_fraction * len(texts))
        test_chunks.append([c for text in texts[:num_test] for c in _chunks(text, chunk_words)])
        train_chunks.append([c for text in texts[num_test:] for c in _chunks(text, chunk_words)])
    # Near-copies of a docstring (a method documented again in a subclass) can share a piece.
    seen_in_training = {chunk for chunks in train_chunks for chunk in chunks}
    test_chunks = [[chunk for chunk in chunks if chunk not in seen_in_training] for chunks in test_chunks]
    train, test = _balanced(train_chunks, rng), _balanced(test_chunks, rng)
    rng.shuffle(train)
    return _tokenize(train, tokenizer), _tokenize(test, tokenizer)


def _chunks(text: str, chunk_words: int) -> List[str]:
    """``text`` cut into pieces of ``chunk_words`` words; a last piece shorter than MIN_WORDS is dropped."""
    words = text.split()
    pieces = [words[start:start + chunk_words] for start in range(0, len(words), chunk_words)]
    return [" ".join(piece) for piece in pieces if len(piece) >= MIN_WORDS]


def _balanced(chunks_by_label: List[List[str]], rng: random.Random) -> List[Tuple[str, int]]:
    size = min(len(chunks) for chunks in chunks_by_label)
    return [(chunk, label) for label, chunks in enumerate(chunks_by_label) for chunk in rng.sample(chunks, size)]


def _tokenize(samples: List[Tuple[str, int]], tokenizer: HashingTokenizer) -> TextSplit:
    return TextSplit(texts=[text for text, _ in samples], ids=[tokenizer(text) for text, _ in samples],
                     labels=[label for _, label in samples])


def _family_docstrings(modules: Sequence[str]) -> Iterator[str]:
    for path in _source_files(modules):
        with open(path, encoding="utf-8") as source:
            try:
                tree = ast.parse(source.read(), filename=path)
            except (SyntaxError, ValueError):  # a file meant for another Python version
                continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                docstring = ast.get_docstring(node)
                if docstring and len(docstring.split()) >= MIN_WORDS:
                    yield " ".join(docstring.split())


def _source_files(modules: Sequence[str]) -> Iterator[str]:
    """The .py files of the named standard-library modules and packages (without their tests)."""
    stdlib = sysconfig.get_paths()["stdlib"]
    for name in modules:
        package = os.path.join(stdlib, name)
        if os.path.isdir(package):
            for folder, subfolders, files in os.walk(package):
                subfolders[:] = sorted(d for d in subfolders if d not in ("test", "tests", "__pycache__"))
                yield from (os.path.join(folder, f) for f in sorted(files) if f.endswith(".py"))
        elif os.path.isfile(package + ".py"):
            yield package + ".py"
