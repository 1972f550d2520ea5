"""Fine-tune a transformers Qwen3-MoE (or DeepSeek-V3) model with fmoe's expert parallelism on CPU
processes, then export it back to a checkpoint plain transformers loads.

    python examples/hf/finetune_qwen3_moe.py --steps 30 --out /tmp/qwen3-moe-fmoe
    python examples/hf/finetune_qwen3_moe.py --family deepseek_v3 --steps 30 --out /tmp/dsv3-fmoe
    python examples/hf/finetune_qwen3_moe.py --model PATH_TO_A_LOCAL_CHECKPOINT --out /tmp/ft

Without --model the model is a small random-init one over byte tokens, saved to a temporary folder.
The job is `fmoe train --hf-model PATH --nproc N --ep-size N` (fmoe/integrations/hf/finetune.py): each of the
N gloo processes keeps 1/N of every MoE block's experts and trains on its own batches of the byte
corpus (the Python stdlib, or --data); the loss printed is the mean over the ranks. At the end the
exported checkpoint is reloaded with plain transformers and converted again, and the two logits compared.
"""
import argparse
import os
import subprocess
import sys
import tempfile

import torch
import transformers

import fmoe.integrations.hf
from fmoe.integrations.hf.finetune import small_model


def compare_reloaded(out: str) -> float:
    """max |logit difference| between the exported checkpoint in plain transformers and converted by fmoe."""
    ids = torch.randint(256, (2, 32), generator=torch.Generator().manual_seed(7))
    plain = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    converted = fmoe.integrations.hf.convert(transformers.AutoModelForCausalLM.from_pretrained(out)).eval()
    with torch.no_grad():
        return (plain(ids).logits - converted(ids).logits).abs().max().item()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--family", choices=["qwen3_moe", "deepseek_v3"], default="qwen3_moe")
    parser.add_argument("--model", help="a local transformers checkpoint folder instead of a random small model")
    parser.add_argument("--nproc", type=int, default=2, help="processes = expert-parallel ranks")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--data", help="a text file or folder to train on (default: the Python stdlib)")
    parser.add_argument("--out", required=True, help="folder for the exported checkpoint")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="fmoe-hf-") as folder:
        model = args.model
        if model is None:
            model = os.path.join(folder, args.family)
            small_model(args.family).save_pretrained(model)
        cmd = [sys.executable, "-m", "fmoe.app.cli", "train", "--hf-model", model, "--nproc", str(args.nproc),
               "--ep-size", str(args.nproc), "--steps", str(args.steps), "--lr", str(args.lr), "--batch-size", "16",
               "--seq-len", "64", "--out", args.out] + (["--data", args.data] if args.data else [])
        status = subprocess.call(cmd)
    if status:
        sys.exit(status)
    print(f"plain transformers reloads {args.out}; max |logit difference| to fmoe's conversion of it "
          f"{compare_reloaded(args.out):.2e}")


if __name__ == "__main__":
    main()
