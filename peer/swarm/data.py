"""Data pipeline of the run (trainers train on it, the aux peer evaluates on it): text source -> tokenizer ->
packed fixed-length blocks -> batches.

Sources (``DataArguments.dataset``):

- ``"shipped"``: the small public-domain corpus in ``peer/assets/corpus`` (train/validation splits);
- a local file, glob or folder of ``.txt``/``.json``/``.jsonl``/``.parquet`` files;
- a Hugging Face dataset name, streamed (needs network).

Every source goes through the same steps: ``datasets.load_dataset`` -> per-peer shuffle ->
tokenize (eos after each document) -> pack into blocks of ``max_sequence_length`` tokens with no
padding and no token lost -> ``make_batches`` cuts the token stream into rows of the current
(warm-up) sequence length.
"""

from __future__ import annotations

import glob
import itertools
import logging
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

logger = logging.getLogger(__name__)

SHIPPED = "shipped"
_ASSETS_DIR = Path(__file__).resolve().parent.parent / "assets"  # peer/assets: package data
# load_dataset builder for each supported file type (compressed variants such as .jsonl.gz too).
_BUILDERS = {".txt": "text", ".json": "json", ".jsonl": "json", ".parquet": "parquet"}
_COMPRESSION_SUFFIXES = {".gz", ".bz2", ".xz", ".zst", ".lz4"}
_TEXT_SAMPLE_BY = ("line", "paragraph", "document")
_LOG_INTERVAL_S = 30.0  # how often a long tokenization pass reports progress
_SEQ_MULTIPLE = 8  # warm-up lengths are multiples of 8 (tensor-core friendly shapes)
_SOURCE_HELP = (
    "'shipped', a local .txt/.json/.jsonl/.parquet file, folder or glob, "
    "or a Hugging Face dataset name such as 'wikitext'"
)


def shipped_corpus_dir() -> Path:
    """Folder of the shipped corpus: ``train.txt``, ``validation.txt`` and its license ``README.md``."""
    return _ASSETS_DIR / "corpus"


def shipped_tokenizer_dir() -> Path:
    """Folder of the shipped byte-level BPE tokenizer (loadable with ``AutoTokenizer``)."""
    return _ASSETS_DIR / "tokenizer"


@dataclass
class DataArguments:
    """Where the text comes from, how it is tokenized, and how sequences are shaped."""

    dataset: str = SHIPPED
    """'shipped' (the bundled public-domain corpus); a local file, folder or glob of
    .txt/.json/.jsonl/.parquet files (a folder's files named train*/validation* become those splits);
    or a Hugging Face dataset name, streamed (needs network)."""
    dataset_config: str | None = None
    """Configuration name of a Hugging Face dataset (e.g. 'wikitext-103-raw-v1'); Hub names only."""
    text_column: str = "text"
    """Column holding the documents' text (.txt files always give 'text')."""
    train_split: str = "train"
    """Split to train on."""
    validation_split: str = "validation"
    """Split to evaluate on (a single local file or glob has none: use a folder with validation* files)."""
    text_sample_by: str = "paragraph"
    """How .txt files are cut into documents: 'paragraph' (blank-line separated), 'line' or 'document' (whole file)."""
    streaming: bool | None = None
    """Stream instead of preparing an Arrow copy on disk first; None: stream everything but the shipped corpus."""
    tokenizer: str = field(default_factory=lambda: str(shipped_tokenizer_dir()))
    """AutoTokenizer name or path; default: the tokenizer trained on the shipped corpus."""
    max_sequence_length: int = 128
    """Length of the packed blocks, and the sequence length once warm-up is over."""
    seq_warmup_start_length: int = 32
    """Sequence length at global epoch 0 (a multiple of 8); 0, or >= max_sequence_length, disables warm-up."""
    seq_warmup_epochs: int = 100
    """Global epochs over which the length grows linearly from the start length to the maximum; 0 disables warm-up."""
    shuffle_buffer_size: int = 10_000
    """Documents held in the shuffle buffer of a streamed dataset."""
    max_validation_blocks: int = 2048
    """At most this many blocks in the validation set (a streamed validation split can be huge)."""
    seed: int = 0
    """Base shuffle seed; combined with each peer's own seed so that peers see different orders."""

    def __post_init__(self):
        if not isinstance(self.dataset, str) or not self.dataset.strip():
            raise ValueError(f"dataset must be {_SOURCE_HELP}; got {self.dataset!r}")
        source = _resolve_source(self.dataset)  # raises for a missing local path
        if self.dataset_config is not None and source.kind != "hub":
            raise ValueError(
                f"dataset_config={self.dataset_config!r} applies only to Hugging Face dataset names, "
                f"not to {self.dataset!r}; drop it"
            )
        for name in ("text_column", "train_split", "validation_split", "tokenizer"):
            if not getattr(self, name):
                raise ValueError(f"{name} must be a non-empty string")
        if self.text_sample_by not in _TEXT_SAMPLE_BY:
            raise ValueError(f"text_sample_by must be one of {_TEXT_SAMPLE_BY}; got {self.text_sample_by!r}")
        if self.max_sequence_length < 1:
            raise ValueError(
                f"max_sequence_length must be a positive number of tokens (e.g. 128); got {self.max_sequence_length}"
            )
        start = self.seq_warmup_start_length
        if start < 0 or (0 < start < self.max_sequence_length and start % _SEQ_MULTIPLE):
            raise ValueError(
                f"seq_warmup_start_length must be a positive multiple of {_SEQ_MULTIPLE} below "
                f"max_sequence_length={self.max_sequence_length}, or 0 to disable warm-up; got {start}"
            )
        if self.seq_warmup_epochs < 0:
            raise ValueError(f"seq_warmup_epochs must be >= 0 (0 disables warm-up); got {self.seq_warmup_epochs}")
        if self.shuffle_buffer_size < 1:
            raise ValueError(f"shuffle_buffer_size must be >= 1; got {self.shuffle_buffer_size}")
        if self.max_validation_blocks < 1:
            raise ValueError(f"max_validation_blocks must be >= 1; got {self.max_validation_blocks}")
        if self.seed < 0:
            raise ValueError(f"seed must be >= 0; got {self.seed}")

    @property
    def is_streaming(self) -> bool:
        """Whether the dataset is streamed (see ``streaming``)."""
        if self.streaming is not None:
            return self.streaming
        return _resolve_source(self.dataset).kind != "shipped"


# ----------------------------------------------------------------------------------------------
# Sources


@dataclass(frozen=True)
class _Source:
    kind: str  # "shipped", "files" (file or glob), "folder" or "hub"
    builder: str | None = None  # load_dataset builder for shipped/files/folder
    files: tuple[Path, ...] = ()  # resolved files for shipped/files


def _builder_for(path: Path) -> str | None:
    suffixes = [s.lower() for s in path.suffixes]
    if suffixes and suffixes[-1] in _COMPRESSION_SUFFIXES:
        suffixes = suffixes[:-1]
    return _BUILDERS.get(suffixes[-1]) if suffixes else None


def _single_builder(files: Iterable[Path], where: str) -> str:
    builders = {_builder_for(f) for f in files} - {None}
    if not builders:
        raise FileNotFoundError(
            f"no .txt/.json/.jsonl/.parquet files in {where}; point dataset at such files or use dataset='shipped'"
        )
    if len(builders) > 1:
        raise ValueError(
            f"{where} mixes file types ({', '.join(sorted(builders))}); "
            f"use one type of file per dataset, e.g. a glob such as 'data/*.jsonl'"
        )
    return builders.pop()


def _looks_like_path(dataset: str) -> bool:
    return dataset.startswith(("/", ".", "~")) or _builder_for(Path(dataset)) is not None


def _resolve_source(dataset: str) -> _Source:
    """Classify ``dataset``; a name that is no existing path and does not look like one is a Hub name."""
    if dataset == SHIPPED:
        files = (shipped_corpus_dir() / "train.txt", shipped_corpus_dir() / "validation.txt")
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise FileNotFoundError(
                f"the shipped corpus is missing {missing}; reinstall leanhive or rebuild it "
                f"with scripts/build_assets.py"
            )
        return _Source("shipped", "text", files)
    path = Path(dataset).expanduser()
    if path.is_file():
        return _Source("files", _single_builder([path], str(path)), (path,))
    if path.is_dir():
        visible = [
            p
            for p in path.rglob("*")
            if p.is_file() and not any(part.startswith((".", "__")) for part in p.relative_to(path).parts)
        ]
        return _Source("folder", _single_builder(visible, f"folder {path}"))
    if glob.has_magic(dataset):
        matches = sorted(Path(p) for p in glob.glob(str(path), recursive=True) if Path(p).is_file())
        if not matches:
            raise FileNotFoundError(f"no file matches {dataset!r}; check the pattern (e.g. 'data/*.jsonl')")
        return _Source("files", _single_builder(matches, f"files matching {dataset!r}"), tuple(matches))
    if _looks_like_path(dataset):
        raise FileNotFoundError(
            f"dataset {dataset!r} looks like a local path but does not exist; "
            f"pass an existing file, folder or glob, or use dataset='shipped'"
        )
    return _Source("hub")


def _load_dataset_call(args: DataArguments, split: str) -> tuple[tuple, dict]:
    """The ``load_dataset`` positional and keyword arguments that read ``split`` of ``args.dataset``."""
    source = _resolve_source(args.dataset)
    kwargs = {"split": split, "streaming": args.is_streaming}
    if source.builder == "text":
        kwargs["sample_by"] = args.text_sample_by
    if source.kind == "shipped":
        train_file, validation_file = source.files
        files = {args.train_split: train_file, args.validation_split: validation_file}
        if split not in files:
            raise ValueError(f"the shipped corpus has no split {split!r}; its splits are {list(files)}")
        return ("text",), {**kwargs, "data_files": {split: str(files[split])}}
    if source.kind == "files":
        if split != args.train_split:
            raise ValueError(
                f"{args.dataset!r} is one split ({args.train_split!r}), it has no split {split!r}; "
                f"for a validation split put the files in a folder as train.* and validation.* "
                f"and pass the folder as dataset"
            )
        return (source.builder,), {**kwargs, "data_files": {split: [str(f) for f in source.files]}}
    # A folder and a Hub name take the same call: datasets infers the splits from the file names.
    path = str(Path(args.dataset).expanduser()) if source.kind == "folder" else args.dataset
    return (path, args.dataset_config), kwargs


def _load_raw_split(args: DataArguments, split: str):
    """``datasets.load_dataset`` for one split of any source, with errors that say how to fix the input."""
    import datasets

    positional, kwargs = _load_dataset_call(args, split)
    try:
        return datasets.load_dataset(*positional, **kwargs)
    except ConnectionError as error:
        raise ConnectionError(
            f"could not reach the Hugging Face Hub for dataset {args.dataset!r}: a Hub dataset "
            f"needs network access. Offline, pass a local path (file, folder or glob of "
            f".txt/.json/.jsonl/.parquet) or dataset='shipped'"
        ) from error
    except datasets.exceptions.DatasetNotFoundError as error:
        raise FileNotFoundError(
            f"dataset {args.dataset!r} is neither a local path nor a dataset on the Hugging "
            f"Face Hub; dataset must be {_SOURCE_HELP}"
        ) from error
    except ValueError as error:
        if "split" not in str(error).lower():
            raise
        raise ValueError(
            f"dataset {args.dataset!r} has no split {split!r} ({error}); set "
            f"train_split/validation_split to one of its splits"
        ) from error


# ----------------------------------------------------------------------------------------------
# Tokenizer


def load_tokenizer(args: DataArguments):
    """Load ``args.tokenizer`` with ``AutoTokenizer``; it must have an eos (or sep) token to mark document ends."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    except (OSError, ValueError) as error:
        raise OSError(
            f"could not load tokenizer {args.tokenizer!r} ({error}); pass a local tokenizer folder or a "
            f"Hugging Face name (needs network). The shipped one is {shipped_tokenizer_dir()}"
        ) from error
    _document_separator_id(tokenizer)  # fail now rather than mid-training
    return tokenizer


def check_tokenizer_fits(tokenizer, vocab_size: int) -> None:
    """Every token id must have an embedding row: ValueError (saying which flags to fix) otherwise."""
    if len(tokenizer) > vocab_size:
        raise ValueError(
            f"the tokenizer {tokenizer.name_or_path!r} has {len(tokenizer)} tokens but the model's "
            f"vocab_size is {vocab_size}; use the --tokenizer the run was made for, or a "
            f"--model_config with vocab_size >= {len(tokenizer)}"
        )


def _document_separator_id(tokenizer) -> int:
    for token_id in (tokenizer.eos_token_id, tokenizer.sep_token_id):
        if token_id is not None:
            return token_id
    raise ValueError(
        f"tokenizer {tokenizer.name_or_path!r} has neither an eos nor a sep token to separate "
        f"documents; use a tokenizer that has one, e.g. the shipped tokenizer"
    )


# ----------------------------------------------------------------------------------------------
# Tokenization and packing


def _column_names(raw) -> list[str]:
    if raw.column_names is not None:
        return list(raw.column_names)
    first = next(iter(raw), None)  # a streamed dataset may not know its columns before reading
    return list(first) if first is not None else []


def _tokenize(raw, args: DataArguments, tokenizer):
    """Rows of ``{"input_ids": document tokens + [eos]}``; empty documents are dropped."""
    columns = _column_names(raw)
    if args.text_column not in columns:
        raise ValueError(
            f"text column {args.text_column!r} not found in dataset {args.dataset!r}; available "
            f"columns: {columns}. Pass text_column=<one of them>"
        )
    separator = _document_separator_id(tokenizer)
    column = args.text_column

    def tokenize_batch(batch):
        texts = []
        for text in batch[column]:
            if text is not None and not isinstance(text, str):
                raise TypeError(
                    f"column {column!r} holds {type(text).__name__} values, not text; "
                    f"set text_column to a column of strings"
                )
            if text and text.strip():
                texts.append(text.strip())
        if not texts:  # a fast tokenizer fails on an empty batch
            return {"input_ids": []}
        encoded = tokenizer(texts, add_special_tokens=False, verbose=False)["input_ids"]
        return {"input_ids": [ids + [separator] for ids in encoded]}

    if args.is_streaming:
        return raw.map(tokenize_batch, batched=True, remove_columns=columns)
    started = time.perf_counter()
    logger.info("tokenizing %d documents of %r", len(raw), args.dataset)
    tokenized = raw.map(tokenize_batch, batched=True, remove_columns=columns, desc="Tokenizing")
    logger.info("tokenized %d documents in %.1f s", len(tokenized), time.perf_counter() - started)
    return tokenized


def _derive_seed(*parts: int) -> int:
    """A well-mixed 32-bit seed from several integers (any sign, any size)."""
    return int(np.random.SeedSequence([int(p) % 2**64 for p in parts]).generate_state(1)[0])


def _documents_in_order(
    tokenized, *, seed: int | None, epoch: int, buffer_size: int, progress_label: str
) -> Iterator[list[int]]:
    """Token lists of one pass; shuffled with (seed, epoch) unless seed is None; logs progress on long passes."""
    import datasets

    if seed is not None:
        if isinstance(tokenized, datasets.IterableDataset):
            tokenized = tokenized.shuffle(seed=seed, buffer_size=buffer_size)
            tokenized.set_epoch(epoch)  # datasets reshuffles with seed + epoch
        else:
            tokenized = tokenized.shuffle(seed=_derive_seed(seed, epoch), keep_in_memory=True)
    n_documents = n_tokens = 0
    last_log = time.perf_counter()
    for batch in tokenized.iter(batch_size=256):
        for ids in batch["input_ids"]:
            n_documents += 1
            n_tokens += len(ids)
            yield ids
        if time.perf_counter() - last_log > _LOG_INTERVAL_S:
            last_log = time.perf_counter()
            logger.info("%s: tokenized %d documents, %d tokens so far", progress_label, n_documents, n_tokens)
    if n_documents == 0:
        raise ValueError(
            f"{progress_label}: the dataset has no non-empty document; check the dataset path, "
            f"its split and text_column"
        )
    logger.info("%s: %d documents, %d tokens", progress_label, n_documents, n_tokens)


def _pack(documents: Iterable[list[int]], block_length: int, leftover: list[int]) -> Iterator[torch.Tensor]:
    """Concatenate documents and cut blocks of ``block_length``; the tail stays in ``leftover`` (mutated)."""
    for ids in documents:
        leftover.extend(ids)
        n_blocks = len(leftover) // block_length
        if n_blocks:
            blocks = torch.tensor(leftover[: n_blocks * block_length], dtype=torch.long).view(n_blocks, block_length)
            del leftover[: n_blocks * block_length]
            yield from blocks


class PackedTrainStream:
    """Infinite iterable of ``{"input_ids": LongTensor[max_sequence_length]}``.

    Each pass over the data is shuffled with a seed derived from (args.seed, peer_seed, pass number);
    the tokens left over at the end of a pass start the first block of the next one. Iterating again
    starts over from pass 0, so the order is reproducible for a given seed.
    """

    def __init__(self, tokenized, args: DataArguments, *, peer_seed: int):
        self._tokenized = tokenized
        self._args = args
        self.seed = _derive_seed(args.seed, peer_seed)

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        leftover: list[int] = []
        for epoch in itertools.count():
            documents = _documents_in_order(
                self._tokenized,
                seed=self.seed,
                epoch=epoch,
                buffer_size=self._args.shuffle_buffer_size,
                progress_label=f"{self._args.dataset!r} {self._args.train_split} pass {epoch}",
            )
            for block in _pack(documents, self._args.max_sequence_length, leftover):
                yield {"input_ids": block}


def build_train_dataset(args: DataArguments, tokenizer, *, peer_seed: int) -> PackedTrainStream:
    """The infinite, per-peer shuffled stream of packed training blocks (see ``PackedTrainStream``)."""
    raw = _load_raw_split(args, args.train_split)
    return PackedTrainStream(_tokenize(raw, args, tokenizer), args, peer_seed=peer_seed)


def build_validation_dataset(args: DataArguments, tokenizer) -> list[dict[str, torch.Tensor]]:
    """Deterministic validation blocks in file order: at most ``max_validation_blocks``, the partial tail dropped."""
    tokenized = _tokenize(_load_raw_split(args, args.validation_split), args, tokenizer)
    documents = _documents_in_order(
        tokenized, seed=None, epoch=0, buffer_size=0, progress_label=f"{args.dataset!r} {args.validation_split}"
    )
    blocks = _pack(documents, args.max_sequence_length, leftover=[])
    validation = [{"input_ids": block} for block in itertools.islice(blocks, args.max_validation_blocks)]
    if not validation:
        raise ValueError(
            f"validation split {args.validation_split!r} of {args.dataset!r} has fewer tokens than "
            f"one block of max_sequence_length={args.max_sequence_length}"
        )
    return validation


# ----------------------------------------------------------------------------------------------
# Sequence-length warm-up and batching


class SequenceLengthSchedule:
    """Sequence length per global epoch: linear from the start length to the maximum, in multiples of 8."""

    def __init__(self, args: DataArguments):
        self.max_length = args.max_sequence_length
        self.start_length = args.seq_warmup_start_length
        self.warmup_epochs = args.seq_warmup_epochs

    @property
    def enabled(self) -> bool:
        return 0 < self.start_length < self.max_length and self.warmup_epochs > 0

    def length_at(self, global_epoch: int) -> int:
        if not self.enabled or global_epoch >= self.warmup_epochs:
            return self.max_length
        progress = max(global_epoch, 0) / self.warmup_epochs
        length = self.start_length + progress * (self.max_length - self.start_length)
        return max(self.start_length, int(length) // _SEQ_MULTIPLE * _SEQ_MULTIPLE)


def make_batches(
    stream: Iterable[dict[str, torch.Tensor]], batch_size: int, seq_len: int | Callable[[], int]
) -> Iterator[dict[str, torch.Tensor]]:
    """Cut a stream of packed blocks into ``{"input_ids": LongTensor[batch_size, seq_len]}``.

    Blocks are consecutive pieces of one token stream, so rows are cut across block boundaries and
    no token is dropped. ``seq_len`` may be a callable (e.g. ``lambda: schedule.length_at(epoch)``),
    read before each batch, so one generator can follow the warm-up for a whole run. Only the tail of
    a finite stream too short for a full batch is not yielded.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1; got {batch_size}")
    blocks = iter(stream)
    pending = torch.empty(0, dtype=torch.long)
    while True:
        length = seq_len() if callable(seq_len) else seq_len
        if length < 1:
            raise ValueError(f"seq_len must be >= 1; got {length}")
        needed = batch_size * length
        parts, available = [pending], pending.numel()
        while available < needed:
            block = next(blocks, None)
            if block is None:
                return
            block = block["input_ids"].reshape(-1)
            parts.append(block)
            available += block.numel()
        tokens = torch.cat(parts) if len(parts) > 1 else pending
        yield {"input_ids": tokens[:needed].view(batch_size, length)}
        pending = tokens[needed:]
