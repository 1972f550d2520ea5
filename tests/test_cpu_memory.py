"""fmoe.observe.cpu_memory: after keep_freed_memory() glibc serves a large block from its heap (where a
freed one is kept for the next), not from a mapping of its own that free hands back to the
kernel. Each case runs in a fresh process: the setting is process-wide."""
import subprocess
import sys

import pytest

from fmoe.observe import cpu_memory

pytestmark = pytest.mark.skipif(not cpu_memory.available(), reason="needs glibc's malloc")

# Prints whether a fresh 64 MiB tensor (past glibc's largest mmap threshold) lies in [heap].
WHERE = """
def in_heap():
    import torch
    t = torch.empty(16 * 2 ** 20)
    address = t.data_ptr()
    for line in open("/proc/self/maps"):
        if line.rstrip().endswith("[heap]"):
            start, end = (int(v, 16) for v in line.split()[0].split("-"))
            if start <= address < end:
                return True
    return False
print("heap" if in_heap() else "mapped")
"""


def placement(prelude: str, *args) -> str:
    out = subprocess.run([sys.executable, "-c", prelude + WHERE, *args], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.split()[-1]


def test_large_blocks_come_from_the_heap_only_when_asked():
    assert placement("") == "mapped"
    assert placement("from fmoe import cpu_memory\ncpu_memory.keep_freed_memory()\n") == "heap"
    assert placement("from fmoe import cpu_memory\ncpu_memory.keep_freed_memory()\ncpu_memory.restore()\n") == "mapped"


def test_fmoe_train_keeps_freed_memory_when_asked(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("".join(f"def f{i}(x):\n    return x * {i}\n\n" for i in range(200)))
    args = ["train", "--d-model", "32", "--layers", "1", "--heads", "2", "--seq-len", "16", "--num-expert", "2",
            "--d-hidden", "32", "--batch-size", "2", "--steps", "2", "--data", str(corpus), "--out",
            str(tmp_path / "run"), "--no-progress"]
    train = "import sys\nfrom fmoe.app.cli import main\nassert main(sys.argv[1:]) in (None, 0)\n"
    assert placement(train, *args, "--keep-freed-memory") == "heap"
    assert placement(train, *args) == "mapped"
