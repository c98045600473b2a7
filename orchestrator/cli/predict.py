"""`ampflow predict MODEL --output FILE` (or `python -m orchestrator.predict`): a logged model's predictions, in
the precision it was trained or exported in, written to a file. The logic is `orchestrator.runner.predict`."""

import argparse
import pickle
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence

import numpy as np
import torch

from orchestrator.cli.program import check_output_file, refused
from orchestrator.errors import EXIT_OK, BadInput, command_exit
from orchestrator.tracking.secrets import install_console_redaction
from orchestrator.tracking.tracker import quick_http_failures

INPUTS = (".pt", ".npy")
"""Input files: a tensor or a dict of tensors (`.pt`, loaded weights-only), or an array (`.npy`, no pickles)."""
OUTPUTS = (".pt", ".npy")


def read_inputs(path: Path) -> Any:
    """A file of inputs: a tensor, or a dict of tensors with as many rows each (one row per input, dim 0)."""
    if path.suffix not in INPUTS:
        raise BadInput(f"--data: {path} is neither 'eval' nor a {' or '.join(INPUTS)} file of inputs.")
    if path.is_file() and path.stat().st_size == 0:
        raise BadInput(f"--data: {path} is empty (0 bytes); it should hold the inputs, one row each: a tensor or a "
                       "dict of tensors saved with torch.save (.pt), or an array saved with numpy.save (.npy).")
    try:
        if path.suffix == ".npy":
            loaded = torch.from_numpy(np.load(path, allow_pickle=False))
        else:
            loaded = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:
        raise BadInput(f"--data: cannot read {path}: it holds more than tensors, and ampflow never unpickles a "
                       "file. Save the inputs as a tensor or a dict of tensors (torch.save), or as a .npy array.") \
            from None
    except (OSError, ValueError, RuntimeError, EOFError) as exc:
        raise BadInput(f"--data: cannot read {path} ({type(exc).__name__}: {exc or 'it ends early'}); it should "
                       "hold a tensor or a dict of tensors (torch.save), or an array (numpy.save).") from None
    if isinstance(loaded, torch.Tensor) and loaded.dim() >= 1:
        return loaded
    columns = list(loaded.values()) if isinstance(loaded, dict) else []
    if columns and all(isinstance(v, torch.Tensor) and v.dim() >= 1 for v in columns) \
            and len({v.shape[0] for v in columns}) == 1:
        return loaded
    raise BadInput(f"--data: {path} holds a {type(loaded).__name__}, not a tensor or a dict of tensors with one row "
                   "per input.")


def batches(inputs: Any, batch_size: int) -> Iterator[Any]:
    """The rows of a file's inputs (`read_inputs`), `batch_size` at a time, as they are: a file's rows are ready
    tensors, which the run's `data.collate` (made for its dataset's samples) is not for."""
    rows = len(inputs) if isinstance(inputs, torch.Tensor) else len(next(iter(inputs.values())))
    for start in range(0, rows, batch_size):
        if isinstance(inputs, torch.Tensor):
            yield inputs[start:start + batch_size]
        else:
            yield {key: value[start:start + batch_size] for key, value in inputs.items()}


def write_outputs(outputs: Any, path: Path) -> str:
    """Write the outputs (`.pt`: as they are, loadable weights-only; `.npy`: a tensor, bfloat16 as float32);
    returns what was written, in words."""
    if path.suffix == ".pt":
        torch.save(outputs, path)
    elif not isinstance(outputs, torch.Tensor):
        raise BadInput(f"--output: the model returns a {type(outputs).__name__}, which .npy cannot hold: use .pt.")
    else:
        np.save(path, (outputs.float() if outputs.dtype == torch.bfloat16 else outputs).numpy())
    if isinstance(outputs, torch.Tensor):
        return f"{tuple(outputs.shape)} {str(outputs.dtype).removeprefix('torch.')}"
    return type(outputs).__name__


def main(argv: Optional[Sequence[str]] = None) -> int:
    install_console_redaction()
    quick_http_failures()
    parser = argparse.ArgumentParser(
        prog="ampflow predict", description="Run a logged model over data in the precision it was trained or exported "
                                            "in, and write its outputs.")
    parser.add_argument("model", help="a run id (its model `model`), or a model URI: runs:/RUN_ID/model_bfloat16, "
                                      "models:/NAME/VERSION")
    parser.add_argument("--data", default="eval", help="'eval' (the run's eval split, default), or a .pt file (a "
                        "tensor or a dict of tensors) or .npy file of inputs, one row each")
    parser.add_argument("--output", required=True, type=Path, help="where the outputs go: .pt or .npy")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--device", default=None, help="cpu, cuda, cuda:1 (default: the GPU when there is one)")
    parser.add_argument("--tracking-uri", default=None, help="default: $MLFLOW_TRACKING_URI, else ./mlflow.db")
    args = parser.parse_args(argv)
    try:
        if args.output.suffix not in OUTPUTS:
            raise BadInput(f"--output: {args.output} must end in {' or '.join(OUTPUTS)}.")
        if args.batch_size < 1:
            raise BadInput(f"--batch-size: must be >= 1, got {args.batch_size}.")
        check_output_file(args.output, "predictions.pt")
        data = args.data if args.data == "eval" else batches(read_inputs(Path(args.data)), args.batch_size)
        from orchestrator.runner.predict import load  # it imports mlflow (seconds): --help and bad flags exit first
        predictor = load(args.model, args.tracking_uri, args.device)
        outputs = predictor.over(data, args.batch_size)
        written = write_outputs(outputs, args.output)
    except BadInput as exc:
        return refused(exc)
    print(f"Predicted with {predictor.describe}: {written} -> {args.output}")
    return EXIT_OK


if __name__ == "__main__":
    command_exit(main())
