"""Each model family is keyed in one place: its record in its module of
``jaxserve/models/families/``. Its ``model_type`` and architecture names appear in no other
module of the package, and every fixture model's family is in the registry."""

from __future__ import annotations

import ast
import importlib
import json
import pkgutil
from pathlib import Path

import jaxserve.models.families as families_package
from jaxserve.models.families.registry import families
from tests.conftest import FIXTURES

ROOT = Path(__file__).parents[1]
# Names that are a family's and also something else's: the server's tool-call and reasoning
# parsers are named after the model makers' formats, not keyed by model_type.
OTHER_MEANINGS = {"mistral": "jaxserve/server", "qwen3": "jaxserve/server"}


def family_modules() -> dict[str, Path]:
    """model_type -> the file of the module whose FAMILIES lists it."""
    found = {}
    for info in pkgutil.iter_modules(families_package.__path__):
        module = importlib.import_module(f"{families_package.__name__}.{info.name}")
        for family in getattr(module, "FAMILIES", ()):
            assert module.__file__ is not None
            found[family.model_type] = Path(module.__file__)
    return found


def string_constants(path: Path) -> set[str]:
    return {
        node.value
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Constant) and isinstance(node.value, str)
    }


def test_a_family_is_keyed_only_in_its_module() -> None:
    modules = family_modules()
    assert set(modules) == set(families())
    constants = {path: string_constants(path) for path in sorted((ROOT / "jaxserve").rglob("*.py"))}
    offenders = []
    for model_type, family in families().items():
        for key in (model_type, *family.architectures):
            offenders += [
                f"{path.relative_to(ROOT)} names {key!r}, keyed in {modules[model_type].name}"
                for path, strings in constants.items()
                if key in strings
                and path != modules[model_type]
                and not str(path.relative_to(ROOT)).startswith(OTHER_MEANINGS.get(key, "//"))
            ]
    assert not offenders, offenders


def test_every_fixture_model_is_a_registered_family() -> None:
    configs = sorted(FIXTURES.glob("*/config.json"))
    assert configs
    for path in configs:
        raw = json.loads(path.read_text())
        family = families().get(raw["model_type"])
        assert family is not None, f"{path}: model_type {raw['model_type']!r} is not registered"
        assert set(raw["architectures"]) <= set(family.architectures), path
