"""Rank bodies for the EP tests of fmoe.integrations.hf (run by tests.dist_utils.run_ranks)."""
import copy

import torch
import transformers

import fmoe.integrations.hf
from tests.hf_models import tiny, tokens
from tests.test_hf_convert import TOL, hf_named_grads


def check_ep_matches_one_process(rank, world_size, families, folder):
    """check_family_ep for each family, in one pair of processes (spawning costs more than checking)."""
    for family in families:
        check_family_ep(rank, world_size, family, f"{folder}/{family}")


def check_family_ep(rank, world_size, family, folder):
    """Both ranks feed the same batch: logits equal transformers' own; each expert's gradient is the
    sum over the two ranks' tokens (2x one process), every other gradient one process's."""
    model = tiny(family)
    converted = fmoe.integrations.hf.convert(copy.deepcopy(model), ep_size=world_size)
    for _, block in fmoe.integrations.hf.converted_blocks(converted):
        assert block.moe.experts.w1_eDF.shape[0] * world_size == block.moe.tot_expert
    ids = tokens()
    kwargs = {"output_router_logits": True} if hasattr(model.config, "output_router_logits") else {}
    want = model(ids, labels=ids, **kwargs)
    want.loss.backward()
    got = converted(ids, labels=ids, **kwargs)
    got.loss.backward()
    torch.testing.assert_close(got.logits, want.logits, **TOL)
    torch.testing.assert_close(got.loss, want.loss, **TOL)
    got_grads = hf_named_grads(converted)       # gathers every block's expert gradients (a collective)
    for name, p in model.named_parameters():
        if p.grad is None:
            continue
        scale = world_size if ".experts." in name else 1
        torch.testing.assert_close(got_grads[name], scale * p.grad, **TOL, msg=lambda m: f"{name}: {m}")
    fmoe.integrations.hf.export(converted, folder)           # gathered from both ranks, written by rank 0
    converted.save_pretrained(f"{folder}-saved")        # the same, through transformers' own save
    if rank == 0:
        for written in (folder, f"{folder}-saved"):
            plain = transformers.AutoModelForCausalLM.from_pretrained(written).eval()
            with torch.no_grad():
                torch.testing.assert_close(plain(ids).logits, want.logits, **TOL)


def check_load_takes_turns(rank, world_size, folder, log_folder):
    """fmoe.integrations.hf.load at ep_size=2: the ranks read the checkpoint one after the other (their reads
    never overlap), each keeps half of every block's experts, and the logits equal transformers'."""
    import json
    import time

    import fmoe.integrations.hf.loading as load_module
    read = load_module._read

    def timed_read(*args):
        start = time.time()
        model = read(*args)
        time.sleep(0.3)                 # widen the window an overlap would show in
        with open(f"{log_folder}/{rank}.json", "w") as f:
            json.dump([start, time.time()], f)
        return model

    load_module._read = timed_read
    model = fmoe.integrations.hf.load(folder, ep_size=world_size)
    load_module._read = read
    blocks = fmoe.integrations.hf.converted_blocks(model)
    assert blocks
    for _, block in blocks:
        assert block.moe.experts.w1_eDF.shape[0] * world_size == block.moe.tot_expert
    torch.distributed.barrier()
    spans = sorted(json.load(open(f"{log_folder}/{r}.json")) for r in range(world_size))
    for (_, end), (start, _) in zip(spans, spans[1:]):
        assert end <= start, f"two ranks read the checkpoint at once: {spans}"
    ids = tokens()
    want = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    with torch.no_grad():
        torch.testing.assert_close(model.eval()(ids).logits, want(ids).logits, **TOL)
