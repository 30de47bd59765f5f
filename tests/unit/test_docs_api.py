"""The API reference (docs/api/, rendered by mkdocstrings when the site is built) names every public
module of the library and the model families, and nothing that does not exist."""
import re
from pathlib import Path

from test_import_graph import modules

REPO = Path(__file__).resolve().parents[2]


def public(name: str) -> bool:
    return not any(part.startswith("_") for part in name.split(".")[1:])


def documented() -> set[str]:
    """The modules the API pages render (``::: jaxtrain.x.y``; the families' folder as ``models.``)."""
    names = set()
    for page in (REPO / "docs" / "api").glob("*.md"):
        for target in re.findall(r"^::: ([\w.]+)$", page.read_text(), re.MULTILINE):
            names.add("jaxtrain." + target if target.startswith("models") else target)
    return names


def test_every_public_module_has_an_api_entry_and_every_entry_a_module():
    library = {name for name in modules() if public(name)}
    assert sorted(library - documented()) == []  # add it to its room's page in docs/api/
    assert sorted(documented() - library) == []


def test_every_api_page_is_in_the_sites_nav():
    nav = (REPO / "mkdocs.yml").read_text()
    assert [p.name for p in sorted((REPO / "docs" / "api").glob("*.md")) if f"api/{p.name}" not in nav] == []
