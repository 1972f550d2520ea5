"""experts_implementation="fmoe" under transformers' own expert parallelism (#53, item 4), on 2 gloo ranks
against one process: transformers shards each experts module's tensors over the EP ranks and calls the
experts forward (fmoe's, through its ExpertsInterface) with this rank's rows and local expert ids.

transformers 5.24 runs EP only where `ep_size` divides `fsdp_size * tp_size`, so `DistributedConfig(ep_size=2)`
alone is refused by transformers itself; EP over 2 ranks is `DistributedConfig(tp_size=2, ep_size=2)` (the
dense layers split by the family's tensor plan), whose no-grad forward takes transformers' all-reduce EP and
whose training forward its all-to-all EP."""
import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.distributed")

import fmoe.integrations.hf  # noqa: E402,F401 (registers "fmoe")
from tests import seam_workers  # noqa: E402
from tests.dist_utils import run_ranks  # noqa: E402
from tests.hf_families import (assert_close_fp32, assert_same_run, build_error, forward_backward, output,  # noqa: E402
                               tiny, tokens)

# The lean path (transformers' default gate, SiLU) and the module's own gate between two GEMMs (gpt-oss:
# transposed, biased, clamped SwiGLU).
NAMES = ["qwen3_moe", "gpt_oss"]


@pytest.mark.parametrize("name", NAMES)
def test_family_fmoe_experts_under_transformers_ep2_equal_one_process(name, tmp_path):
    if build_error(name):
        pytest.fail(build_error(name))
    tiny(name).save_pretrained(tmp_path / "model")
    reference = type(tiny(name)).from_pretrained(tmp_path / "model").eval()
    ids = tokens()
    with torch.no_grad():
        want_inference = output(reference, ids)
    want = forward_backward(reference, ids)
    run_ranks(seam_workers.transformers_ep, 2, str(tmp_path / "model"), "fmoe", str(tmp_path / "out.pt"))
    got = torch.load(tmp_path / "out.pt")
    assert got["calls"] > 0, "transformers never called fmoe's experts forward"
    assert_close_fp32(got["inference"], want_inference, f"{name} under transformers' all-reduce EP")
    assert_same_run((got["y"], got["grads"]), want, f"{name} under transformers' all-to-all EP")
