"""fmoe.hf.convert with ep_size=2 on real gloo processes equals one process; export gathers the experts."""
import pytest

pytest.importorskip("transformers")

from tests import hf_workers  # noqa: E402
from tests.dist_utils import run_ranks  # noqa: E402


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_ep2_equals_one_process_and_exports(family, tmp_path):
    run_ranks(hf_workers.check_ep_matches_one_process, 2, family, str(tmp_path))
