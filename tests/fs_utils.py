"""Real full and read-only disks for a test: a small tmpfs mounted in a user namespace, where the kernel
lets an unprivileged process make one (`unshare --user --map-root-user --mount`); root is not needed."""
import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def in_user_namespace(script: str, timeout: int = 300) -> subprocess.CompletedProcess:
    """Run the shell `script` in its own user and mount namespace (its mounts vanish with it), with this
    checkout's fmoe importable."""
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    return subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", script],
                          capture_output=True, text=True, timeout=timeout, env=env)


def can_mount_a_tmpfs() -> bool:
    try:
        return in_user_namespace("d=$(mktemp -d) && mount -t tmpfs -o size=16k tmpfs $d && umount $d",
                                 timeout=60).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


needs_tmpfs = pytest.mark.skipif(not can_mount_a_tmpfs(), reason="needs unshare and a user namespace to mount a tmpfs")
