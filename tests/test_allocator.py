"""The allocator setting: large freed tensors are reused without new page faults."""

import resource
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc mallopt")

# A decoder layer's pattern of activations (6k rows of SmolLM2 widths: 14-74 MB each, above
# glibc's default mmap threshold) over two warm-up steps, then the minor page faults of four
# more steps of other sizes. A fresh process: the setting is process-wide.
_PROBE = textwrap.dedent("""
    import resource, sys, threading, torch
    from tokenloom.allocator import keep_freed_memory
    if sys.argv[1] == "on":
        assert keep_freed_memory()
    def faults():
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    def step(rows):
        x = torch.ones(rows, 576)
        for _ in range(4):
            qkv = torch.ones(rows, 960); o = torch.ones(rows, 576); del qkv
            gate_up = torch.ones(rows, 3072); act = torch.ones(rows, 1536); del gate_up
            x = torch.ones(rows, 576) + o; del act, o
    def run():
        for rows in (6000, 4000):
            step(rows)
        before = faults()
        for rows in (5000, 6000, 3000, 6000):
            step(rows)
        print(faults() - before)
    if sys.argv[2] == "thread":            # the async engine steps on its own thread
        worker = threading.Thread(target=run)
        worker.start()
        worker.join()
    else:
        run()
""")


def _faults(mode: str, where: str) -> int:
    out = subprocess.run([sys.executable, "-c", _PROBE, mode, where], capture_output=True, text=True, check=True)
    return int(out.stdout.split()[-1])


@pytest.mark.parametrize("where", ["main", "thread"])
def test_freed_large_tensors_are_reused_without_page_faults(where):
    touched = 4 * 20 * 6000 * 4 // resource.getpagesize()     # ~ pages the four steps write (4 layers of ~20k floats per row)
    off, on = _faults("off", where), _faults("on", where)
    assert off > touched // 4, f"default glibc should fault fresh pages in ({off} faults, ~{touched} pages written)"
    # heap fragmentation costs the odd fresh block (measured 2-9k faults main, 18-30k thread)
    assert on < off // 5, f"kept memory should be reused without faults ({on} faults vs {off} without)"


def test_applied_once_per_process(monkeypatch):
    from tokenloom import allocator
    calls = []
    monkeypatch.setattr(allocator, "_done", None)
    monkeypatch.setattr(allocator, "_apply", lambda: calls.append(1) or True)
    assert allocator.keep_freed_memory() and allocator.keep_freed_memory()
    assert calls == [1], "applied once per process"


def test_opt_out(monkeypatch):
    from tokenloom import allocator
    monkeypatch.setenv("TOKENLOOM_KEEP_FREED_MEMORY", "0")
    assert allocator._apply() is False
