"""Data pipeline: shipped corpus and tokenizer, packing, per-peer shuffling, warm-up, sources, errors."""

import collections
import itertools
import json

import datasets
import huggingface_hub
import pytest
import torch
from transformers import AutoTokenizer

from peer.swarm import data
from peer.swarm.data import DataArguments, SequenceLengthSchedule, make_batches

pytestmark = pytest.mark.deps  # scripts/test.sh --newest/--oldest run these


@pytest.fixture(scope="module")
def tokenizer():
    return data.load_tokenizer(DataArguments())


def _documents(path):
    """The documents of a corpus file, read independently of the pipeline (blank-line separated)."""
    return [doc.strip() for doc in path.read_text(encoding="utf-8").split("\n\n") if doc.strip()]


def _reference_tokens(tokenizer, documents):
    tokens = []
    for document in documents:
        tokens += tokenizer(document, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    return tokens


def _split_at_eos(tokens, eos):
    documents, current = [], []
    for token in tokens:
        current.append(token)
        if token == eos:
            documents.append(tuple(current))
            current = []
    return documents


def _flat(blocks):
    return torch.cat([block["input_ids"] for block in blocks]).tolist()


# ---------------------------------------------------------------------------------------------
# Shipped assets


def test_shipped_tokenizer_loads_with_autotokenizer_and_round_trips():
    tokenizer = AutoTokenizer.from_pretrained(str(data.shipped_tokenizer_dir()))
    assert len(tokenizer) == 4096
    for name in ("bos", "eos", "pad", "unk", "mask", "cls", "sep"):
        assert getattr(tokenizer, f"{name}_token_id") is not None, name
    assert tokenizer.mask_token == "[MASK]" and tokenizer.cls_token == "[CLS]" and tokenizer.sep_token == "[SEP]"
    text = "SQLite is a C library.\n  Unicode too: café → naïve, 3.14 ± 0.01, 東京\ttab"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids) == text
    # Trained on the corpus: common English is compressed well below one token per character.
    assert len(tokenizer("The database file is locked by another connection.")["input_ids"]) < 15


def test_shipped_corpus_splits_are_disjoint_and_licensed():
    corpus = data.shipped_corpus_dir()
    train, validation = corpus / "train.txt", corpus / "validation.txt"
    total = train.stat().st_size + validation.stat().st_size
    assert 1_000_000 < total < 3_000_000
    assert 0.02 < validation.stat().st_size / total < 0.10
    train_paragraphs = set(train.read_text(encoding="utf-8").splitlines()) - {""}
    validation_paragraphs = set(validation.read_text(encoding="utf-8").splitlines()) - {""}
    assert len(validation_paragraphs) > 100
    assert not train_paragraphs & validation_paragraphs
    readme = (corpus / "README.md").read_text(encoding="utf-8")
    assert "public domain" in readme and "sqlite3-doc" in readme and "License" in readme


# ---------------------------------------------------------------------------------------------
# Packing and shuffling


def test_validation_blocks_are_the_direct_tokenization_of_the_shipped_documents(tokenizer):
    args = DataArguments()
    blocks = data.build_validation_dataset(args, tokenizer)
    assert all(block["input_ids"].shape == (args.max_sequence_length,) for block in blocks)
    assert all(block["input_ids"].dtype == torch.long for block in blocks)
    reference = _reference_tokens(tokenizer, _documents(data.shipped_corpus_dir() / "validation.txt"))
    # Every full block is kept; only the tail shorter than one block is dropped.
    assert len(blocks) == len(reference) // args.max_sequence_length
    assert _flat(blocks) == reference[: len(blocks) * args.max_sequence_length]
    assert data.build_validation_dataset(args, tokenizer)[5]["input_ids"].equal(blocks[5]["input_ids"])


@pytest.mark.parametrize("streaming", [False, True])
def test_train_stream_packs_every_document_once_per_pass_and_reshuffles(tmp_path, tokenizer, streaming):
    documents = [f"Document {i} says {'word ' * (i % 7)}and ends." for i in range(40)]
    path = tmp_path / "docs.txt"
    path.write_text("\n\n".join(documents) + "\n", encoding="utf-8")
    args = DataArguments(dataset=str(path), max_sequence_length=24, streaming=streaming, shuffle_buffer_size=64)
    reference = collections.Counter(_split_at_eos(_reference_tokens(tokenizer, documents), tokenizer.eos_token_id))
    per_pass = sum(len(doc) * count for doc, count in reference.items())

    stream = data.build_train_dataset(args, tokenizer, peer_seed=7)
    n_blocks = 3 * per_pass // args.max_sequence_length
    tokens = _flat(itertools.islice(stream, n_blocks))  # blocks cross document and pass boundaries
    first_pass = _split_at_eos(tokens[:per_pass], tokenizer.eos_token_id)
    second_pass = _split_at_eos(tokens[per_pass : 2 * per_pass], tokenizer.eos_token_id)
    assert collections.Counter(first_pass) == reference
    assert collections.Counter(second_pass) == reference
    assert first_pass != second_pass, "each pass must be reshuffled"


def test_peer_seeds_give_different_orders_and_the_same_seed_the_same_order(tokenizer):
    args = DataArguments()

    def first_blocks(peer_seed, n=20):
        return torch.stack(
            [
                b["input_ids"]
                for b in itertools.islice(data.build_train_dataset(args, tokenizer, peer_seed=peer_seed), n)
            ]
        )

    peer_a = first_blocks(0)
    assert torch.equal(peer_a, first_blocks(0))
    assert not torch.equal(peer_a, first_blocks(1))
    other_base = DataArguments(seed=1)
    stream = data.build_train_dataset(other_base, tokenizer, peer_seed=0)
    assert not torch.equal(peer_a, torch.stack([b["input_ids"] for b in itertools.islice(stream, 20)]))


# ---------------------------------------------------------------------------------------------
# Sequence-length warm-up and batching


def test_sequence_length_schedule_grows_linearly_in_multiples_of_8_and_caps():
    schedule = SequenceLengthSchedule(
        DataArguments(max_sequence_length=128, seq_warmup_start_length=32, seq_warmup_epochs=100)
    )
    assert schedule.enabled
    lengths = [schedule.length_at(epoch) for epoch in range(0, 130)]
    assert lengths[0] == 32 and schedule.length_at(50) == 80 and lengths[100] == 128
    assert all(length % 8 == 0 for length in lengths)
    assert lengths == sorted(lengths) and max(lengths) == 128 and schedule.length_at(10**6) == 128
    assert len(set(lengths)) == (128 - 32) // 8 + 1  # every multiple of 8 on the way is used


@pytest.mark.parametrize(
    "overrides",
    [
        dict(seq_warmup_start_length=0),
        dict(seq_warmup_start_length=128),
        dict(seq_warmup_start_length=512),
        dict(seq_warmup_epochs=0),
    ],
)
def test_sequence_length_schedule_disabled(overrides):
    schedule = SequenceLengthSchedule(DataArguments(max_sequence_length=128, **overrides))
    assert not schedule.enabled
    assert {schedule.length_at(epoch) for epoch in (0, 1, 50, 1000)} == {128}


def test_make_batches_reshapes_blocks_to_the_current_length_without_dropping_tokens():
    blocks = [{"input_ids": torch.arange(i * 128, (i + 1) * 128)} for i in range(20)]
    wanted = [32, 32, 48, 48, 120, 128, 8]
    lengths = iter(wanted)
    # A callable length is read before each batch, as a trainer following the warm-up would pass it.
    batches = list(itertools.islice(make_batches(blocks, 3, lambda: next(lengths)), len(wanted)))
    assert [b["input_ids"].shape for b in batches] == [(3, n) for n in (32, 32, 48, 48, 120, 128, 8)]
    flat = torch.cat([b["input_ids"].reshape(-1) for b in batches])
    assert torch.equal(flat, torch.arange(flat.numel()))  # contiguous: nothing skipped or repeated
    # A fixed length that does not divide the block length works too.
    fixed = list(make_batches(blocks, 2, 40))
    assert len(fixed) == 20 * 128 // 80
    assert torch.equal(torch.cat([b["input_ids"].reshape(-1) for b in fixed]), torch.arange(len(fixed) * 80))


def make_mlm_batch(
    input_ids: torch.Tensor,
    tokenizer,
    mlm_probability: float = 0.15,
    generator: torch.Generator | None = None,
    sentence_order: bool = True,
) -> dict[str, torch.Tensor]:
    """Masked-LM and sentence-order-prediction inputs from packed rows ``[batch, seq]``.

    Sentence order (ALBERT): each row is cut in two halves that are swapped with probability 0.5;
    ``sentence_order_label`` is 1 where swapped and ``token_type_ids`` mark the second half.
    Masking (BERT): ``mlm_probability`` of the non-special tokens are selected; of those 80% become
    [MASK], 10% a random token and 10% stay. ``labels`` holds the original id there and -100 elsewhere.
    """
    if not 0.0 < mlm_probability < 1.0:
        raise ValueError(f"mlm_probability must be in (0, 1), e.g. 0.15; got {mlm_probability}")
    if tokenizer.mask_token_id is None:
        raise ValueError(
            f"tokenizer {tokenizer.name_or_path!r} has no mask token; the MLM head needs one "
            f"(the shipped tokenizer has [MASK])"
        )
    batch, length = input_ids.shape
    input_ids = input_ids.clone()
    out: dict[str, torch.Tensor] = {}
    if sentence_order:
        first = length // 2
        swapped = torch.rand(batch, generator=generator) < 0.5
        input_ids[swapped] = torch.cat([input_ids[swapped, first:], input_ids[swapped, :first]], dim=1)
        # After a swap the first segment is the original second half, of length - first tokens.
        boundary = torch.where(swapped, length - first, first)
        out["token_type_ids"] = (torch.arange(length).unsqueeze(0) >= boundary.unsqueeze(1)).long()
        out["sentence_order_label"] = swapped.long()

    special_ids = torch.tensor(sorted(set(tokenizer.all_special_ids)), dtype=torch.long)
    maskable = ~torch.isin(input_ids, special_ids)
    selected = (torch.rand(input_ids.shape, generator=generator) < mlm_probability) & maskable
    labels = torch.where(selected, input_ids, torch.full_like(input_ids, -100))
    action = torch.rand(input_ids.shape, generator=generator)
    to_mask = selected & (action < 0.8)
    to_random = selected & (action >= 0.8) & (action < 0.9)
    allowed = torch.ones(len(tokenizer), dtype=torch.bool)
    allowed[special_ids[special_ids < len(tokenizer)]] = False
    candidates = allowed.nonzero().squeeze(1)
    random_ids = candidates[torch.randint(len(candidates), input_ids.shape, generator=generator)]
    input_ids = torch.where(to_mask, torch.full_like(input_ids, tokenizer.mask_token_id), input_ids)
    input_ids = torch.where(to_random, random_ids, input_ids)
    return {"input_ids": input_ids, "labels": labels, **out}


def test_make_mlm_batch_masks_like_albert(tokenizer):
    generator = torch.Generator().manual_seed(0)
    rows = torch.randint(7, len(tokenizer), (16, 64), generator=generator)
    rows[:, 10] = tokenizer.eos_token_id
    batch = make_mlm_batch(rows, tokenizer, 0.15, generator)
    assert set(batch) == {"input_ids", "labels", "token_type_ids", "sentence_order_label"}
    swapped = batch["sentence_order_label"].bool()
    assert 0 < swapped.sum() < 16
    reordered = torch.where(swapped[:, None], torch.cat([rows[:, 32:], rows[:, :32]], dim=1), rows)
    selected = batch["labels"] != -100
    assert torch.equal(batch["labels"][selected], reordered[selected])
    assert torch.equal(batch["input_ids"][~selected], reordered[~selected])
    assert not selected[reordered == tokenizer.eos_token_id].any()  # special tokens are never masked
    assert 0.10 < selected.float().mean() < 0.20
    masked = batch["input_ids"][selected] == tokenizer.mask_token_id
    assert 0.65 < masked.float().mean() < 0.95
    assert torch.equal(batch["token_type_ids"][:, 0], torch.zeros(16, dtype=torch.long))
    assert torch.equal(batch["token_type_ids"][:, -1], torch.ones(16, dtype=torch.long))


# ---------------------------------------------------------------------------------------------
# Other sources: local files, folders (the same load_dataset call as a Hub name)


def test_local_txt_and_jsonl_with_custom_text_column(tmp_path, tokenizer):
    (tmp_path / "notes.txt").write_text("Alpha paragraph one.\n\nBeta paragraph two.\n", encoding="utf-8")
    with open(tmp_path / "rows.jsonl", "w", encoding="utf-8") as f:
        for i in range(5):
            f.write(json.dumps({"id": i, "body": f"Row {i} of the json lines file."}) + "\n")
    txt_args = DataArguments(dataset=str(tmp_path / "notes.txt"), max_sequence_length=8)
    txt_tokens = _flat(itertools.islice(data.build_train_dataset(txt_args, tokenizer, peer_seed=0), 6))
    assert set(_split_at_eos(txt_tokens[:20], tokenizer.eos_token_id)) <= set(
        _split_at_eos(
            _reference_tokens(tokenizer, ["Alpha paragraph one.", "Beta paragraph two."]), tokenizer.eos_token_id
        )
    )

    jsonl_args = DataArguments(dataset=str(tmp_path / "*.jsonl"), text_column="body", max_sequence_length=8)
    stream = data.build_train_dataset(jsonl_args, tokenizer, peer_seed=0)
    text = tokenizer.decode(_flat(itertools.islice(stream, 12)))
    assert "of the json lines file." in text and "id" not in text


def test_folder_dataset_is_loaded_like_a_hub_name_streamed(tmp_path, tokenizer):
    folder = tmp_path / "corpus"
    folder.mkdir()
    for split, n in (("train", 30), ("validation", 12)):
        with open(folder / f"{split}.jsonl", "w", encoding="utf-8") as f:
            for i in range(n):
                f.write(json.dumps({"content": f"{split} document {i} about tables and indexes."}) + "\n")
    args = DataArguments(dataset=str(folder), text_column="content", max_sequence_length=16)
    assert args.is_streaming
    raw = data._load_raw_split(args, "train")
    assert isinstance(raw, datasets.IterableDataset)
    train_text = tokenizer.decode(_flat(itertools.islice(data.build_train_dataset(args, tokenizer, peer_seed=1), 8)))
    assert "train document" in train_text and "validation" not in train_text
    validation = data.build_validation_dataset(args, tokenizer)
    expected = _reference_tokens(tokenizer, [f"validation document {i} about tables and indexes." for i in range(12)])
    assert _flat(validation) == expected[: len(validation) * 16]


# ---------------------------------------------------------------------------------------------
# Errors that say how to fix the input


@pytest.mark.parametrize(
    "overrides, error, match",
    [
        (dict(dataset="/no/such/corpus.txt"), FileNotFoundError, "does not exist"),
        (dict(dataset="./missing_folder"), FileNotFoundError, "does not exist"),
        (dict(dataset="/no/such/dir/*.jsonl"), FileNotFoundError, "no file matches"),
        (dict(dataset=""), ValueError, "shipped"),
        (dict(dataset_config="wikitext-2-raw-v1"), ValueError, "only to Hugging Face dataset names"),
        (dict(seq_warmup_start_length=20), ValueError, "multiple of 8"),
        (dict(seq_warmup_epochs=-1), ValueError, "seq_warmup_epochs"),
        (dict(max_sequence_length=0), ValueError, "max_sequence_length"),
        (dict(text_sample_by="sentence"), ValueError, "paragraph"),
        (dict(shuffle_buffer_size=0), ValueError, "shuffle_buffer_size"),
    ],
)
def test_bad_arguments_are_rejected_with_a_fix(overrides, error, match):
    with pytest.raises(error, match=match):
        DataArguments(**overrides)


def test_mixed_file_types_and_empty_folder(tmp_path):
    (tmp_path / "a.txt").write_text("some text here\n")
    (tmp_path / "b.jsonl").write_text('{"text": "x"}\n')
    with pytest.raises(ValueError, match="mixes file types"):
        DataArguments(dataset=str(tmp_path))
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match=r"no \.txt/\.json/\.jsonl/\.parquet files"):
        DataArguments(dataset=str(tmp_path / "empty"))


def test_unknown_text_column_lists_the_available_columns(tmp_path, tokenizer):
    path = tmp_path / "rows.jsonl"
    path.write_text('{"body": "hello there", "id": 1}\n', encoding="utf-8")
    args = DataArguments(dataset=str(path))
    with pytest.raises(ValueError, match=r"text column 'text' not found.*\['body', 'id'\].*text_column"):
        data.build_train_dataset(args, tokenizer, peer_seed=0)


def test_single_file_has_no_validation_split(tmp_path, tokenizer):
    path = tmp_path / "only.txt"
    path.write_text("just training text\n", encoding="utf-8")
    with pytest.raises(ValueError, match="validation.*folder"):
        data.build_validation_dataset(DataArguments(dataset=str(path)), tokenizer)


def test_empty_dataset_is_reported(tmp_path, tokenizer):
    path = tmp_path / "blank.txt"
    path.write_text("\n\n   \n\n", encoding="utf-8")
    stream = data.build_train_dataset(DataArguments(dataset=str(path)), tokenizer, peer_seed=0)
    with pytest.raises(ValueError, match="no non-empty document"):
        next(iter(stream))


@pytest.fixture
def hub_offline(monkeypatch):
    """The Hub is the one thing mocked: offline mode makes any Hub request fail at once."""
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)


def test_hub_dataset_offline_says_it_needs_network_or_a_local_path(hub_offline, tokenizer):
    args = DataArguments(dataset="someone/some_corpus")
    with pytest.raises(ConnectionError, match="needs network access.*local path"):
        data.build_train_dataset(args, tokenizer, peer_seed=0)


def test_unloadable_tokenizer_points_to_the_shipped_one(tmp_path):
    with pytest.raises(OSError, match="could not load tokenizer.*shipped one"):
        data.load_tokenizer(DataArguments(tokenizer=str(tmp_path / "no_tokenizer_here")))
