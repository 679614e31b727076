"""A script outside the CLI (``bench/``) ends on a signal in one line and 128 + the signal, as a CLI
command does (``cli.script.run_script``), not in Python's traceback."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from saem_gguf.cli.script import run_script

REPO = Path(__file__).resolve().parents[1]
# a script's closing ``__main__`` block (nothing after it), which must end it through run_script;
# bench_native.py's worker binds its own library before it imports saem_gguf, so there the
# parent alone imports run_script, inside the block
MAIN_BLOCK = re.compile(r'\nif __name__ == "__main__":\n((?:    .*\n|\n)+)\Z')


def test_every_bench_script_exits_through_run_script():
    """A new script's bare ``main()`` is caught here, not by a user pressing Ctrl-C."""
    scripts = [*REPO.glob("bench/*.py"), *REPO.glob("bench/device/*.py")]
    blocks = {p.name: MAIN_BLOCK.search(p.read_text(encoding="utf-8")) for p in scripts}
    bare = [name for name, m in blocks.items() if not m or "raise SystemExit(run_script(main))\n" not in m.group(1)]
    assert not bare, bare
    assert len(scripts) >= 17


def _raises(exc: BaseException):
    def main() -> int:
        raise exc
    return main


def test_ctrl_c_is_one_line_and_130(capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["bench_x.py"])
    assert run_script(_raises(KeyboardInterrupt())) == 130
    assert capsys.readouterr().err == "bench_x.py: interrupted\n"


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_sigterm_and_sighup_unwind_main_and_exit_128_plus_the_signal(sig, capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["bench_x.py"])
    before = signal.getsignal(sig)
    cleaned = []

    def main() -> int:
        try:
            os.kill(os.getpid(), sig)
            for _ in range(10**6):  # the handler runs at a bytecode of this loop
                pass
            return 0
        finally:
            cleaned.append(True)

    assert run_script(main) == 128 + sig
    assert cleaned == [True]
    assert capsys.readouterr().err == f"bench_x.py: terminated by {signal.Signals(sig).name}\n"
    assert signal.getsignal(sig) == before  # the script's handlers are put back


def test_main_exit_code_passes_through():
    assert run_script(lambda: 3) == 3
    assert run_script(lambda: None) == 0


def test_a_bench_script_terminated_mid_run_prints_one_line(tmp_path):
    """The real thing: a bench script in its own process, SIGTERM once it runs."""
    script = tmp_path / "bench_wait.py"
    script.write_text(textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {str(REPO)!r})
        from saem_gguf.cli.script import run_script
        def main():
            print("running", flush=True)
            time.sleep(60)
            return 0
        if __name__ == "__main__":
            raise SystemExit(run_script(main))
    """))
    p = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline() == "running\n"
        p.send_signal(signal.SIGTERM)
        _, err = p.communicate(timeout=30)
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate()
    assert p.returncode == 143, err
    assert err == "bench_wait.py: terminated by SIGTERM\n"
