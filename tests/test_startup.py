"""Start-up: what a rank imports before its first step (bench.startup measures it)."""

import subprocess
import sys


def test_a_ddp_or_single_process_rank_imports_nothing_of_torch_s_fsdp():
    """Start-up: torch's FSDP, DTensor and distributed checkpointing (with torch.fx's symbolic shapes and sympy)
    take seconds to import; the Ray-free loop and the Ray Train worker import them only for an FSDP run."""
    heavy = ("torch.distributed.fsdp", "torch.distributed.tensor", "torch.distributed.checkpoint", "sympy",
             "torch._dynamo")
    code = ("import sys, orchestrator.train.local, orchestrator.runner.worker, orchestrator.train.training\n"
            f"print([m for m in {heavy!r} if m in sys.modules])")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]", done.stdout
