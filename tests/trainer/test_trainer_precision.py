"""Mixed precision: amp_fp16 trains with loss scaling (as Composer does), publishes the
unscaled gradient norm, and carries the scaler's state through a checkpoint."""

from __future__ import annotations

import math

import torch
from helpers.trainers import loader, mlp

from offloop.trainer import Trainer

F = torch.nn.functional


def test_amp_fp16_scales_the_loss_unscales_before_the_norm_and_checkpoints_the_scaler(tmp_path):
    model = mlp()
    before = [p.detach().clone() for p in model.parameters()]
    trainer = Trainer(model, loader(64, 8), "1ep", loss_fn=F.cross_entropy, precision="amp_fp16",
                      publish=False, run_dir=tmp_path / "run", seed=1)
    assert trainer.scaler is not None and trainer.scaler.get_scale() == 2.0**16
    norms = []
    original = trainer.emitter.snapshot  # what grad_norms publishes
    trainer.emitter.snapshot = lambda topic, ts, data: (
        norms.append(data["grad_norm"]) if topic == "grad_norms" else None, original(topic, ts, data))
    trainer.emitter.wants = lambda topic: topic == "grad_norms"
    trainer.fit()
    assert any(not torch.equal(a, b.cpu()) for a, b in zip(before, model.parameters(), strict=True))
    # unscaled before the norm: a few units, not 65536 times that
    assert len(norms) == 8 and all(math.isfinite(float(n)) and 0 < float(n) < 100 for n in norms)
    path = trainer.save_checkpoint(tag="amp")
    saved = torch.load(path, map_location="cpu", weights_only=True)["scaler"]
    assert saved["scale"] == trainer.scaler.get_scale()

    resumed = Trainer(mlp(), loader(64, 8), "2ep", loss_fn=F.cross_entropy, precision="amp_fp16",
                      publish=False, run_dir=tmp_path / "resumed", load_path=path)
    assert resumed.scaler.get_scale() == saved["scale"]
    trainer.close()
    resumed.close()


def test_fp32_and_bf16_use_no_scaler(tmp_path):
    for precision in ("fp32", "amp_bf16"):
        trainer = Trainer(mlp(), loader(16, 8), "1ba", loss_fn=F.cross_entropy, precision=precision,
                          publish=False, run_dir=tmp_path / precision)
        assert trainer.scaler is None
        trainer.fit()
        trainer.close()
