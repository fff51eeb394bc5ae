"""Rebuild the shipped corpus and tokenizer under ``peer/assets/`` deterministically.

The corpus is the SQLite documentation (public domain) from Debian's ``sqlite3-doc`` package::

    cd /tmp && apt-get download sqlite3-doc && dpkg -x sqlite3-doc_*.deb sqlite3-doc
    python scripts/build_assets.py /tmp/sqlite3-doc          # corpus + tokenizer
    python scripts/build_assets.py                           # tokenizer only, from the shipped corpus

Running it twice gives byte-identical files.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import html.parser
import json
import logging
import re
import sys
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger("build_assets")

ASSETS = Path(__file__).resolve().parent.parent / "peer" / "assets"
DOC_SUBDIR = Path("usr/share/doc/sqlite3")
COPYRIGHT_FILE = Path("usr/share/doc/sqlite3-doc/copyright")

# Pages that are indexes, changelogs, generated requirement lists or duplicates, not prose.
EXCLUDED_PAGES = frozenset(
    {
        "capi3ref.html",  # the C API reference, one long generated list
        "changes.html",
        "chronology.html",
        "doc_backlink_crossref.html",
        "doc_keyword_crossref.html",
        "doc_pagelink_crossref.html",
        "fileformat.html",  # identical to fileformat2.html
        "oldnews.html",
        "opcode.html",
        "requirements.html",
        "syntaxdiagrams.html",
    }
)
MIN_WORDS_PER_PARAGRAPH = 8  # shorter blocks are menus, headings and table cells
MIN_CHARS_PER_DOCUMENT = 200
BOILERPLATE_PREFIXES = ("This page last modified", "See also:")
VALIDATION_FRACTION = 0.05

# Tokenizer: small vocabulary so the tiny model stays tiny; specials serve both the causal-LM
# (bos/eos/pad) and the ALBERT-style MLM head ([MASK]/[CLS]/[SEP]).
VOCAB_SIZE = 4096
SPECIAL_TOKENS = {
    "unk_token": "<unk>",
    "bos_token": "<s>",
    "eos_token": "</s>",
    "pad_token": "<pad>",
    "mask_token": "[MASK]",
    "cls_token": "[CLS]",
    "sep_token": "[SEP]",
}

_BLOCK_TAGS = frozenset(
    {
        "p",
        "h1",
        "h2",
        "h3",
        "h4",
        "h5",
        "li",
        "dd",
        "dt",
        "blockquote",
        "div",
        "td",
        "th",
        "tr",
        "table",
        "ul",
        "ol",
        "br",
        "hr",
    }
)
_SKIPPED_TAGS = frozenset({"script", "style", "svg", "pre", "head", "title", "noscript"})


class _ParagraphExtractor(html.parser.HTMLParser):
    """Collects the text of block elements, skipping code, diagrams and tables of contents."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.blocks: list[str] = []
        self._current: list[str] = []
        self._skip_depth = 0
        self._div_is_toc: list[bool] = []

    def _flush(self):
        text = re.sub(r"\s+", " ", "".join(self._current)).strip()
        if text:
            self.blocks.append(text)
        self._current = []

    def handle_starttag(self, tag, attrs):
        if tag == "div":
            is_toc = "toc" in (dict(attrs).get("class") or "")
            self._div_is_toc.append(is_toc)
            self._skip_depth += is_toc
        if tag in _SKIPPED_TAGS:
            self._skip_depth += 1
        if tag in _BLOCK_TAGS or tag in _SKIPPED_TAGS:
            self._flush()

    def handle_endtag(self, tag):
        if tag == "div" and self._div_is_toc:
            self._skip_depth -= self._div_is_toc.pop()
        if tag in _SKIPPED_TAGS:
            self._skip_depth = max(0, self._skip_depth - 1)
        if tag in _BLOCK_TAGS or tag in _SKIPPED_TAGS:
            self._flush()

    def handle_data(self, data):
        if not self._skip_depth:
            self._current.append(data)

    def close(self):
        super().close()
        self._flush()  # text after the last block tag


def _is_prose(paragraph: str) -> bool:
    return len(paragraph.split()) >= MIN_WORDS_PER_PARAGRAPH and not paragraph.startswith(BOILERPLATE_PREFIXES)


@dataclass
class Document:
    name: str
    paragraphs: list[str]

    @property
    def text(self) -> str:
        return "\n".join(self.paragraphs)


def extract_documents(package_root: Path) -> list[Document]:
    """One document per top-level HTML page, in file-name order, paragraphs deduplicated globally."""
    doc_dir = package_root / DOC_SUBDIR
    pages = sorted(doc_dir.glob("*.html"))
    if not pages:
        raise SystemExit(f"no HTML pages under {doc_dir}; pass the folder that `dpkg -x sqlite3-doc_*.deb DIR` created")
    seen: set[str] = set()
    documents = []
    for page in pages:
        if page.name in EXCLUDED_PAGES:
            continue
        parser = _ParagraphExtractor()
        parser.feed(page.read_text(encoding="utf-8", errors="replace"))
        parser.close()
        paragraphs = []
        for block in parser.blocks:
            if _is_prose(block) and block not in seen:
                seen.add(block)
                paragraphs.append(block)
        document = Document(page.name, paragraphs)
        if len(document.text) >= MIN_CHARS_PER_DOCUMENT:
            documents.append(document)
    return documents


def split_documents(documents: list[Document]) -> tuple[list[Document], list[Document]]:
    """Hold out whole documents, picked by a hash of their name, until ~5% of the characters."""
    total = sum(len(d.text) for d in documents)
    by_hash = sorted(documents, key=lambda d: hashlib.sha256(d.name.encode()).hexdigest())
    held_out, held_chars = set(), 0
    for document in by_hash:
        if held_chars >= VALIDATION_FRACTION * total:
            break
        held_out.add(document.name)
        held_chars += len(document.text)
    train = [d for d in documents if d.name not in held_out]
    validation = [d for d in documents if d.name in held_out]
    return train, validation


def write_split(path: Path, documents: list[Document]):
    # Paragraphs on their own lines, documents separated by a blank line:
    # `load_dataset("text", sample_by="paragraph")` then yields one row per document.
    path.write_text("\n\n".join(d.text for d in documents) + "\n", encoding="utf-8")


def _package_version(package_root: Path) -> str:
    changelog = package_root / "usr/share/doc/sqlite3-doc/changelog.Debian.gz"
    if changelog.exists():
        with gzip.open(changelog, "rt", encoding="utf-8") as f:
            first = f.readline()
        match = re.search(r"\(([^)]+)\)", first)
        if match:
            return match.group(1)
    return "unknown"


def write_readme(path: Path, package_root: Path, train: list[Document], validation: list[Document]):
    notice = (package_root / COPYRIGHT_FILE).read_text(encoding="utf-8")
    upstream = notice.split("Files: debian/*")[0].strip()
    license_block = notice[notice.rindex("License: public-domain") :].strip()
    sizes = {name: (ASSETS / "corpus" / name).stat().st_size for name in ("train.txt", "validation.txt")}
    lines = [
        "# Shipped corpus: the SQLite documentation",
        "",
        "A small real English corpus so that LeanHive trains out of the box, offline.",
        "",
        f"- Source: Debian package `sqlite3-doc`, version `{_package_version(package_root)}` (bookworm),",
        f"  HTML pages `/{DOC_SUBDIR}/*.html` (top level only; excluded: {', '.join(sorted(EXCLUDED_PAGES))}).",
        "- License: **public domain**. The package's `copyright.html` says:",
        "",
        "  > All of the code and documentation in SQLite has been dedicated to the public domain by the",
        "  > authors. [...] Anyone is free to copy, modify, publish, use, compile, sell, or distribute the",
        "  > original SQLite code, either in source code form or as a compiled binary, for any purpose,",
        "  > commercial or non-commercial, and by any means.",
        "",
        "  and Debian's `/usr/share/doc/sqlite3-doc/copyright`:",
        "",
        "```",
        upstream,
        "",
        license_block,
        "```",
        "",
        "## Cleaning (`scripts/build_assets.py`)",
        "",
        "Text of block elements (`p`, `li`, `td`, ...) only; code (`pre`), diagrams (`svg`), scripts and",
        f"tables of contents dropped; whitespace collapsed; paragraphs shorter than {MIN_WORDS_PER_PARAGRAPH} words",
        '(menus, headings) and "last modified"/"See also" lines dropped; repeated paragraphs kept once.',
        "One paragraph per line, documents (pages) separated by a blank line.",
        "",
        "## Splits",
        "",
        f"Whole pages are held out for validation (picked by SHA-256 of the page name, "
        f"~{VALIDATION_FRACTION:.0%} of the text).",
        "",
        "| file | documents | bytes |",
        "|---|---|---|",
        f"| train.txt | {len(train)} | {sizes['train.txt']} |",
        f"| validation.txt | {len(validation)} | {sizes['validation.txt']} |",
        "",
        "Validation pages: " + ", ".join(d.name for d in validation) + ".",
        "",
    ]
    path.write_text("\n".join(lines), encoding="utf-8")


def build_corpus(package_root: Path):
    documents = extract_documents(package_root)
    train, validation = split_documents(documents)
    corpus_dir = ASSETS / "corpus"
    corpus_dir.mkdir(parents=True, exist_ok=True)
    write_split(corpus_dir / "train.txt", train)
    write_split(corpus_dir / "validation.txt", validation)
    write_readme(corpus_dir / "README.md", package_root, train, validation)
    logger.info("corpus: %d train and %d validation documents in %s", len(train), len(validation), corpus_dir)


def build_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    train_file = ASSETS / "corpus" / "train.txt"
    tokenizer = Tokenizer(models.BPE(unk_token=SPECIAL_TOKENS["unk_token"]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS.values()),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train([str(train_file)], trainer)
    out_dir = ASSETS / "tokenizer"
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, **SPECIAL_TOKENS).save_pretrained(str(out_dir))
    # Name the class that transformers 4.x knows too (5.x maps it to its tokenizers backend).
    config_path = out_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    logger.info("tokenizer: vocabulary of %d saved to %s", tokenizer.get_vocab_size(), out_dir)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "package_root",
        nargs="?",
        type=Path,
        help="folder made by `dpkg -x sqlite3-doc_*.deb DIR`; omit to retrain only the tokenizer",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if args.package_root is not None:
        build_corpus(args.package_root)
    build_tokenizer()


if __name__ == "__main__":
    sys.exit(main())
