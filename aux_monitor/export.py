"""Export what the swarm trained as a self-contained Hugging Face model folder (and optionally upload it).

    python -m aux_monitor.export --source checkpoints/ --output my_model          (newest valid aux checkpoint)
    python -m aux_monitor.export --source checkpoints/epoch_000040 --output my_model
    python -m aux_monitor.export --source outputs/ --model_config tiny --output my_model   (a trainer backup)

The folder holds the weights (``model.safetensors``), ``config.json`` with ``auto_map``, the modeling code (a
flat copy of the ``model/`` modules it needs, with imports made relative), the tokenizer, ``generation_config.json``,
``leanhive_run.json`` (the run's facts) and a model card (``README.md``). It imports nothing from LeanHive: with
torch and transformers installed, ``AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)`` loads it.
The folder is written under a temporary name and renamed into place when complete, with the permissions a plain
``mkdir``/``open`` would give under the umask, so that other users, a web server or a container can read it.
"""

from __future__ import annotations

import ast
import datetime
import json
import logging
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import torch

import model as lean_model
from aux_monitor.checkpoints import MANIFEST, CheckpointError, checkpoint_dirs, load_checkpoint
from model import LeanGPTForCausalLM, load_config
from peer.swarm.backup_format import BACKUP_NAME, PREVIOUS_BACKUP_NAME, BackupError, read_backup
from peer.swarm.data import shipped_tokenizer_dir
from peer.swarm.events import finite_or_none
from peer.swarm.validate import require

logger = logging.getLogger(__name__)

ENTRY_MODULE = "model.modeling"
EXPORTED_PREFIX = "leanhive_"  # model.ops.attention -> leanhive_ops_attention.py
FACTS_FILE = "leanhive_run.json"
# The transformers versions the generation and export tests pass with: the oldest pyproject.toml allows
# (`bash scripts/test.sh --oldest`) and the one requirements.lock pins; tests/test_export.py keeps them in step.
TESTED_TRANSFORMERS = ("4.56", "5.24.0")
_MODEL_IMPORT = re.compile(r"^(\s*)from model\.([\w.]+) import", re.MULTILINE)
# the reversible stack's training path needs revlib; generation (KV cache) and every other stack do not
_REVLIB_IMPORT = "from revlib.core import ReversibleModule, replace_grad\n"
_REVLIB_OPTIONAL = """try:
    from revlib.core import ReversibleModule, replace_grad
except ImportError:  # only a reversible model's forward pass without a KV cache needs revlib

    def ReversibleModule(*args, **kwargs):
        raise ImportError(
            "this reversible model needs revlib for a forward pass without a KV cache: pip install revlib "
            "(generate() with its default KV cache does not need it)"
        )

    replace_grad = ReversibleModule
"""


class ExportError(ValueError):
    """The source cannot be exported; the message says how to fix it."""


@dataclass
class ExportArguments:
    """What to export and where."""

    source: str = ""
    """An aux checkpoint (epoch_NNNNNN/), a folder of them (the newest valid one is used), or a trainer backup
    (backup.pt, or the trainer's --output_dir holding one)."""
    output: str = ""
    """Folder to write the Hugging Face model to; must not exist yet (or be empty)."""
    model_config: Optional[str] = None
    """Model preset name or JSON path; needed for a trainer backup only (backups do not record it)."""
    tokenizer: str = ""
    """Tokenizer folder to ship with the model; empty means the tokenizer LeanHive ships (peer/assets/tokenizer)."""
    run_id: Optional[str] = None
    """Run id for the model card; aux checkpoints record it, a trainer backup does not."""
    upload_to_hub: Optional[str] = None
    """Also upload the folder to this Hugging Face Hub model repo (user/name); needs HF_TOKEN or a login."""
    private: bool = True
    """Create the Hub repo as private (when it does not exist yet)."""
    verify: bool = True
    """Load the written folder back (trust_remote_code) and compare its logits with the source's."""

    def __post_init__(self):
        require(bool(self.source), "--source is required: an aux checkpoint folder or a trainer backup")
        require(bool(self.output), "--output is required: the folder to write the Hugging Face model to")
        if self.upload_to_hub is not None:
            from aux_monitor.arguments import _HUB_REPO

            require(
                bool(_HUB_REPO.match(self.upload_to_hub)),
                f"upload_to_hub must be a Hub repo id like my-org/leanhive-gpt, got {self.upload_to_hub!r}",
            )


@dataclass
class RunFacts:
    """What the model card says about the run; None where the source does not record it."""

    source: str
    source_kind: str  # "aux checkpoint" or "trainer backup"
    epoch: int
    run_id: Optional[str] = None
    samples_seen: Optional[int] = None
    training_loss: Optional[float] = None
    validation_loss: Optional[float] = None
    validation_epoch: Optional[int] = None
    taken_at: Optional[float] = None  # unix time of the state


# ---------------------------------------------------------------------------------------------- reading sources
def load_source(args: ExportArguments) -> tuple:
    """(model, RunFacts) from an aux checkpoint, a folder of them or a trainer backup; ExportError if unusable."""
    path = Path(args.source)
    if not path.exists():
        raise ExportError(f"--source {path} does not exist; give an aux checkpoint folder or a trainer backup")
    if path.is_dir() and (path / MANIFEST).exists():
        return _from_checkpoint(path, args)
    if path.is_dir() and checkpoint_dirs(path):
        return _from_newest_checkpoint(path, args)
    backups = [path] if path.is_file() else [p for p in (path / BACKUP_NAME, path / PREVIOUS_BACKUP_NAME) if p.exists()]
    if backups:
        return _from_backup(backups, args)
    raise ExportError(
        f"{path} is neither an aux checkpoint (a folder holding {MANIFEST}), a folder of them (epoch_NNNNNN/), "
        f"nor a trainer backup ({BACKUP_NAME} or a trainer --output_dir holding one)"
    )


def _from_checkpoint(path: Path, args: ExportArguments) -> tuple:
    try:
        loaded = load_checkpoint(path, LeanGPTForCausalLM)
    except CheckpointError as e:
        raise ExportError(f"the aux checkpoint {path} cannot be exported: {e}") from e
    state, facts = loaded.state, loaded.state.facts
    samples = facts.get("samples_seen")
    return state.model, RunFacts(
        source=str(path),
        source_kind="aux checkpoint",
        epoch=state.epoch,
        run_id=args.run_id or facts.get("run_id"),
        samples_seen=samples if isinstance(samples, int) else None,
        training_loss=finite_or_none(state.loss),
        validation_loss=finite_or_none(facts.get("validation_loss")),
        validation_epoch=facts.get("validation_epoch") if isinstance(facts.get("validation_epoch"), int) else None,
        taken_at=state.time,
    )


def _from_newest_checkpoint(directory: Path, args: ExportArguments) -> tuple:
    problems = []
    for path in checkpoint_dirs(directory):
        try:
            return _from_checkpoint(path, args)
        except ExportError as e:
            logger.warning("Skipping %s: %s", path, e)
            problems.append(f"{path.name}: {e}")
    raise ExportError(f"no checkpoint in {directory} can be exported:\n  " + "\n  ".join(problems))


def _from_backup(paths: List[Path], args: ExportArguments) -> tuple:
    if not args.model_config:
        raise ExportError(
            f"{paths[0]} is a trainer backup, which does not record the model config: pass --model_config "
            "with the trainers' model preset (e.g. --model_config tiny) or JSON file"
        )
    try:
        config = load_config(args.model_config)
    except ValueError as e:
        raise ExportError(str(e)) from e
    model = LeanGPTForCausalLM(config)
    problems = []
    for path in paths:  # the newest backup, then the one before it (as a restarting trainer does)
        try:
            payload = read_backup(path, model)
        except BackupError as e:
            problems.append(f"{path}: {e}")
            logger.warning("Skipping the backup %s: %s", path, e)
            continue
        model.load_state_dict(payload["model"])
        epoch = payload.get("epoch")
        return model, RunFacts(
            source=str(path),
            source_kind="trainer backup",
            epoch=epoch if isinstance(epoch, int) else 0,
            run_id=args.run_id,
        )
    raise ExportError("no usable trainer backup (is --model_config the trainers' one?):\n  " + "\n  ".join(problems))


# ---------------------------------------------------------------------------------------------- the modeling code
def _module_file(name: str) -> Path:
    root = Path(lean_model.__file__).parent
    relative = Path(*name.split(".")[1:])
    return root / relative.with_suffix(".py") if (root / relative.with_suffix(".py")).exists() else root / relative


def _model_imports(source: str) -> List[str]:
    """Every model.* module a source imports (at any depth: lazy imports inside functions count)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("model."):
            found.append(node.module)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]
            if any(n == "model" or n.startswith("model.") for n in names):
                raise ExportError(f"cannot flatten `{ast.unparse(node)}`: import model.<module> by name instead")
    return found


def exported_name(module: str) -> str:
    return EXPORTED_PREFIX + module.split(".", 1)[1].replace(".", "_")


# In the exported entry module: transformers before 5.x copies into its module cache only the files a local folder's
# entry module imports itself (not what those import in turn), and then fails to find the rest.
_DIRECT_IMPORTS_NOTE = """

# Every modeling file of this folder, imported by the entry module itself: transformers before 5.x copies only the
# files the entry module imports into its module cache when it loads a local folder.
"""


def modeling_sources(entry: str = ENTRY_MODULE) -> Dict[str, str]:
    """{file name: source} of the entry module and every model.* module it needs, imports made relative."""
    pending, sources = [entry], {}
    while pending:
        module = pending.pop()
        if exported_name(module) + ".py" in sources:
            continue
        text = _module_file(module).read_text()
        pending.extend(_model_imports(text))
        text = _MODEL_IMPORT.sub(lambda m: f"{m[1]}from .{exported_name('model.' + m[2])} import", text)
        if _REVLIB_IMPORT in text:
            text = text.replace(_REVLIB_IMPORT, _REVLIB_OPTIONAL)
        if re.search(r"^(from|import) revlib", text, re.MULTILINE):  # a top-level import not made optional above
            raise ExportError(f"{module} imports revlib in a way the export does not make optional; update export.py")
        sources[exported_name(module) + ".py"] = text
    entry_file = exported_name(entry) + ".py"
    sources[entry_file] += _DIRECT_IMPORTS_NOTE + "".join(
        f"from .{name[:-3]} import __name__ as _{name[:-3]}  # noqa: E402,F401\n"
        for name in sorted(sources)
        if name != entry_file
    )
    return sources


# ---------------------------------------------------------------------------------------------- writing
def _fmt(value, spec: str = "") -> str:
    return "unknown" if value is None else format(value, spec)


def model_card(facts: RunFacts, model: LeanGPTForCausalLM, load_name: str) -> str:
    config = model.config
    params = sum(p.numel() for p in model.parameters())
    validation = _fmt(facts.validation_loss, ".4f")
    if facts.validation_loss is not None and facts.validation_epoch is not None:
        validation += f" (perplexity {math.exp(min(facts.validation_loss, 700)):.2f}, epoch {facts.validation_epoch})"
    taken = (
        datetime.datetime.fromtimestamp(facts.taken_at, datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
        if facts.taken_at
        else "unknown"
    )
    architecture = (
        f"{config.num_hidden_layers} layers, hidden {config.hidden_size}, {config.num_attention_heads} heads, "
        f"FFN {config.intermediate_size}, vocab {config.vocab_size}, {config.position_embedding_type} positions"
        + (", reversible" if config.reversible else "")
    )
    return f"""---
library_name: transformers
pipeline_tag: text-generation
tags:
- leanhive
- hivemind
- decentralized-training
---

# LeanHive causal LM{f" ({facts.run_id})" if facts.run_id else ""}

A causal language model trained collaboratively by a LeanHive swarm: volunteers' peers synchronized through
hivemind, each running a memory-lean transformer. This folder is self-contained: the modeling code is included
(`trust_remote_code=True`), and loading it needs only `torch` and `transformers`, not LeanHive. Tested with
transformers {TESTED_TRANSFORMERS[0]} to {TESTED_TRANSFORMERS[1]}; exported with {_transformers_version()}.

| run fact | value |
|---|---|
| run id | {_fmt(facts.run_id)} |
| global epochs | {facts.epoch} |
| samples seen | {_fmt(facts.samples_seen, ",")} |
| final training loss | {_fmt(facts.training_loss, ".4f")} |
| final validation loss | {validation} |
| state taken at | {taken} |
| exported from | {facts.source_kind} `{Path(facts.source).name}` |
| parameters | {params / 1e6:.2f}M |
| architecture | {architecture} |

## Load it and generate

```python
from transformers import AutoModelForCausalLM, AutoTokenizer
tokenizer = AutoTokenizer.from_pretrained("{load_name}", trust_remote_code=True)
model = AutoModelForCausalLM.from_pretrained("{load_name}", trust_remote_code=True)
ids = tokenizer("The swarm", return_tensors="pt").input_ids
print(tokenizer.decode(model.generate(ids, max_new_tokens=40, do_sample=True, top_k=50)[0]))
```

`generate()` uses a KV cache (greedy, sampling and beam search all work), and so does
`pipeline("text-generation", model=model, tokenizer=tokenizer)`. The run's facts are in `{FACTS_FILE}`.
"""


def _transformers_version() -> str:
    import transformers

    return transformers.__version__


def _umask() -> int:
    try:  # Linux reports it without changing it (os.umask would, for a moment, for every thread)
        status = Path("/proc/self/status").read_text()
        return int(re.search(r"^Umask:\s*([0-7]+)", status, re.MULTILINE).group(1), 8)
    except (OSError, AttributeError):
        mask = os.umask(0o022)
        os.umask(mask)
        return mask


def _give_plain_permissions(folder: Path) -> None:
    """mkdtemp creates the folder 0700 and safetensors writes 0600: give every entry what mkdir/open would have."""
    umask = _umask()
    for path in [folder, *folder.rglob("*")]:
        path.chmod((0o777 if path.is_dir() else 0o666) & ~umask)


def _prepare_output(output: Path) -> Path:
    if output.exists() and (not output.is_dir() or any(output.iterdir())):
        raise ExportError(f"--output {output} already exists and is not empty; choose a new folder or delete it")
    output.parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f".tmp-{output.name}-", dir=output.parent))


def write_export(model: LeanGPTForCausalLM, facts: RunFacts, args: ExportArguments) -> Path:
    """Write the folder (atomically: a temporary folder renamed into place) and return its path."""
    from transformers import AutoTokenizer

    tokenizer_dir = args.tokenizer or str(shipped_tokenizer_dir())
    try:
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    except (OSError, ValueError) as e:
        raise ExportError(f"the tokenizer {tokenizer_dir} does not load ({e}); pass a tokenizer folder") from e
    if len(tokenizer) > model.config.vocab_size:
        raise ExportError(
            f"the tokenizer {tokenizer_dir} has {len(tokenizer)} tokens but the model only {model.config.vocab_size}: "
            "pass the tokenizer the swarm trained with (--tokenizer)"
        )
    output = Path(args.output)
    tmp = _prepare_output(output)
    try:
        model = model.float().eval()
        config = model.config
        for name in ("pad_token_id", "bos_token_id", "eos_token_id"):
            value = getattr(tokenizer, name)
            if value is not None:
                setattr(config, name, value)
                setattr(model.generation_config, name, value)
        sources = modeling_sources()
        config_module = exported_name("model.config")
        config.auto_map = {
            "AutoConfig": f"{config_module}.{type(config).__name__}",
            "AutoModelForCausalLM": f"{exported_name(ENTRY_MODULE)}.{type(model).__name__}",
        }
        config.architectures = [type(model).__name__]
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        for name, text in sources.items():
            (tmp / name).write_text(text)
        (tmp / FACTS_FILE).write_text(json.dumps(facts.__dict__, indent=2, default=str))
        (tmp / "README.md").write_text(model_card(facts, model, args.upload_to_hub or str(output)))
        _give_plain_permissions(tmp)
        if output.exists():
            output.rmdir()  # checked empty above
        os.rename(tmp, output)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    logger.info("Exported %s (%s, epoch %d) to %s", facts.source, facts.source_kind, facts.epoch, output)
    return output


_VERIFY_SCRIPT = """
import sys, torch
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], trust_remote_code=True).eval()
leaked = sorted(name for name in ("model", "peer", "aux_monitor") if name in sys.modules)
assert not leaked, f"the export imported LeanHive packages: {leaked}"
with torch.no_grad():
    torch.save(model(torch.load(sys.argv[2])).logits, sys.argv[3])
"""


def verify_export(folder: Path, source_model: LeanGPTForCausalLM) -> None:
    """Load the folder with trust_remote_code in a fresh interpreter that never imports LeanHive (in this process
    ``import model`` has registered LeanHive's own classes, which transformers would prefer) and check that it
    computes the logits the source model computes."""
    vocab = source_model.config.vocab_size
    ids = (torch.arange(16) * 7 + 4)[None] % vocab
    with tempfile.TemporaryDirectory(prefix="leanhive-verify-") as work:
        work = Path(work)
        torch.save(ids, work / "ids.pt")
        result = subprocess.run(
            [sys.executable, "-c", _VERIFY_SCRIPT, str(folder.resolve()), str(work / "ids.pt"), str(work / "out.pt")],
            cwd=work,  # not the repository root, where ``model/`` would be importable by accident
            env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
            capture_output=True,
            text=True,
        )
        if result.returncode != 0:
            raise ExportError(f"the exported folder {folder} does not load on its own:\n{result.stderr[-2000:]}")
        got = torch.load(work / "out.pt")
    with torch.no_grad():
        expected = source_model.float().eval()(ids).logits
    if not torch.allclose(expected, got, rtol=1e-5, atol=1e-5):
        raise ExportError(f"the exported model's logits differ from the source's (max {(expected - got).abs().max()})")
    logger.info("Verified %s: it loads with trust_remote_code alone and computes the same logits", folder)


def upload(folder: Path, repo_id: str, *, private: bool, facts: RunFacts) -> None:
    from huggingface_hub import HfApi

    api = HfApi()
    api.create_repo(repo_id, repo_type="model", private=private, exist_ok=True)
    api.upload_folder(
        repo_id=repo_id,
        repo_type="model",
        folder_path=str(folder),
        commit_message=f"LeanHive export: {facts.source_kind}, epoch {facts.epoch}",
    )
    logger.info("Uploaded %s to https://huggingface.co/%s", folder, repo_id)


def export(args: ExportArguments) -> Path:
    """Load the source, write the folder, verify it, upload it if asked; returns the folder."""
    model, facts = load_source(args)
    folder = write_export(model, facts, args)
    if args.verify:
        verify_export(folder, model)
    if args.upload_to_hub:
        upload(folder, args.upload_to_hub, private=args.private, facts=facts)
    return folder


def main(argv: Optional[Sequence[str]] = None) -> int:
    from peer.swarm.cli_args import DataclassArgumentParser
    from peer.swarm.lifecycle import configure_logging

    parser = DataclassArgumentParser([ExportArguments], prog="leanhive-export", description=__doc__)
    [args] = parser.parse_into_dataclasses(argv)
    configure_logging()
    try:
        folder = export(args)
    except ExportError as e:
        logger.error("%s", e)
        return 1
    print(folder)
    return 0


if __name__ == "__main__":
    sys.exit(main())
