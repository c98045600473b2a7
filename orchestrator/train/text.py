"""`lm_text`: real English text, tokenized offline, as fixed-length blocks of token ids for a causal LM.

The corpus is the Python documentation's English prose that every CPython ships in its standard library
(`pydoc_data/topics.py`: the language reference and library topics `help()` shows, about 465,000 characters,
under the PSF licence), or any UTF-8 text file of the user's (`data.kwargs.path`). Nothing is downloaded.

The tokenizer is trained on the training part of the corpus, offline: a byte-level BPE (`tokenizer: bpe`, the
`tokenizers` package that comes with `transformers`), or the 256 bytes of UTF-8 (`tokenizer: bytes`, nothing to
install). A trained tokenizer is kept in `data.root/lm_text/` under a name that hashes the corpus and the settings,
so the driver's pre-flight trains it once and every worker on that machine reads the same file.

The corpus is split in two: its first `1 - eval_fraction` of the text for training, the rest for evaluation (a
split of the text, never of shuffled blocks, so no eval text is seen in training). Each split is cut into
non-overlapping blocks of `block_size` tokens; a sample is `{"input_ids": block, "labels": block}`, both int64 of
length `block_size`: the next-token loss (`task.loss: next_token`, or a Hugging Face causal LM's own with
`task.loss: model`) shifts the labels by one. So `task.inputs: [input_ids]`, `task.target: labels`.
"""

import hashlib
import importlib.util
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch
from torch.utils.data import Dataset

from orchestrator.errors import BadInput, DataUnavailable

NAME = "lm_text"
STDLIB_CORPUS = "pydoc_data"
"""`data.kwargs.path` for the standard library's own English text (the default)."""
TOKENIZERS = ("bpe", "bytes")


@dataclass(frozen=True)
class TextSettings:
    """`data.kwargs` of `lm_text`, each with its default."""

    path: str = STDLIB_CORPUS
    """A UTF-8 text file, or `pydoc_data`: the Python documentation's English text in the standard library."""
    tokenizer: str = "bpe"
    """`bpe`: a byte-level BPE trained on the corpus (needs `tokenizers`); `bytes`: UTF-8 bytes, vocabulary 256."""
    vocab_size: int = 512
    """The BPE's vocabulary size at most (at least 257: the 256 bytes and one merge; a small text may support fewer
    merges); `bytes` has 256 whatever it says. `model.kwargs.vocab_size` must be at least this."""
    block_size: int = 128
    """Tokens per sample (the model's sequence length; GPT-2's is 1024)."""
    eval_fraction: float = 0.1
    """The share of the corpus's text, at its end, held out for evaluation."""

    @classmethod
    def of(cls, kwargs: dict[str, Any]) -> "TextSettings":
        known = cls.__dataclass_fields__
        unknown = sorted(set(kwargs) - set(known))
        if unknown:
            raise BadInput(f"data.kwargs: {NAME} takes {', '.join(known)}; not {', '.join(unknown)}.")
        settings = cls(**kwargs)
        if settings.tokenizer not in TOKENIZERS:
            raise BadInput(f"data.kwargs.tokenizer: '{settings.tokenizer}' is not one of {', '.join(TOKENIZERS)}.")
        if settings.tokenizer == "bpe" and not 257 <= int(settings.vocab_size) <= 1_000_000:
            raise BadInput(f"data.kwargs.vocab_size: {settings.vocab_size}; a byte-level BPE needs at least 257 "
                           "(the 256 bytes and one merge).")
        if int(settings.block_size) < 2:
            raise BadInput(f"data.kwargs.block_size: {settings.block_size}; a next-token block needs at least 2.")
        if not 0 < float(settings.eval_fraction) < 1:
            raise BadInput(f"data.kwargs.eval_fraction: {settings.eval_fraction}; give a fraction between 0 and 1.")
        return settings


def corpus_text(path: str = STDLIB_CORPUS) -> str:
    """The corpus: the standard library's `pydoc_data.topics` prose, or the text file at `path`;
    DataUnavailable saying what to install or give where there is none."""
    if path != STDLIB_CORPUS:
        file = Path(path).expanduser()
        if not file.is_file():
            raise DataUnavailable(f"data.kwargs.path: {file} is not a file. Give a UTF-8 text file, or "
                                  f"'{STDLIB_CORPUS}' for the Python documentation's text.")
        try:
            return file.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise DataUnavailable(f"data.kwargs.path: {file} cannot be read as UTF-8 text ({exc}).") from None
    if importlib.util.find_spec("pydoc_data.topics") is None:
        raise DataUnavailable(
            f"data.name: {NAME} reads the Python documentation's text from the standard library's pydoc_data, "
            "which this Python lacks (a stripped-down build). Install the full standard library (Debian: apt-get "
            "install libpython3-stdlib; or a python.org / conda Python), or give a text file as data.kwargs.path.")
    from pydoc_data.topics import topics  # the text `help('if')` shows; one dict of str, in every CPython

    return "\n\n".join(topics[key] for key in sorted(topics))


class ByteTokenizer:
    """UTF-8 bytes as token ids 0..255."""

    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(ids).decode("utf-8", errors="replace")


class BpeTokenizer:
    """A byte-level BPE (the `tokenizers` package's, as GPT-2's), trained on the corpus or read from its file."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.vocab_size = tokenizer.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text).ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)


def _tokenizers():
    try:
        import tokenizers
    except ImportError:
        raise DataUnavailable(f"data.kwargs.tokenizer: bpe trains a byte-level BPE with the tokenizers package, "
                              "which is not installed. Install it (pip install tokenizers, or pip install "
                              "'ampflow[lm]'; transformers brings it too), or set data.kwargs.tokenizer: bytes "
                              "(UTF-8 bytes, vocabulary 256).") from None
    return tokenizers


def train_bpe(text: str, vocab_size: int) -> BpeTokenizer:
    """A byte-level BPE of `vocab_size` tokens trained on `text`, offline, in a few seconds."""
    tokenizers = _tokenizers()
    tokenizer = tokenizers.Tokenizer(tokenizers.models.BPE())
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False,
                                             initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
    lines = text.splitlines(keepends=True)
    tokenizer.train_from_iterator((lines[i:i + 1000] for i in range(0, len(lines), 1000)), trainer=trainer)
    return BpeTokenizer(tokenizer)


def tokenizer_for(text: str, settings: TextSettings, cache: Optional[Path]) -> ByteTokenizer | BpeTokenizer:
    """The job's tokenizer for `text` (the training part of the corpus): bytes, or a BPE read from `cache` when it
    was trained there before, else trained and kept there (written whole, then renamed: a worker never reads half
    a file)."""
    if settings.tokenizer == "bytes":
        return ByteTokenizer()
    tokenizers = _tokenizers()
    digest = hashlib.sha256(f"{settings.vocab_size}\0{tokenizers.__version__}\0".encode() + text.encode()).hexdigest()
    file = cache / f"bpe-{settings.vocab_size}-{digest[:16]}.json" if cache is not None else None
    if file is not None and file.is_file():
        try:
            return BpeTokenizer(tokenizers.Tokenizer.from_file(str(file)))
        except Exception:  # noqa: BLE001 (a damaged cache file): trained again below
            pass
    tokenizer = train_bpe(text, int(settings.vocab_size))
    if file is not None:
        try:
            file.parent.mkdir(parents=True, exist_ok=True)
            handle, temporary = tempfile.mkstemp(dir=file.parent, suffix=".tmp")
            os.close(handle)
            tokenizer.tokenizer.save(temporary)
            os.replace(temporary, file)
        except OSError:  # a read-only data.root: the tokenizer is trained in each process instead
            pass
    return tokenizer


class TokenBlocks(Dataset):
    """Consecutive, non-overlapping blocks of `block_size` token ids: `{"input_ids": block, "labels": block}`."""

    def __init__(self, ids: torch.Tensor, block_size: int, vocab_size: int):
        self.block_size, self.vocab_size = block_size, vocab_size
        self.ids = ids[:len(ids) // block_size * block_size].view(-1, block_size)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        block = self.ids[index]
        return {"input_ids": block, "labels": block.clone()}


def lm_text(data_cfg) -> tuple[TokenBlocks, TokenBlocks]:
    """(train, eval) blocks of the corpus as `data.kwargs` says (`TextSettings`)."""
    settings = TextSettings.of(dict(data_cfg.kwargs))
    text = corpus_text(settings.path)
    cut = int(len(text) * (1 - float(settings.eval_fraction)))
    tokenizer = tokenizer_for(text[:cut], settings, Path(data_cfg.root) / NAME)
    block = int(settings.block_size)
    splits = [TokenBlocks(torch.tensor(tokenizer.encode(part), dtype=torch.long), block, tokenizer.vocab_size)
              for part in (text[:cut], text[cut:])]
    if len(splits[1]) == 0:
        raise BadInput(f"data.kwargs: the eval part of the corpus ({len(text) - cut} characters) makes no block of "
                       f"{block} tokens. Raise data.kwargs.eval_fraction or lower data.kwargs.block_size.")
    return splits[0], splits[1]
