"""The command-line layer (peer.swarm.cli_args): help text from field docstrings and comments, presets overridden
on the command line, bad preset values; and a cross-field check of the collaboration arguments."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Literal, Optional

import pytest

from peer.swarm.cli_args import DataclassArgumentParser, field_docs
from peer.swarm.config import CollaborationArguments


@dataclass
class _Example:
    """An example config."""

    count: int = 3
    """How many."""
    ratio: float = 0.5  # a trailing comment
    # a comment above
    names: List[str] = field(default_factory=list)
    mode: Literal["a", "b"] = "a"
    flag: bool = False
    limit: Optional[int] = None

    def __post_init__(self):
        if self.count < 1:
            raise ValueError(f"count must be >= 1, got {self.count}")


def test_help_text_comes_from_docstrings_and_comments():
    docs = field_docs(_Example)
    assert docs["count"] == "How many."
    assert docs["ratio"] == "a trailing comment"
    assert docs["names"] == "a comment above"


def test_preset_then_command_line_override(tmp_path):
    preset = tmp_path / "p.yaml"
    preset.write_text("count: 7\nratio: 0.25\nnames: [x, y]\nflag: true\nlimit: 5\n")
    parser = DataclassArgumentParser([_Example])
    (example,) = parser.parse_into_dataclasses(["--config", str(preset), "--ratio", "0.75", "--limit", "none"])
    assert (example.count, example.ratio, example.names, example.flag, example.limit) == (
        7,
        0.75,
        ["x", "y"],
        True,
        None,
    )
    (example,) = parser.parse_into_dataclasses(["--flag", "--names", "p", "q", "--mode", "b"])
    assert example.flag is True and example.names == ["p", "q"] and example.mode == "b" and example.count == 3
    (example,) = parser.parse_into_dataclasses(["--flag", "false"])
    assert example.flag is False


@pytest.mark.parametrize(
    "text,message",
    [
        ("count: 0\n", "count must be >= 1"),
        ("count: many\n", "invalid value for count"),
        ("mode: c\n", "choose from a, b"),
        ("- just a list\n", "expected a mapping"),
    ],
)
def test_bad_preset_values_exit_2(tmp_path, capsys, text, message):
    preset = tmp_path / "p.yaml"
    preset.write_text(text)
    with pytest.raises(SystemExit) as exit_info:
        DataclassArgumentParser([_Example]).parse_into_dataclasses(["--config", str(preset)])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_collaboration_defaults_keep_request_timeout_below_matchmaking_time():
    assert CollaborationArguments(matchmaking_time=1.0).request_timeout < 1.0
    with pytest.raises(ValueError, match="must be smaller than matchmaking_time"):
        CollaborationArguments(matchmaking_time=1.0, request_timeout=2.0)
