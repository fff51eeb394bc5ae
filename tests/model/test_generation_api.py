"""``generate()`` as users call it gives the same tokens with and without the KV cache: without an attention mask,
with one, on batched left-padded prompts, greedy, sampling with a seed and beam search. The model is trained for a
few hundred steps on the shipped corpus first, so that its next token depends on the context (random weights
predict nearly the same distribution everywhere, and a cache that loses the context can go unnoticed). The same
holds for the model exported to a Hugging Face folder and loaded in a fresh interpreter in which only torch,
transformers and what they depend on can be imported."""

import copy
import importlib.metadata
import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from aux_monitor.export import ExportArguments, RunFacts, write_export
from model import LeanGPTForCausalLM, LeanTransformerConfig
from peer.swarm.data import shipped_corpus_dir, shipped_tokenizer_dir

pytestmark = pytest.mark.deps  # scripts/test.sh --newest/--oldest run these

PROMPTS = ["The database file", "In this mode, the", "A table"]
NEW_TOKENS = 16


def _train(steps: int = 300, length: int = 64, batch: int = 16) -> LeanGPTForCausalLM:
    """A small model trained with AdamW on the shipped corpus (about 6 s on 2 cores)."""
    tokenizer = AutoTokenizer.from_pretrained(shipped_tokenizer_dir())
    ids = torch.tensor(tokenizer((shipped_corpus_dir() / "train.txt").read_text()[:400_000])["input_ids"])
    config = LeanTransformerConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=256,
        max_position_embeddings=128,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    model = LeanGPTForCausalLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    generator = torch.Generator().manual_seed(0)
    for _ in range(steps):
        starts = torch.randint(0, ids.numel() - length, (batch,), generator=generator)
        sequences = torch.stack([ids[start : start + length] for start in starts])
        model(sequences, labels=sequences).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return model.eval()


@pytest.fixture(scope="module")
def trained() -> LeanGPTForCausalLM:
    return _train()


@pytest.fixture(scope="module")
def tokenizer():
    tokenizer = AutoTokenizer.from_pretrained(shipped_tokenizer_dir())
    tokenizer.padding_side = "left"  # what batched generation needs: new tokens follow every prompt directly
    return tokenizer


# (name, generate() arguments, whether the prompts are batched and left-padded)
CASES = {
    "greedy_no_mask": (dict(do_sample=False), False),
    "greedy_with_mask": (dict(do_sample=False), "mask"),
    "greedy_left_padded_batch": (dict(do_sample=False), "batch"),
    "sampling_seeded": (dict(do_sample=True, top_k=40, temperature=0.8), "batch"),
    "beam_search": (dict(num_beams=3, num_return_sequences=2, do_sample=False), "batch"),
}


def _inputs(tokenizer, how) -> dict:
    if how == "batch":
        encoded = tokenizer(PROMPTS, return_tensors="pt", padding=True)
        assert (encoded.attention_mask == 0).any(), "the prompts must differ in length to test left padding"
        return dict(input_ids=encoded.input_ids, attention_mask=encoded.attention_mask)
    encoded = tokenizer(PROMPTS[0], return_tensors="pt")
    return (
        dict(input_ids=encoded.input_ids, attention_mask=encoded.attention_mask)
        if how
        else dict(input_ids=encoded.input_ids)
    )


def _generate(model, inputs: dict, arguments: dict, use_cache: bool, pad_token_id: int) -> torch.Tensor:
    torch.manual_seed(1234)  # sampling draws the same numbers with and without the cache
    with torch.no_grad():
        return model.generate(
            **inputs, **arguments, max_new_tokens=NEW_TOKENS, use_cache=use_cache, pad_token_id=pad_token_id
        )


def test_the_trained_model_predicts_from_its_context(trained, tokenizer):
    """The guard for the cases below: different prompts continue differently, and a continuation is not one
    repeated token (what a model that sees only its last token tends to produce)."""
    continuations = []
    for prompt in PROMPTS:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        out = _generate(trained, dict(input_ids=ids), dict(do_sample=False), False, tokenizer.pad_token_id)
        continuations.append(tuple(out[0, ids.shape[1] :].tolist()))
    assert len(set(continuations)) == len(PROMPTS), continuations
    assert all(len(set(tokens)) >= 4 for tokens in continuations), continuations


@pytest.mark.parametrize("case", list(CASES))
def test_generate_gives_the_same_tokens_with_and_without_the_cache(trained, tokenizer, case):
    arguments, how = CASES[case]
    inputs = _inputs(tokenizer, how)
    cached = _generate(trained, inputs, arguments, True, tokenizer.pad_token_id)
    uncached = _generate(trained, inputs, arguments, False, tokenizer.pad_token_id)
    rows = inputs["input_ids"].shape[0] * arguments.get("num_return_sequences", 1)
    assert cached.shape == (rows, inputs["input_ids"].shape[1] + NEW_TOKENS)
    assert cached.tolist() == uncached.tolist(), (tokenizer.batch_decode(cached), tokenizer.batch_decode(uncached))


def test_left_padding_does_not_change_a_prompts_continuation(trained, tokenizer):
    """A prompt generates the same tokens alone and left-padded in a batch (with the cache, as generate() runs)."""
    batch = _inputs(tokenizer, "batch")
    batched = _generate(trained, batch, dict(do_sample=False), True, tokenizer.pad_token_id)
    for row, prompt in enumerate(PROMPTS):
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        alone = _generate(trained, dict(input_ids=ids), dict(do_sample=False), True, tokenizer.pad_token_id)
        assert batched[row, -NEW_TOKENS:].tolist() == alone[0, -NEW_TOKENS:].tolist(), prompt


def _site_with_only(directory: Path, roots=("torch", "transformers")) -> Path:
    """A folder of links to the installed files of ``roots`` and of what they require, and nothing else: the only
    site a ``python -S`` interpreter with it on PYTHONPATH can import from (plus the standard library)."""
    allowed, todo = set(), list(roots)
    while todo:
        name = re.sub(r"[-_.]+", "-", todo.pop()).lower()
        if name in allowed:
            continue
        allowed.add(name)
        try:
            requirements = importlib.metadata.requires(name) or []
        except importlib.metadata.PackageNotFoundError:
            continue  # an optional requirement that is not installed
        todo.extend(re.split(r"[^A-Za-z0-9._-]", line, 1)[0] for line in requirements if "extra ==" not in line)
    directory.mkdir()
    for name in allowed:
        try:
            distribution = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            continue
        for top in {Path(str(file)).parts[0] for file in distribution.files or [] if not str(file).startswith("..")}:
            source = Path(distribution.locate_file(top))
            if source.exists() and not (directory / top).exists():
                (directory / top).symlink_to(source)
    return directory


# Runs as `python -S` with only that site on its path: LeanHive and its other dependencies cannot be imported.
ONLY_TORCH_AND_TRANSFORMERS = textwrap.dedent(
    """
    import importlib.util, json, sys

    for name in ("model", "peer", "aux_monitor", "hivemind", "bitsandbytes", "datasets", "revlib"):
        assert importlib.util.find_spec(name) is None, f"{name} is importable"

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, cases = sys.argv[1], json.loads(sys.argv[2])
    tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=True)
    tokenizer.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()
    assert type(model).__module__.startswith("transformers_modules"), type(model).__module__
    results = {}
    for name, (arguments, prompts) in cases.items():
        encoded = tokenizer(prompts, return_tensors="pt", padding=True)
        inputs = dict(input_ids=encoded.input_ids, attention_mask=encoded.attention_mask)
        outputs = []
        for use_cache in (True, False):
            torch.manual_seed(1234)
            with torch.no_grad():
                outputs.append(model.generate(**inputs, **arguments, max_new_tokens=%d, use_cache=use_cache,
                                              pad_token_id=tokenizer.pad_token_id).tolist())
        results[name] = outputs
    print(json.dumps(results))
    """
    % NEW_TOKENS
)


def _export(model: LeanGPTForCausalLM, folder: Path) -> LeanGPTForCausalLM:
    """Export a copy (the export sets the tokenizer's special tokens on the model it writes); returns the copy."""
    model = copy.deepcopy(model)
    facts = RunFacts(source=str(folder.parent / "trained"), source_kind="trainer backup", epoch=1)
    write_export(model, facts, ExportArguments(source=facts.source, output=str(folder), verify=False))
    return model


def test_an_exported_folder_generates_the_same_with_and_without_the_cache_on_its_own(trained, tokenizer, tmp_path):
    folder = tmp_path / "exported"
    exported = _export(trained, folder)
    cases = {
        "greedy": (dict(do_sample=False), [PROMPTS[0]]),
        "greedy_left_padded_batch": (dict(do_sample=False), PROMPTS),
        "sampling_seeded": (dict(do_sample=True, top_k=40, temperature=0.8), PROMPTS),
        "beam_search": (dict(num_beams=3, num_return_sequences=2, do_sample=False), PROMPTS),
    }
    workdir = tmp_path / "elsewhere"  # not the repository root, where model/ would be importable
    workdir.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    env.update(PYTHONPATH=str(_site_with_only(tmp_path / "site")), HF_HOME=str(tmp_path / "hf"), HF_HUB_OFFLINE="1")
    result = subprocess.run(
        [sys.executable, "-S", "-c", ONLY_TORCH_AND_TRANSFORMERS, str(folder), json.dumps(cases)],
        cwd=workdir,
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    results = json.loads(result.stdout.strip().splitlines()[-1])
    for name, (arguments, prompts) in cases.items():
        cached, uncached = results[name]
        assert cached == uncached, name
        # and what the folder generates is what the model generates here
        encoded = tokenizer(prompts, return_tensors="pt", padding=True)
        inputs = dict(input_ids=encoded.input_ids, attention_mask=encoded.attention_mask)
        assert cached == _generate(exported, inputs, arguments, True, tokenizer.pad_token_id).tolist(), name


def test_exported_folders_are_readable_by_other_users(trained, tmp_path):
    """Created with the process umask (022 here): folder 0755, files 0644, not the 0700/0600 of a private temp dir."""
    previous = os.umask(0o022)
    try:
        folder = tmp_path / "exported"
        _export(trained, folder)
    finally:
        os.umask(previous)
    assert folder.stat().st_mode & 0o777 == 0o755
    modes = {path.name: path.stat().st_mode & 0o777 for path in folder.iterdir()}
    assert modes and all(mode == 0o644 for mode in modes.values()), modes
    card = (folder / "README.md").read_text()
    assert "transformers" in card and Path(folder / "model.safetensors").exists()
