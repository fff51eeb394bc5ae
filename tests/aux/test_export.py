"""The export to a self-contained Hugging Face folder: from an aux checkpoint (the CLI, end to end) and from a
trainer backup; the folder loads with ``trust_remote_code`` in a fresh virtual environment that has torch and
transformers but not LeanHive, and generates what the source model generates; bad sources give clear errors;
``--upload_to_hub`` uploads the same folder (the Hub is mocked)."""

import json
import os
import site
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from aux_monitor import export as export_module
from aux_monitor.export import ExportArguments, ExportError, export, load_source
from model import LeanGPTForCausalLM, load_config
from peer.backup import BACKUP_NAME, save_backup
from tests.aux.test_parts import FakeHfApi
from tests.support.model import save_tiny_checkpoint

pytestmark = pytest.mark.deps  # scripts/test.sh --newest/--oldest run these

REPO_ROOT = Path(__file__).resolve().parents[2]
FACTS = dict(run_id="export_run", samples_seen=4321, validation_loss=6.5, validation_epoch=9)


def _model(seed: int = 0) -> LeanGPTForCausalLM:
    torch.manual_seed(seed)
    return LeanGPTForCausalLM(load_config("tiny"))  # vocab 4096: the shipped tokenizer's size


def _checkpoint(directory: Path, epoch: int, seed: int = 0) -> Path:
    return Path(save_tiny_checkpoint(directory, epoch, seed, facts=FACTS).path)


def _greedy(model, ids: torch.Tensor) -> list:
    with torch.no_grad():
        return model.eval().generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=3).tolist()


def _fresh_venv(tmp_path: Path) -> Path:
    """A venv with torch and transformers (the main venv's site-packages as a plain path line: a path line is not
    processed as a site dir, so the editable LeanHive install in there is not), and no LeanHive."""
    venv = tmp_path / "fresh-venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    [purelib] = (venv / "lib").glob("python*/site-packages")
    (purelib / "main_site_packages.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    return venv / "bin" / "python"


LOAD_AND_GENERATE = textwrap.dedent(
    """
    import importlib, json, sys
    for name in ("model", "peer", "aux_monitor"):
        try:
            importlib.import_module(name)
        except ImportError:
            continue
        raise SystemExit(f"LeanHive's {name} is importable in the fresh venv")
    from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline
    folder = sys.argv[1]
    tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=True)
    model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()
    assert not type(model).__module__.startswith("model."), type(model).__module__
    ids = tokenizer("The swarm learns", return_tensors="pt").input_ids
    greedy = model.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=3)
    beams = model.generate(ids, max_new_tokens=6, num_beams=2, pad_token_id=3)
    generator = pipeline("text-generation", model=model, tokenizer=tokenizer, trust_remote_code=True)
    text = generator("The swarm", max_new_tokens=5)
    print(json.dumps(dict(ids=ids.tolist(), greedy=greedy.tolist(), text=text[0]["generated_text"])))
    """
)


def _run(argv, cwd, env) -> subprocess.CompletedProcess:
    result = subprocess.run(
        argv, cwd=cwd, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=240
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def test_cli_exports_an_aux_checkpoint_that_loads_without_leanhive(tmp_path):
    checkpoint = _checkpoint(tmp_path / "checkpoints", epoch=9)
    output = tmp_path / "exported"
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO_ROOT)}
    result = _run(
        [sys.executable, "-m", "aux_monitor.export", "--source", str(tmp_path / "checkpoints")]
        + ["--output", str(output), "--verify", "false"],
        cwd=REPO_ROOT,
        env=env,
    )
    assert result.stdout.strip() == str(output)
    names = {p.name for p in output.iterdir()}
    assert {"model.safetensors", "config.json", "tokenizer.json", "README.md", "leanhive_modeling.py"} <= names
    assert not any(n.startswith(".tmp-") for n in os.listdir(tmp_path))
    config = json.loads((output / "config.json").read_text())
    assert config["auto_map"]["AutoModelForCausalLM"] == "leanhive_modeling.LeanGPTForCausalLM"
    for code in output.glob("*.py"):  # the modeling code imports nothing from LeanHive
        assert "from model" not in code.read_text() and "import model" not in code.read_text(), code.name
    card = (output / "README.md").read_text()
    for fact in ("export_run", "| global epochs | 9 |", "4,321", "7.2500", "6.5000", "trust_remote_code=True"):
        assert fact in card
    assert json.loads((output / "leanhive_run.json").read_text())["run_id"] == "export_run"

    fresh_env = {k: v for k, v in env.items() if k != "PYTHONPATH"}
    workdir = tmp_path / "elsewhere"
    workdir.mkdir()
    loaded = _run([str(_fresh_venv(tmp_path)), "-c", LOAD_AND_GENERATE, str(output)], cwd=workdir, env=fresh_env)
    out = json.loads(loaded.stdout.strip().splitlines()[-1])
    assert out["greedy"] == _greedy(LeanGPTForCausalLM.from_pretrained(checkpoint), torch.tensor(out["ids"]))
    assert out["text"].startswith("The swarm")


def test_export_of_a_trainer_backup_is_verified_and_keeps_the_weights(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))  # the verification subprocess caches modules there
    model = _model(seed=3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    optimizer.local_epoch = 17  # what save_backup reads from hivemind's Optimizer
    (tmp_path / "trainer").mkdir()
    save_backup(str(tmp_path / "trainer"), model, optimizer)
    with pytest.raises(ExportError, match="--model_config"):
        load_source(ExportArguments(source=str(tmp_path / "trainer"), output=str(tmp_path / "x")))
    args = ExportArguments(
        source=str(tmp_path / "trainer"), output=str(tmp_path / "out"), model_config="tiny", run_id="backup_run"
    )
    folder = export(args)  # verify=True: loaded in a fresh interpreter, logits compared
    exported = LeanGPTForCausalLM.from_pretrained(folder)
    for name, tensor in model.state_dict().items():
        assert torch.equal(exported.state_dict()[name], tensor), name
    card = (folder / "README.md").read_text()
    assert "backup_run" in card and "| global epochs | 17 |" in card and "trainer backup" in card


def test_bad_sources_and_outputs_give_clear_errors(tmp_path, caplog):
    def args(source, output="out"):
        return ExportArguments(source=str(source), output=str(tmp_path / output), verify=False)

    with pytest.raises(ExportError, match="does not exist"):
        load_source(args(tmp_path / "missing"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ExportError, match="neither an aux checkpoint"):
        load_source(args(tmp_path / "empty"))
    old = _checkpoint(tmp_path / "checkpoints", epoch=4, seed=1)
    new = _checkpoint(tmp_path / "checkpoints", epoch=8, seed=2)
    weights = new / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-8] + b"corrupt!")
    with pytest.raises(ExportError, match="checksum"):
        load_source(args(new))
    _, facts = load_source(args(tmp_path / "checkpoints"))  # the newest is damaged: the one before it is used
    assert facts.epoch == 4 and facts.source == str(old)
    assert any("Skipping" in r.getMessage() and new.name in r.getMessage() for r in caplog.records)
    (tmp_path / "trainer").mkdir()
    (tmp_path / "trainer" / BACKUP_NAME).write_bytes(b"not a torch file")
    with pytest.raises(ExportError, match="unreadable"):
        load_source(ExportArguments(source=str(tmp_path / "trainer"), output="x", model_config="tiny"))
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "file").write_text("keep me")
    with pytest.raises(ExportError, match="not empty"):
        export(args(old, output="taken"))
    assert (tmp_path / "taken" / "file").read_text() == "keep me"
    with pytest.raises(ValueError, match="--source is required"):
        ExportArguments(output="x")


def test_upload_to_hub_uploads_the_exported_folder(tmp_path, monkeypatch):
    import huggingface_hub

    api = FakeHfApi()
    monkeypatch.setattr(huggingface_hub, "HfApi", lambda: api)
    checkpoint = _checkpoint(tmp_path / "checkpoints", epoch=6)
    args = ExportArguments(source=str(checkpoint), output=str(tmp_path / "out"), upload_to_hub="org/lean", verify=False)
    folder = export(args)
    assert api.calls == [
        ("create_repo", "org/lean", dict(repo_type="model", private=True, exist_ok=True)),
        ("upload_folder", "org/lean", str(folder), "LeanHive export: aux checkpoint, epoch 6"),
    ]
    assert 'from_pretrained("org/lean", trust_remote_code=True)' in (folder / "README.md").read_text()
    with pytest.raises(ValueError, match="Hub repo id"):
        ExportArguments(source="a", output="b", upload_to_hub="not a repo")


def test_flattened_modeling_code_has_no_leanhive_imports():
    sources = export_module.modeling_sources()
    assert "leanhive_modeling.py" in sources and "leanhive_ops_attention_core.py" in sources
    for name, text in sources.items():
        assert "from model." not in text and "\nimport model" not in text, name
