"""fmoe.integrations.hf.convert with ep_size=2 on real gloo processes equals one process; export and
save_pretrained gather the experts."""
import pytest

pytest.importorskip("transformers")

from tests import hf_workers  # noqa: E402
from tests.dist_utils import run_ranks  # noqa: E402


def test_ep2_equals_one_process_and_exports(tmp_path):
    """Qwen3-MoE (plain routed experts) and DeepSeek-V3 (groups, frozen bias, shared experts)."""
    run_ranks(hf_workers.check_ep_matches_one_process, 2, ["qwen3_moe", "deepseek_v3"], str(tmp_path))


def test_load_at_ep2_reads_in_turns_and_keeps_own_experts(tmp_path):
    from tests.hf_models import tiny
    tiny("qwen3_moe").save_pretrained(tmp_path / "ckpt")
    (tmp_path / "log").mkdir()
    run_ranks(hf_workers.check_load_takes_turns, 2, str(tmp_path / "ckpt"), str(tmp_path / "log"))


def test_load_refuses_bad_input(tmp_path):
    import fmoe.integrations.hf
    with pytest.raises(ValueError, match="config.json"):
        fmoe.integrations.hf.load(tmp_path)
    with pytest.raises(ValueError, match="ep_size must be a positive int"):
        fmoe.integrations.hf.load(tmp_path, ep_size=0) if (tmp_path / "config.json").write_text("{}") else None
    with pytest.raises(ValueError, match="needs torch.distributed"):
        fmoe.integrations.hf.load(tmp_path, ep_size=2)
