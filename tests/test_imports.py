"""The dependency direction of docs/architecture.md ("Layers"), enforced: `lint-imports` checks
the contracts in pyproject.toml over every import of the package, function-local ones included."""
import os
import subprocess
import sys
import tomllib

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_every_import_contract_is_kept():
    lint_imports = os.path.join(os.path.dirname(sys.executable), "lint-imports")
    result = subprocess.run([lint_imports, "--no-cache", "--no-logo"], cwd=ROOT,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


@pytest.mark.parametrize("contract", ["layers", "scheduler-pure", "fastapi-in-http", "no-cycles"])
def test_the_contracts_docs_architecture_promises_are_configured(contract):
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        contracts = tomllib.load(f)["tool"]["importlinter"]["contracts"]
    assert contract in {c["id"] for c in contracts}
