"""Composer's `ExportForInferenceCallback`, exporting in a worker process from a checkpoint.

The worker cannot receive the trainer's model object, so it builds one with
`model_factory`, loads the weights of a checkpoint the trainer wrote (asking for one
when needed) and exports that: TorchScript, `torch.export` (.pt2) or ONNX.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from offloop.workers.callback import Callback

__all__ = ["ExportForInferenceCallback"]

FORMATS = ("torchscript", "torch_export", "onnx")
EXPORT_ON = ("fit_end", "checkpoint")


class ExportForInferenceCallback(Callback):
    """Export the trained model for inference (Composer's ExportForInferenceCallback).

    Args:
        save_format: 'torchscript' (traced with the sample input, else scripted),
            'torch_export' (`torch.export.export` saved with `torch.export.save`, a .pt2
            file) or 'onnx' (`torch.onnx.export`; needs the `onnx` and `onnxscript`
            packages where the worker runs).
        save_path: the exported file; '{run_name}' is filled in.
        model_factory: builds the model the checkpoint's weights are loaded into: a
            callable taking no arguments (picklable, to reach a worker process) or an
            import path 'package.module:function'.
        sample_input: example input for tracing/exporting: a tensor, or a tuple of the
            model's positional arguments. Default: the inputs the trainer publishes with
            `Trainer(publish_samples=N)`. 'torch_export' and 'onnx' need one.
        transforms: callables model -> model applied before exporting (as in Composer).
        export_on: 'fit_end' exports the final weights: the checkpoint written at the
            final step, or one this callback asks the trainer for. 'checkpoint' exports
            each checkpoint as the trainer announces it (the newest overwrites
            `save_path`), and asks for none.
        tag: the tag of the checkpoint request (the trainer adds it to the file name).
    """

    def __init__(
        self,
        save_format: str,
        save_path: str | os.PathLike,
        model_factory: Callable[[], Any] | str,
        sample_input: Any = None,
        transforms: Sequence[Callable[[Any], Any]] | None = None,
        *,
        export_on: str = "fit_end",
        tag: str = "export",
    ) -> None:
        save_format = str(getattr(save_format, "value", save_format)).lower()
        if save_format not in FORMATS:
            raise ValueError(f"ExportForInferenceCallback: save_format {save_format!r} is not one of "
                             f"{', '.join(FORMATS)}")
        if save_format == "onnx":
            _require_onnx()
        if export_on not in EXPORT_ON:
            raise ValueError(f"ExportForInferenceCallback: export_on {export_on!r} is not one of "
                             f"{', '.join(EXPORT_ON)}")
        if not isinstance(model_factory, str) and not callable(model_factory):
            raise ValueError("ExportForInferenceCallback: model_factory must be a callable or an "
                             f"import path 'package.module:function', got {model_factory!r}")
        _resolve(model_factory)  # a bad import path fails here, not at the end of the run
        if transforms is not None and not all(callable(t) for t in transforms):
            raise ValueError("ExportForInferenceCallback: transforms must be callables model -> model")
        self.save_format = save_format
        self.save_path = str(save_path)
        self.model_factory = model_factory
        self.sample_input = sample_input
        self.transforms = list(transforms or [])
        self.export_on = export_on
        self.tag = tag
        #: every export written: {"path", "checkpoint", "step", "format"}
        self.exported: list[dict[str, Any]] = []
        self._published_input = None
        self._latest: tuple[str, int | None] | None = None  # the newest checkpoint announced

    def __getstate__(self) -> dict[str, Any]:
        """Picklable (the trainer sends each callback to its worker process): no tensors
        taken from the run, no control connection."""
        state = {**self.__dict__, "_published_input": None}
        state.pop("_control", None)
        return state

    # ------------------------------------------------------------- events

    def batch_end(self, state, logger) -> None:
        if self.sample_input is None and self._published_input is None:
            samples = state.samples or {}
            if samples.get("inputs") is not None:
                self._published_input = samples["inputs"].clone()

    def checkpoint_saved(self, state, logger) -> None:
        path = state.data.get("path") or state.last_checkpoint
        if not path:
            return
        self._latest = (path, state.data.get("step"))
        if self.export_on == "checkpoint":
            self.export(path, logger, run_name=state.run_name, step=state.data.get("step"))

    def fit_end(self, state, logger) -> None:
        if self.export_on == "fit_end":
            path, step = self._final_checkpoint(state, logger)
            self.export(path, logger, run_name=state.run_name, step=step)

    # ------------------------------------------------------------- exporting

    def export(self, checkpoint: str | os.PathLike, logger=None, *, run_name: str = "",
               step: int | None = None) -> Path:
        """Build the model, load `checkpoint`'s weights and export it to save_path; usable
        outside a run too (`ExportForInferenceCallback(...).export('ep3-ba24.pt')`)."""
        import torch

        model = self._model(checkpoint)
        args = self._example_args()
        path = Path(self.save_path.format(run_name=run_name or "run"))
        path.parent.mkdir(parents=True, exist_ok=True)
        with torch.no_grad():
            if self.save_format == "torchscript":
                _to_torchscript(model, args, path)
            elif self.save_format == "torch_export":
                if args is None:
                    raise ValueError(_NEEDS_INPUT.format(fmt="torch_export"))
                _atomic(path, lambda tmp: torch.export.save(torch.export.export(model, args), tmp))
            else:
                _require_onnx()
                if args is None:
                    raise ValueError(_NEEDS_INPUT.format(fmt="onnx"))
                torch.onnx.export(model, args, str(path))
        self.exported.append({"path": str(path), "checkpoint": str(checkpoint), "step": step,
                              "format": self.save_format})
        if logger is not None:
            at = f" (step {step})" if step is not None else ""
            logger.log_text(f"ExportForInferenceCallback: exported {checkpoint}{at} as "
                            f"{self.save_format} to {path}")
        return path

    def _final_checkpoint(self, state, logger) -> tuple[str, int | None]:
        """The checkpoint holding the final weights: one written at the last step, else one
        asked for now; failing that, the newest one written, said so in the log."""
        step = state.timestamp.batch
        if self._latest is not None and self._latest[1] == step:
            return self._latest
        try:
            ack = self.request_checkpoint(self.tag)
            error = None if ack.ok else ack.error
        except Exception as exc:
            ack, error = None, f"{type(exc).__name__}: {exc}"
        if ack is not None and ack.ok and ack.result.get("path"):
            return ack.result["path"], ack.result.get("step", step)
        if self._latest is not None:
            logger.log_text(f"ExportForInferenceCallback: no checkpoint of the final step {step} "
                            f"({error}); exporting the newest one, {self._latest[0]} "
                            f"(step {self._latest[1]})")
            return self._latest
        raise RuntimeError(f"ExportForInferenceCallback: nothing to export: the trainer wrote no "
                           f"checkpoint and did not answer the request for one ({error})")

    def _model(self, checkpoint: str | os.PathLike):
        import torch

        model = _resolve(self.model_factory)()
        if not isinstance(model, torch.nn.Module):
            raise ValueError(f"ExportForInferenceCallback: model_factory returned a "
                             f"{type(model).__name__}, not a torch.nn.Module")
        payload = torch.load(checkpoint, map_location="cpu", weights_only=True)
        weights = payload["model"] if isinstance(payload, dict) and "model" in payload else payload
        model.load_state_dict(weights)
        model.eval()
        for transform in self.transforms:
            model = transform(model)
        return model

    def _example_args(self) -> tuple | None:
        sample = self.sample_input if self.sample_input is not None else self._published_input
        if sample is None:
            return None
        return tuple(sample) if isinstance(sample, tuple) else (sample,)


_NEEDS_INPUT = ("ExportForInferenceCallback: save_format={fmt!r} needs an example input: pass "
                "sample_input=, or build the Trainer with publish_samples=N so the worker can take "
                "one from the published samples")


def _to_torchscript(model, args: tuple | None, path: Path) -> None:
    import torch

    with warnings.catch_warnings():  # torch.jit is deprecated upstream; the format is still asked for
        warnings.simplefilter("ignore", DeprecationWarning)
        scripted = torch.jit.trace(model, args) if args is not None else torch.jit.script(model)
        _atomic(path, lambda tmp: torch.jit.save(scripted, str(tmp)))


def _atomic(path: Path, write: Callable[[Path], Any]) -> None:
    """Write through a temporary file beside `path`, so a reader never sees half a file."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _resolve(factory: Callable[[], Any] | str) -> Callable[[], Any]:
    """A callable, or the object an import path 'package.module:attribute' names."""
    if callable(factory):
        return factory
    module_name, sep, attr = str(factory).partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"ExportForInferenceCallback: model_factory {factory!r} is not an import "
                         "path of the form 'package.module:function'")
    try:
        target: Any = importlib.import_module(module_name)
        for part in attr.split("."):
            target = getattr(target, part)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"ExportForInferenceCallback: model_factory {factory!r} cannot be "
                         f"imported: {exc}") from None
    if not callable(target):
        raise ValueError(f"ExportForInferenceCallback: model_factory {factory!r} names a "
                         f"{type(target).__name__}, not a callable")
    return target


def _require_onnx() -> None:
    """torch.onnx.export needs onnx, and (torch >= 2.9, where the exporter is torch.export
    based) onnxscript; say which are missing and how to install them."""
    import torch

    needed = ["onnx"]
    major, minor = (int(p) for p in torch.__version__.split(".")[:2])
    if (major, minor) >= (2, 9):
        needed.append("onnxscript")
    missing = [name for name in needed if importlib.util.find_spec(name) is None]
    if missing:
        raise ImportError(f"ExportForInferenceCallback: save_format='onnx' needs {' and '.join(missing)}, "
                          f"which {'is' if len(missing) == 1 else 'are'} not installed here: "
                          f"pip install {' '.join(missing)}")
