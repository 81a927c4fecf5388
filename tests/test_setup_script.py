"""scripts/setup.sh's system checks on macOS, run here with a fake `uname` (MESH_SETUP_CHECK_ONLY stops it before the
venv): no apt, clang from Apple's command-line tools, Python 3.11+, and a clear message for whatever is missing."""
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BASH = shutil.which("bash")


def _tool(bin_dir: Path, name: str, body: str) -> None:
    path = bin_dir / name
    path.write_text(f"#!{BASH}\n{body}\n")
    path.chmod(0o755)


def run_setup(tmp_path: Path, *, system: str, tools: dict[str, str]) -> subprocess.CompletedProcess:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "dirname").symlink_to(shutil.which("dirname"))
    _tool(bin_dir, "uname", f"echo {system}")
    _tool(bin_dir, "apt-get", f"touch {tmp_path}/apt-was-run; exit 1")
    for name, body in tools.items():
        _tool(bin_dir, name, body)
    env = {"PATH": str(bin_dir), "MESH_SETUP_CHECK_ONLY": "1", "HOME": str(tmp_path)}
    return subprocess.run([BASH, str(ROOT / "scripts/setup.sh")], env=env, capture_output=True, text=True, timeout=60)


PYTHON_OK = {"python3": f'exec {sys.executable} "$@"'}
CLT = {"xcode-select": "echo /Library/Developer/CommandLineTools", "clang": "echo 'Apple clang version 16.0.0'"}


def test_a_mac_with_the_command_line_tools_and_python_passes_without_apt(tmp_path):
    r = run_setup(tmp_path, system="Darwin", tools={**CLT, **PYTHON_OK})
    assert r.returncode == 0, r.stderr
    assert "Linux-only" in r.stderr
    assert not (tmp_path / "apt-was-run").exists()


def test_a_mac_without_the_command_line_tools_is_told_how_to_get_clang(tmp_path):
    r = run_setup(tmp_path, system="Darwin", tools={"xcode-select": "exit 2", **PYTHON_OK})
    assert r.returncode == 1
    assert "xcode-select --install" in r.stderr and "Python" not in r.stderr
    assert not (tmp_path / "apt-was-run").exists()


def test_a_mac_with_an_old_python_is_told_which_one_to_install(tmp_path):
    r = run_setup(tmp_path, system="Darwin", tools={**CLT, "python3": "exit 1"})
    assert r.returncode == 1
    assert "Python 3.11 or newer" in r.stderr and "brew install python@3.12" in r.stderr
    assert "xcode-select" not in r.stderr


def test_linux_without_clang_names_the_apt_packages(tmp_path):
    r = run_setup(tmp_path, system="Linux", tools={"id": "echo 1000"})     # not root: it only says what is missing
    assert r.returncode == 0
    assert "missing clang iproute2" in r.stderr and "apt-get" in r.stderr
