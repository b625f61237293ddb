"""ExportForInferenceCallback on real runs: the worker builds the model from model_factory,
loads a checkpoint the trainer wrote and exports it; the exported model gives the same
outputs as the weights it was exported from (the trained model, at fit_end)."""

from __future__ import annotations

import importlib.util
import time

import pytest
import torch
from helpers.data import dataset
from helpers.harness import MemoryLog, classifier, run_with_worker
from torch.nn import functional as F
from torch.utils.data import DataLoader

from offloop.trainer import Trainer
from offloop.workers import Callback
from offloop.workers.callbacks import ExportForInferenceCallback

pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit:DeprecationWarning")

SAMPLE = torch.randn(4, 8, generator=torch.Generator().manual_seed(7))


class CheckpointAt(Callback):
    """Asks for one checkpoint after batch `batch`; keeps the trainer's ack."""

    def __init__(self, batch: int):
        self.batch, self.ack = batch, None

    def batch_end(self, state, logger):
        if state.timestamp.batch == self.batch:
            self.ack = self.request_checkpoint("probe")


class Slow:
    """The harness's batches, 10 ms apart (a stand-in for compute): a checkpoint asked for
    at batch 10 reaches the trainer while it still trains, bursts and all."""

    def __init__(self, seconds: float = 0.01):
        self.loader, self.seconds = DataLoader(dataset(), batch_size=8, shuffle=True), seconds

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self):
        for batch in self.loader:
            time.sleep(self.seconds)
            yield batch


def outputs_of(model, x=SAMPLE):
    with torch.no_grad():
        return model.eval()(x)


def from_checkpoint(path):
    model = classifier()
    model.load_state_dict(torch.load(path, weights_only=True)["model"])
    return model


def test_fit_end_export_in_a_trainer_worker_matches_the_trained_model(tmp_path):
    """The callback runs in the worker process the Trainer spawns; at fit_end it asks for a
    checkpoint of the final weights, which the trainer writes while it waits for workers."""
    target = tmp_path / "exported" / "{run_name}.ts"
    export = ExportForInferenceCallback("torchscript", str(target), "helpers.harness:classifier",
                                        sample_input=SAMPLE)
    trainer = Trainer(classifier(), DataLoader(dataset(), batch_size=8, shuffle=True), "3ep",
                      loss_fn=F.cross_entropy, run_dir=tmp_path / "run", seed=3, callbacks=[export],
                      worker_shutdown_timeout=30)
    try:
        trainer.fit()
    finally:
        trainer.close()  # returns once the worker has handled fit_end (at most 30 s)

    path = tmp_path / "exported" / f"{trainer.run_name}.ts"
    assert path.is_file(), f"no export; the trainer's checkpoints: {trainer.checkpoints}"
    assert [p for p in trainer.checkpoints if p.endswith("-export.pt")], trainer.checkpoints
    loaded = torch.jit.load(str(path))
    torch.testing.assert_close(loaded(SAMPLE), outputs_of(trainer.model), rtol=0, atol=1e-6)
    assert not torch.allclose(outputs_of(classifier()), outputs_of(trainer.model))  # it trained


def test_export_on_checkpoint_uses_the_announced_checkpoint_and_published_samples(tmp_path):
    probe = CheckpointAt(batch=10)
    export = ExportForInferenceCallback("torch_export", str(tmp_path / "model.pt2"),
                                        classifier, export_on="checkpoint")
    trainer, worker = run_with_worker([probe, export], tmp_path, publish_samples=4,
                                      train_dataloader=Slow())

    assert worker.stats.errors == 0
    assert probe.ack is not None and probe.ack.ok, probe.ack
    checkpoint = probe.ack.result["path"]
    assert export.exported == [{"path": str(tmp_path / "model.pt2"), "checkpoint": checkpoint,
                                "step": probe.ack.result["step"], "format": "torch_export"}]
    program = torch.export.load(str(tmp_path / "model.pt2"))
    # traced on the 4 published samples: the exported program takes batches of 4
    assert tuple(program.module()(SAMPLE).shape) == (4, 3)
    torch.testing.assert_close(program.module()(SAMPLE), outputs_of(from_checkpoint(checkpoint)),
                               rtol=0, atol=1e-6)
    # the weights of batch ~11, not the final ones
    assert not torch.allclose(program.module()(SAMPLE), outputs_of(trainer.model))


def test_fit_end_falls_back_to_the_newest_checkpoint_when_none_can_be_had(tmp_path):
    """An attached worker's request after the run is not answered (the trainer does something
    else after its fit, close() comes later): it says so and exports the newest checkpoint the
    trainer announced."""
    log = MemoryLog()
    probe = CheckpointAt(batch=16)
    export = ExportForInferenceCallback("torchscript", str(tmp_path / "model.ts"), classifier)
    export.control_timeout = 1.0
    run_with_worker([probe, export], tmp_path, destinations=[log], train_dataloader=Slow(),
                    answer_late=False)

    assert [e["checkpoint"] for e in export.exported] == [probe.ack.result["path"]]
    assert any("exporting the newest one" in t for t in log.texts), log.texts
    scripted = torch.jit.load(str(tmp_path / "model.ts"))
    torch.testing.assert_close(scripted(SAMPLE), outputs_of(from_checkpoint(probe.ack.result["path"])),
                               rtol=0, atol=1e-6)


def test_onnx_export_runs_and_the_file_computes_what_the_checkpoint_does(tmp_path):
    import onnx  # in the test extra: this export always runs in the tests
    from onnx.reference import ReferenceEvaluator

    checkpoint = tmp_path / "weights.pt"
    torch.save({"model": classifier(seed=5).state_dict()}, checkpoint)
    export = ExportForInferenceCallback("onnx", str(tmp_path / "m.onnx"), classifier, sample_input=SAMPLE)
    export.export(checkpoint)
    model = onnx.load(str(tmp_path / "m.onnx"))
    onnx.checker.check_model(model)
    (outputs,) = ReferenceEvaluator(model).run(None, {model.graph.input[0].name: SAMPLE.numpy()})
    torch.testing.assert_close(torch.from_numpy(outputs), outputs_of(classifier(seed=5)),
                               rtol=1e-5, atol=1e-5)


def test_onnx_without_its_packages_is_a_clear_error_naming_what_to_install(tmp_path, monkeypatch):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "onnxscript" else real_find_spec(name, *a))
    with pytest.raises(ImportError, match=r"needs onnxscript.*pip install onnxscript"):
        ExportForInferenceCallback("onnx", str(tmp_path / "m.onnx"), classifier, sample_input=SAMPLE)


def test_bad_options_fail_early_and_exports_need_an_input(tmp_path):
    for kwargs, match in (({"save_format": "tflite"}, "save_format"),
                          ({"model_factory": "helpers.harness.classifier"}, "package.module:function"),
                          ({"model_factory": "helpers.harness:no_such_factory"}, "cannot be imported"),
                          ({"model_factory": 3}, "callable"),
                          ({"export_on": "never"}, "export_on")):
        options = {"save_format": "torchscript", "save_path": str(tmp_path / "m"),
                   "model_factory": classifier, **kwargs}
        with pytest.raises(ValueError, match=match):
            ExportForInferenceCallback(**options)
    checkpoint = tmp_path / "weights.pt"
    torch.save({"model": classifier(seed=5).state_dict()}, checkpoint)
    with pytest.raises(ValueError, match="needs an example input"):
        ExportForInferenceCallback("torch_export", str(tmp_path / "m.pt2"), classifier).export(checkpoint)
    scripted = ExportForInferenceCallback("torchscript", str(tmp_path / "m.ts"), "helpers.harness:classifier")
    path = scripted.export(checkpoint)  # no input: scripted rather than traced
    torch.testing.assert_close(torch.jit.load(str(path))(SAMPLE), outputs_of(classifier(seed=5)),
                               rtol=0, atol=1e-6)
