"""The documentation is kept true by the test run: the site builds with ``--strict``, the
reference pages are what the code generates, every YAML block that claims to be a spec
validates, the README's quickstart is the shipped spec and its test command is CI's."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from grpo_core import docs_gen
from grpo_core.errors import SpecError
from grpo_core.spec import load_spec

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
#: Every Markdown file a reader is sent to: the README, the site's pages and the included files.
PAGES = [README, ROOT / "CONTRIBUTING.md", ROOT / "bench" / "README.md", *sorted(DOCS.rglob("*.md"))]


def yaml_blocks(text: str) -> list[str]:
    return re.findall(r"^```yaml\n(.*?)^```", text, re.S | re.M)


def spec_blocks() -> list[tuple[str, str]]:
    """``(file, block)`` of every YAML block whose first line starts with ``# spec``."""
    return [(str(page.relative_to(ROOT)), block) for page in PAGES
            for block in yaml_blocks(page.read_text(encoding="utf-8")) if block.startswith("# spec")]


def validate_block(block: str, tmp_path: Path) -> None:
    path = tmp_path / "spec.yaml"
    path.write_text(block, encoding="utf-8")
    load_spec(path, external_plugins=False)


def section(text: str, heading: str) -> str:
    start = text.index(heading + "\n")
    end = text.find("\n## ", start + len(heading))
    return text[start:] if end < 0 else text[start:end]


# --------------------------------------------------------------------------- the site
def test_the_site_builds_strict(tmp_path):
    """``mkdocs build --strict``: no broken link or anchor, no page outside the navigation, no
    include that misses; offline (no web font is requested)."""
    site = tmp_path / "site"
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={"NO_MKDOCS_2_WARNING": "1", "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)})
    assert done.returncode == 0, done.stderr[-4000:]
    for page in ("index.html", "concepts.html", "reference/spec.html", "reference/plugins.html",
                 "reference/api.html", "benchmarks.html", "contributing.html", "guides/multi-gpu.html"):
        assert (site / page).is_file(), page
    html = (site / "benchmarks.html").read_text(encoding="utf-8")
    assert "Issue 17: the grid against TRL" in html  # bench/README.md is included, not linked
    assert "--8&lt;--" not in html and "--8<--" not in html
    assert "Your first plugin: a reward function" in (site / "contributing.html").read_text(encoding="utf-8")
    assert "stochastic_rounding" in (site / "concepts.html").read_text(encoding="utf-8")  # seeds.py included
    assert "fonts.googleapis" not in (site / "index.html").read_text(encoding="utf-8")
    trl = (site / "coming-from-trl.html").read_text(encoding="utf-8")  # the generated table is included
    assert "use_bias_correction_kl" in trl and "Ignored fields" in trl and "--8&lt;--" not in trl
    assert not (site / "reference" / "trl.html").exists()  # not a page of its own


def test_the_trl_table_lists_every_field_of_the_door():
    from grpo_core.trl import FIELDS

    page = docs_gen.trl_page()
    for entry in FIELDS:
        assert f"| `{entry.name}` |" in page, entry.name


# --------------------------------------------------------------------------- generated reference
def test_the_generated_reference_is_current(tmp_path):
    docs_gen.generate(tmp_path)
    for name in docs_gen.PAGES:
        committed = DOCS / "reference" / name
        assert committed.is_file(), f"docs/reference/{name} is missing: run `{docs_gen.COMMAND}` to regenerate"
        assert (tmp_path / name).read_text(encoding="utf-8") == committed.read_text(encoding="utf-8"), (
            f"docs/reference/{name} is stale: run `{docs_gen.COMMAND}` to regenerate it, and commit it")


def test_the_spec_reference_has_every_key_with_type_and_default():
    from pydantic import BaseModel

    from grpo_core.spec.models import Spec

    page = docs_gen.spec_page()
    seen: set[type] = set()

    def walk(model: type[BaseModel]) -> None:
        if model in seen:
            return
        seen.add(model)
        for name, field in model.model_fields.items():
            row = f"| `{name}` | `{docs_gen._cell(docs_gen.type_name(field.annotation))}` | "
            assert row + docs_gen._cell(docs_gen.default_text(field)) in page, (model.__name__, name)
            for nested in docs_gen._models_in(field.annotation):
                walk(nested)

    walk(Spec)
    assert len(seen) > 20  # the nested sections were walked
    # the two options the issue found documented nowhere, with their defaults
    assert "| `mu` | `int` | `1` |" in page and "| `entropy_coef` | `float` | `0.0` |" in page


def test_the_plugin_reference_has_every_builtin_and_its_options():
    from grpo_core.kinds import KINDS
    from grpo_core.plugin_manager import load_plugins

    page = docs_gen.plugins_page()
    registry = load_plugins(external=False).registry
    for kind in KINDS:
        for component in registry.components(kind):
            assert f"\n### `{component.name}` {{#" in page, (kind, component.name)
            for option in (component.options.model_fields if component.options else {}):
                assert f"| `{option}` |" in page, (component.name, option)
    # the README's old table wrote `backend_options: {decode: generate}`; the option is the slot's own key
    assert "| `decode` |" in section(page, "### `hf` {#rollout-backend-hf}")
    assert not [p for p in PAGES if "backend_options" in p.read_text(encoding="utf-8")]


def test_the_api_reference_has_the_public_plugin_surface():
    from grpo_core import contracts, groups

    page = docs_gen.api_page()
    for name in [*contracts.__all__, *groups.__all__]:
        assert f"### `{name}`" in page, name
    assert "## `grpo_core.hookimpl`" in page
    assert "per_token(per_row: 'Tensor', mask: 'Tensor') -> 'Tensor'" in page  # a signature, from the code


def test_a_type_is_written_as_a_reader_writes_it():
    from typing import Literal

    assert docs_gen.type_name(int | None) == "int | null"
    assert docs_gen.type_name(list[str]) == "list[str]"
    assert docs_gen.type_name(Literal["token", "sequence"]) == '"token" | "sequence"'
    assert docs_gen.type_name(Path) == "path"
    assert docs_gen._cell("a | b\n c") == "a \\| b c"
    assert docs_gen._anchor("k1+") != docs_gen._anchor("k1")


# --------------------------------------------------------------------------- specs in the docs
SPECS = spec_blocks()


def test_the_docs_hold_spec_blocks():
    assert len(SPECS) >= 3, SPECS  # the marker is in use, so the next test checks something


@pytest.mark.parametrize(("where", "block"), SPECS, ids=[f"{w}:{i}" for i, (w, _) in enumerate(SPECS)])
def test_every_spec_block_in_the_docs_validates(where, block, tmp_path):
    validate_block(block, tmp_path)


def test_a_wrong_spec_block_is_caught(tmp_path):
    """The check above can fail: a block with a misspelt key does not validate."""
    where, block = SPECS[0]
    broken = block.replace("rewards:", "reward:", 1)
    assert broken != block
    with pytest.raises(SpecError, match="reward"):
        validate_block(broken, tmp_path)


# --------------------------------------------------------------------------- the README
def test_the_readme_is_short():
    assert len(README.read_text(encoding="utf-8").splitlines()) <= 300


def test_the_readme_quickstart_is_the_shipped_spec():
    text = README.read_text(encoding="utf-8")
    shipped = (ROOT / "specs" / "quickstart.yaml").read_text(encoding="utf-8")
    brief = section(text, "## The spec in brief")
    (block,) = [b for b in yaml_blocks(brief)]
    assert block == shipped
    assert yaml.safe_load(block)["train"]["steps"] == yaml.safe_load(shipped)["train"]["steps"]
    # the site's copy is included from the file, not pasted
    assert '--8<-- "specs/quickstart.yaml"' in (DOCS / "getting-started.md").read_text(encoding="utf-8")


def _commands(text: str) -> list[str]:
    block = re.search(r"```bash\n(.*?)```", section(text, "## Two commands"), re.S).group(1)
    return [line for line in block.splitlines() if line.startswith("pip install")]


def test_ci_runs_exactly_the_readme_test_command():
    readme = _commands(README.read_text(encoding="utf-8"))
    assert len(readme) == 2 and '".[test]"' in readme[1]
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8").strip().splitlines()[-1]
    assert ci == readme[1]
    assert _commands((DOCS / "getting-started.md").read_text(encoding="utf-8")) == readme


def test_the_readme_links_resolve():
    text = README.read_text(encoding="utf-8")
    targets = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", text)
    local = [t for t in targets if not t.startswith(("http://", "https://"))]
    assert len(local) > 10
    for target in local:
        assert (ROOT / target).exists(), target


def test_the_docs_extra_is_installed_by_the_test_command():
    text = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    test = re.search(r"^test = \[(.*?)^\]", text, re.S | re.M).group(1)
    docs = re.search(r"^docs = \[(.*?)\]", text, re.M).group(1)
    assert '"grpo-core[docs]"' in test
    assert '"mkdocs>=' in docs and '"mkdocs-material>=' in docs


def test_no_benchmark_row_is_copied_out_of_bench_readme():
    """The benchmarks live in one place (bench/README.md, included by docs/benchmarks.md)."""
    bench = {line.strip() for line in (ROOT / "bench" / "README.md").read_text(encoding="utf-8").splitlines()
             if line.strip().startswith("|") and set(line.strip()) - set("|-: ")}
    assert len(bench) > 20
    copies = [(str(page.relative_to(ROOT)), line.strip()) for page in PAGES if page.name != "README.md"
              or page.parent == ROOT for line in page.read_text(encoding="utf-8").splitlines()
              if line.strip() in bench]
    assert copies == []


def test_no_two_literal_types_list_the_same_values_in_another_order():
    """``typing`` caches ``Literal[...] | None`` by the set of values, so of two fields listing the
    same values in different orders, whichever module is imported first sets the order both
    show: the generated reference would then depend on import order."""
    import ast
    import re

    root = Path(__file__).resolve().parents[2]
    seen: dict[frozenset, tuple[tuple, str]] = {}
    for path in [*(root / "grpo_core").rglob("*.py"), *(root / "plugins").rglob("*.py")]:
        for match in re.finditer(r"Literal\[([^\[\]]+)\]", path.read_text(encoding="utf-8")):
            try:
                values = ast.literal_eval(f"({match.group(1)},)")
            except (ValueError, SyntaxError):
                continue
            where = f"{path.relative_to(root)}: Literal[{match.group(1)}]"
            first = seen.setdefault(frozenset(values), (values, where))
            assert first[0] == values, f"{where} lists the values of {first[1]} in another order"
