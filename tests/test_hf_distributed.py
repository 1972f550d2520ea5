"""fmoe.hf.convert with ep_size=2 on real gloo processes equals one process; export gathers the experts."""
import pytest

pytest.importorskip("transformers")

from tests import hf_workers  # noqa: E402
from tests.dist_utils import run_ranks  # noqa: E402


def test_ep2_equals_one_process_and_exports(tmp_path):
    """Qwen3-MoE (plain routed experts) and DeepSeek-V3 (groups, frozen bias, shared experts)."""
    run_ranks(hf_workers.check_ep_matches_one_process, 2, ["qwen3_moe", "deepseek_v3"], str(tmp_path))
