"""A small generic layer that turns typed config dataclasses into one argparse CLI with YAML presets.

Each dataclass becomes an argument group; each field a ``--field_name`` flag whose help text is the
field's docstring (a string literal right after the field) or its comment (trailing or on the lines
above). Values are merged as: dataclass defaults < YAML run preset (``--config``) < command line.
Constructing the dataclasses runs their ``__post_init__`` validation; any invalid value ends the
program with exit status 2 and a message that says what is valid (argparse's convention).
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import sys
import textwrap
import types
import typing
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple, Type

import yaml

_NONE_WORDS = ("none", "null")
_TRUE_WORDS = ("1", "true", "yes", "on")
_FALSE_WORDS = ("0", "false", "no", "off")


def field_docs(cls: type) -> Dict[str, str]:
    """Help text of every field of a dataclass, from its docstring or comment in the class source."""
    docs: Dict[str, str] = {}
    for klass in reversed(cls.__mro__):  # subclasses override the docs of their bases
        if not dataclasses.is_dataclass(klass):
            continue
        try:
            source = textwrap.dedent(inspect.getsource(klass))
        except (OSError, TypeError):
            continue
        lines = source.splitlines()
        class_def = ast.parse(source).body[0]
        body = class_def.body
        for index, node in enumerate(body):
            if not isinstance(node, ast.AnnAssign) or not isinstance(node.target, ast.Name):
                continue
            name = node.target.id
            following = body[index + 1] if index + 1 < len(body) else None
            if (
                isinstance(following, ast.Expr)
                and isinstance(following.value, ast.Constant)
                and isinstance(following.value.value, str)
            ):
                docs[name] = inspect.cleandoc(following.value.value)
                continue
            comment = _comment_for(lines, node.lineno - 1, node.end_lineno - 1)
            if comment:
                docs[name] = comment
    return docs


def _comment_for(lines: List[str], first: int, last: int) -> str:
    trailing = [line.split("#", 1)[1].strip() for line in lines[first : last + 1] if "#" in line]
    if trailing:
        return " ".join(trailing)
    above = []
    row = first - 1
    while row >= 0 and lines[row].strip().startswith("#"):
        above.insert(0, lines[row].strip().lstrip("#").strip())
        row -= 1
    return " ".join(above)


def _parse_bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in _TRUE_WORDS:
        return True
    if lowered in _FALSE_WORDS:
        return False
    raise argparse.ArgumentTypeError(f"expected a boolean ({'/'.join(_TRUE_WORDS + _FALSE_WORDS)}), got {text!r}")


def _optional(parse):
    def parse_optional(text: str):
        return None if text.strip().lower() in _NONE_WORDS else parse(text)

    parse_optional.__name__ = getattr(parse, "__name__", "value")
    return parse_optional


def _unwrap_optional(annotation) -> Tuple[Any, bool]:
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = [arg for arg in typing.get_args(annotation) if arg is not type(None)]
        if len(args) == 1 and len(typing.get_args(annotation)) == 2:
            return args[0], True
    return annotation, False


def _flag_kwargs(annotation) -> Dict[str, Any]:
    """argparse keyword arguments for one field type (bool, int, float, str, Literal, List, Optional)."""
    inner, optional = _unwrap_optional(annotation)
    origin = typing.get_origin(inner)
    if origin in (list, List, tuple, Sequence):
        (item,) = typing.get_args(inner)[:1] or (str,)
        return dict(nargs="*", type=_flag_kwargs(item)["type"], metavar=item.__name__.upper())
    if origin is typing.Literal:
        choices = list(typing.get_args(inner))
        kwargs = dict(type=type(choices[0]), choices=choices + ([None] if optional else []))
        if optional:
            kwargs["type"] = _optional(type(choices[0]))
        return kwargs
    if inner is bool:
        # `--flag` alone means true; `--flag false` is accepted too (handy in generated command lines); an
        # Optional[bool] also takes `none` (its default usually means "decide by yourself")
        return dict(nargs="?", const=True, type=_optional(_parse_bool) if optional else _parse_bool, metavar="BOOL")
    parse = {int: int, float: float, str: str}.get(inner)
    if parse is None:
        raise TypeError(f"unsupported field type {annotation!r}; use bool, int, float, str, Literal, List or Optional")
    return dict(type=_optional(parse) if optional else parse, metavar=inner.__name__.upper())


def _plain(value: Any) -> Any:
    """A dataclass field's value in YAML's types (paths as strings, tuples as lists)."""
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    return value


def _default_text(field: dataclasses.Field) -> str:
    if field.default is not dataclasses.MISSING:
        return repr(field.default)
    if field.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        return repr(field.default_factory())  # type: ignore[misc]
    return "required"


class DataclassArgumentParser(argparse.ArgumentParser):
    """argparse over several config dataclasses, plus ``--config`` for a YAML run preset."""

    def __init__(
        self,
        dataclass_types: Sequence[Type],
        *,
        preset_dirs: Sequence[Path] = (),
        preset_only: Sequence[Type] = (),
        **kwargs,
    ):
        """``preset_only``: dataclasses whose fields a preset may set (type-checked, then dropped) but that get
        no flag and no instance; lets one program read presets written for another (the aux peer reads the
        trainers' presets) while a misspelt key still ends the program."""
        kwargs.setdefault("formatter_class", argparse.RawDescriptionHelpFormatter)
        kwargs.setdefault("argument_default", argparse.SUPPRESS)  # so we know which flags were given
        super().__init__(**kwargs)
        self.dataclass_types = list(dataclass_types)
        self.preset_dirs = [Path(d) for d in preset_dirs]
        self._owner: Dict[str, Type] = {}
        self._parsers: Dict[str, Dict[str, Any]] = {}
        self.add_argument(
            "--config",
            metavar="PRESET_OR_YAML",
            help="run preset: a name from "
            + ", ".join(str(d) for d in self.preset_dirs)
            + " or a path to a YAML file of flag: value pairs; flags given on the command "
            "line override it",
        )
        self.add_argument(
            "--print_config",
            action="store_true",
            default=False,
            help="print the resolved settings (defaults < --config preset < flags) as a YAML run preset, then exit",
        )
        for cls in self.dataclass_types:
            self._add_dataclass(cls)
        for cls in preset_only:
            self._add_preset_only(cls)

    def _add_dataclass(self, cls: Type) -> None:
        docs = field_docs(cls)
        group = self.add_argument_group(cls.__name__, (cls.__doc__ or "").strip().splitlines()[0])
        hints = typing.get_type_hints(cls)
        for field in dataclasses.fields(cls):
            if not field.init or field.name.startswith("_"):
                continue
            if field.name in self._owner:
                raise ValueError(
                    f"field {field.name} is defined by both {self._owner[field.name].__name__} "
                    f"and {cls.__name__}; flag names must be unique"
                )
            self._owner[field.name] = cls
            kwargs = _flag_kwargs(hints[field.name])
            self._parsers[field.name] = kwargs
            help_text = docs.get(field.name, "").replace("%", "%%")
            kwargs["help"] = f"{help_text} (default: {_default_text(field)})".strip()
            group.add_argument(f"--{field.name}", dest=field.name, **kwargs)

    def _add_preset_only(self, cls: Type) -> None:
        hints = typing.get_type_hints(cls)
        for field in dataclasses.fields(cls):
            if field.init and field.name not in self._owner:
                # owned by a class that is never constructed, so parse_into_dataclasses drops the value
                self._owner[field.name] = cls
                self._parsers[field.name] = _flag_kwargs(hints[field.name])

    def known_fields(self) -> List[str]:
        return sorted(self._owner)

    def load_preset(self, name_or_path: str) -> Dict[str, Any]:
        """Read a YAML run preset; unknown keys end the program with a list of the valid ones."""
        path = Path(name_or_path)
        if not path.suffix:
            candidates = [d / f"{name_or_path}.yaml" for d in self.preset_dirs]
            path = next((c for c in candidates if c.exists()), path)
        if not path.is_file():
            available = sorted(p.stem for d in self.preset_dirs if d.is_dir() for p in d.glob("*.yaml"))
            self.error(
                f"--config {name_or_path}: no such preset or YAML file; available presets: "
                f"{', '.join(available) or 'none'} (or give a path to a .yaml file)"
            )
        try:
            values = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as e:
            self.error(f"--config {path}: not valid YAML ({e})")
        if not isinstance(values, dict):
            self.error(f"--config {path}: expected a mapping of flag names to values, got {type(values).__name__}")
        unknown = sorted(set(values) - set(self._owner))
        if unknown:
            self.error(
                f"--config {path}: unknown keys {', '.join(unknown)}; valid keys are the flag names: "
                f"{', '.join(self.known_fields())}"
            )
        return {name: self._coerce(path, name, value) for name, value in values.items()}

    def _coerce(self, path: Path, name: str, value: Any) -> Any:
        """Check a preset value exactly as if it had been given on the command line."""
        kwargs = self._parsers[name]
        try:
            if kwargs.get("nargs") == "*":
                items = value.split() if isinstance(value, str) else value
                if not isinstance(items, list):
                    raise argparse.ArgumentTypeError(f"expected a list, got {value!r}")
                return [kwargs["type"](str(item)) for item in items]
            if value is None:
                return None
            parsed = kwargs["type"]("true" if value is True else "false" if value is False else str(value))
        except (argparse.ArgumentTypeError, ValueError) as e:
            self.error(f"--config {path}: invalid value for {name}: {e}")
        if "choices" in kwargs and parsed not in kwargs["choices"]:
            self.error(
                f"--config {path}: invalid value for {name}: {value!r}; choose from "
                f"{', '.join(map(str, kwargs['choices']))}"
            )
        return parsed

    def parse_into_dataclasses(self, argv: Optional[Sequence[str]] = None) -> Tuple[Any, ...]:
        """Parse argv (sys.argv by default) into one instance per dataclass type, validated."""
        namespace = vars(self.parse_args(argv))
        print_config = namespace.pop("print_config", False)
        values = self.load_preset(namespace.pop("config")) if namespace.get("config") else {}
        namespace.pop("config", None)
        values.update(namespace)
        instances = []
        for cls in self.dataclass_types:
            own = {name: value for name, value in values.items() if self._owner.get(name) is cls}
            try:
                instances.append(cls(**own))
            except (ValueError, TypeError, OSError) as e:  # OSError: a path that does not exist (--dataset)
                self.error(str(e))
        if print_config:
            sys.stdout.write(self.as_preset(instances))
            self.exit(0)
        return tuple(instances)

    def as_preset(self, instances: Sequence[Any]) -> str:
        """The validated settings as a YAML run preset that ``--config`` reads back."""
        settings = {}
        for instance in instances:
            for field in dataclasses.fields(instance):
                if field.init and not field.name.startswith("_"):
                    value = getattr(instance, field.name)
                    settings[field.name] = _plain(value)
        return yaml.safe_dump(settings, sort_keys=False)
