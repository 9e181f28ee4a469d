"""docs/reliability.md is generated from tests/reliability_catalogue.py's CASES: the page is up to date, and every
case names a test function that exists (so every line of the page is injected and asserted by a test)."""
import ast
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import reliability_catalogue as catalogue  # noqa: E402

TESTS = Path(__file__).resolve().parent


def test_committed_page_is_up_to_date():
    assert catalogue.DOC.read_text(encoding="utf-8") == catalogue.render(), (
        "docs/reliability.md is stale: run python tests/reliability_catalogue.py")


def _functions(file: Path) -> set[str]:
    tree = ast.parse(file.read_text())
    return {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}


@pytest.mark.parametrize("case", catalogue.CASES, ids=[c.test.split("::")[1][:60] for c in catalogue.CASES])
def test_every_case_names_a_test_that_exists(case):
    file, _, func = case.test.partition("::")
    assert (TESTS / file).is_file(), case.test
    assert func.startswith("test_") and func in _functions(TESTS / file), case.test


def test_check_and_write(tmp_path, capsys):
    out = tmp_path / "reliability.md"
    assert catalogue.main(["--check", "--out", str(out)]) == 1
    assert catalogue.main(["--out", str(out)]) == 0
    assert catalogue.main(["--check", "--out", str(out)]) == 0
    assert out.read_text().startswith("# Reliability") and "| 3 | stopped on request" in out.read_text()
