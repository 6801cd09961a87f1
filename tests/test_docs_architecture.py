"""docs/ARCHITECTURE.md stays true to the code.

- Every backticked `path.py::name` reference names a file that exists and a name defined in it: a
  module-level function, class or assignment, or `Class.member` for a method, nested class or class
  attribute. Files are read with `ast`; nothing is imported. Paths under `tests/` and `benchmarks/` are
  relative to the repository root, every other path to src/hf_concept (the rule the document states).
- Every backticked path ending in `.py` that has a folder in it names a file that exists.
- The file → families table lists every module of src/hf_concept/modeling, each with exactly the families
  whose `*_CODE` tuple in tests/conformance/families.py ships it (read with `ast` as well).
- The document cites no planning notes, issues or paths outside the repository.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "ARCHITECTURE.md"
PACKAGE = ROOT / "src" / "hf_concept"
FAMILIES_FILE = ROOT / "tests" / "conformance" / "families.py"
# Paths that start with one of these are relative to the repository root; all others to src/hf_concept.
ROOT_FOLDERS = ("tests/", "benchmarks/")
REFERENCE = re.compile(r"`([\w./-]+\.py)::([\w.]+)`")
BARE_PATH = re.compile(r"`([\w.-]+/[\w./-]*\.py)`")
# The heading of the file → families table, and its family columns with their tuple in families.py.
SHIPPING_HEADING = "Which family ships which modeling file"
FAMILY_TUPLES = {
    "ConceptMoE": "CONCEPTMOE_CODE",
    "DLCM": "DLCM_CODE",
    "Hidden Decoding": "HIDDEN_DECODING_CODE",
    "LSLM": "LSLM_CODE",
    "plain": "PLAIN_CODE",
}
SHIPPED_MARK = "✓"
FORBIDDEN = re.compile(r"DESIGN\.md|DESIGN" r" §|\bissue \d+|\.\./shared|HF_" r"NOTES")


def resolve(path_text: str) -> Path:
    """The file a reference's path names (see the module docstring for the rule)."""
    base = ROOT if path_text.startswith(ROOT_FOLDERS) else PACKAGE
    return base / path_text


def defined_names(path: Path) -> set[str]:
    """Names defined in `path`: module-level functions, classes and assigned names, and `Class.member`
    for the methods, nested classes and attributes of each module-level class."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    names: set[str] = set()
    for node in tree.body:
        names.update(_own_names(node))
        if isinstance(node, ast.ClassDef):
            for member in node.body:
                names.update(f"{node.name}.{name}" for name in _own_names(member))
    return names


def _own_names(node: ast.stmt) -> list[str]:
    """The names one statement defines at its own level."""
    if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
        return [node.name]
    if isinstance(node, ast.Assign):
        return [target.id for target in node.targets if isinstance(target, ast.Name)]
    if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
        return [node.target.id]
    return []


def reference_problem(path_text: str, name: str) -> str | None:
    """Why `path_text::name` is not a true reference, or None when it is."""
    path = resolve(path_text)
    if not path.is_file():
        return f"`{path_text}::{name}`: no file {path.relative_to(ROOT)}"
    if name not in defined_names(path):
        return f"`{path_text}::{name}`: {path.relative_to(ROOT)} defines no {name!r}"
    return None


def reference_problems(text: str) -> list[str]:
    """The problems of every `path.py::name` reference and every bare `folder/file.py` path in `text`."""
    problems = [
        problem
        for path_text, name in sorted(set(REFERENCE.findall(text)))
        if (problem := reference_problem(path_text, name)) is not None
    ]
    for path_text in sorted(set(BARE_PATH.findall(text))):
        if not resolve(path_text).is_file():
            problems.append(f"`{path_text}`: no file {resolve(path_text).relative_to(ROOT)}")
    return problems


def shipped_files() -> dict[str, set[str]]:
    """Family column name -> the modeling files its `*_CODE` tuple in families.py lists, starred tuples
    expanded (the tuples are literals: read with `ast`, not imported)."""
    tree = ast.parse(FAMILIES_FILE.read_text(encoding="utf-8"))
    tuples: dict[str, list[str]] = {}
    for node in tree.body:
        if not (isinstance(node, ast.Assign) and isinstance(node.value, ast.Tuple)):
            continue
        files: list[str] = []
        for element in node.value.elts:
            if isinstance(element, ast.Starred) and isinstance(element.value, ast.Name):
                files.extend(tuples[element.value.id])
            elif isinstance(element, ast.Constant) and isinstance(element.value, str):
                files.append(element.value)
        for target in node.targets:
            if isinstance(target, ast.Name):
                tuples[target.id] = files
    return {column: set(tuples[name]) for column, name in FAMILY_TUPLES.items()}


def shipping_table(text: str) -> dict[str, set[str]]:
    """Modeling file name -> the family columns marked for it, from the table under SHIPPING_HEADING."""
    lines = text.splitlines()
    start = next(
        index for index, line in enumerate(lines) if line.startswith("#") and SHIPPING_HEADING in line
    )
    rows = []
    for line in lines[start + 1 :]:
        if line.startswith("#"):
            break
        if line.startswith("|"):
            rows.append([cell.strip() for cell in line.strip().strip("|").split("|")])
    header, body = rows[0], [row for row in rows[2:] if row]
    columns = {index: name for index, name in enumerate(header) if name in FAMILY_TUPLES}
    assert set(columns.values()) == set(FAMILY_TUPLES), f"table columns {header} lack a family"
    table = {}
    for row in body:
        match = re.fullmatch(r"`modeling/([\w.]+\.py)`", row[0])
        assert match, f"first cell {row[0]!r} is not a backticked modeling/ path"
        table[match[1]] = {name for index, name in columns.items() if SHIPPED_MARK in row[index]}
    return table


def test_every_code_reference_names_something_that_exists():
    problems = reference_problems(DOC.read_text(encoding="utf-8"))
    assert not problems, "docs/ARCHITECTURE.md has references the code does not back:\n" + "\n".join(problems)


def test_the_checker_catches_a_made_up_reference():
    text = (
        "`modeling/routing.py::ratio_loss` `modeling/routing.py::no_such_function` "
        "`modeling/family_cache.py::FamilyCache.crop` `modeling/routing.py::RatioLossOutput.no_such_method` "
        "`modeling/no_such_module.py::anything` `conversion/nowhere.py` "
        "`tests/test_docs_architecture.py::test_the_checker_catches_a_made_up_reference`"
    )
    problems = reference_problems(text)
    bogus = ("no_such_function", "RatioLossOutput.no_such_method", "no_such_module.py", "nowhere.py")
    assert len(problems) == len(bogus), problems
    for name in bogus:
        assert any(name in problem for problem in problems), (name, problems)


def test_the_shipping_table_lists_every_modeling_file_with_its_families():
    table = shipping_table(DOC.read_text(encoding="utf-8"))
    files = {path.name for path in (PACKAGE / "modeling").glob("*.py")}
    assert not files - set(table), f"modeling files missing from the table: {sorted(files - set(table))}"
    assert not set(table) - files, f"table rows for files that do not exist: {sorted(set(table) - files)}"
    shipped = shipped_files()
    for name in sorted(files):
        expected = {family for family, shipping in shipped.items() if name in shipping}
        assert table[name] == expected, (
            f"{name}: the table marks {sorted(table[name])}, families.py {sorted(expected)}"
        )


def test_the_document_stands_on_the_repository_alone():
    found = FORBIDDEN.findall(DOC.read_text(encoding="utf-8"))
    assert not found, f"docs/ARCHITECTURE.md cites what the repository does not hold: {found}"
