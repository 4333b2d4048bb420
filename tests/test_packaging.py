"""The package must never shadow the standard library's `operator` module."""

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_stdlib_operator_imports_from_repo_root():
    code = "import operator, llmfleet.operator; print(operator.__file__); assert operator.itemgetter"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert Path(out.stdout.strip()).parent != REPO / "operator"
    assert "site-packages" not in out.stdout  # the stdlib copy, not a package of ours


def test_stdlib_operator_from_a_script_in_repo_root(tmp_path):
    script = REPO / "_check_operator_import.py"
    script.write_text("import operator, sys; sys.exit(0 if hasattr(operator, 'attrgetter') else 1)\n")
    try:
        subprocess.run([sys.executable, str(script)], cwd=REPO, check=True)
    finally:
        script.unlink()


def test_operator_package_is_namespaced():
    import llmfleet.operator
    import llmfleet.server

    assert llmfleet.operator.__name__ == "llmfleet.operator"
    assert Path(llmfleet.server.__file__).parent == REPO / "server"


def test_cli_help_runs_without_torch():
    code = (
        "import sys; from llmfleet.cli import main\n"
        "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
        "assert 'torch' not in sys.modules, 'llm-fleet --help imported torch'"
    )
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True, capture_output=True)


def test_python_dash_m_from_repo_root_keeps_stdlib_operator():
    """`python -m venv`/`python -m pytest` put the cwd first on sys.path before the stdlib's
    `collections` imports `operator`: a regular package named operator/ would break them."""
    assert not (REPO / "operator" / "__init__.py").exists()
    code = "import collections, operator; assert operator.__file__.endswith('operator.py')"
    subprocess.run([sys.executable, "-S", "-c", code], cwd=REPO, check=True)
    subprocess.run([sys.executable, "-m", "json.tool", "--help"], cwd=REPO, check=True, capture_output=True)


def test_version_is_the_projects():
    import tomllib

    import llmfleet

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert llmfleet.__version__ == project["version"]
    out = subprocess.run([sys.executable, "-m", "llmfleet.cli", "--version"], cwd=REPO, capture_output=True, text=True)
    assert out.stdout.strip() == f"llm-fleet {project['version']}"
