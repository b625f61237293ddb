"""Composer's save_* arguments and autoresume on the Trainer: checkpoints every interval
in save_folder, the newest kept, `latest` pointing at the newest, and a run started again
with the same name picking up from it."""

from __future__ import annotations

import pytest
import torch.nn.functional as F
from helpers.trainers import loader, mlp, small_trainer

from offloop.trainer import ConfigError, Trainer

BATCHES = 4  # 32 samples in batches of 8


def _trainer(tmp_path, duration, **kw):
    return small_trainer(tmp_path, duration, shuffle=True, run_name="saved",
                         save_folder=str(tmp_path / "{run_name}-checkpoints"), seed=3, **kw)


def test_checkpoints_every_interval_the_newest_kept_and_autoresume_picks_up_from_latest(tmp_path):
    with _trainer(tmp_path, "3ep", save_num_checkpoints_to_keep=2) as trainer:
        trainer.fit()
    folder = tmp_path / "saved-checkpoints"
    assert sorted(p.name for p in folder.glob("*.pt")) == ["ep2-ba8-rank0.pt", "ep3-ba12-rank0.pt",
                                                            "latest-rank0.pt"]
    assert (folder / "latest-rank0.pt").resolve().name == "ep3-ba12-rank0.pt"
    assert trainer.checkpoints == [str(folder / f"ep{e}-ba{e * BATCHES}-rank0.pt") for e in (1, 2, 3)]

    with _trainer(tmp_path, "5ep", save_interval="2ba", autoresume=True) as resumed:
        assert resumed.timestamp.batch == 12  # loaded before any training
        resumed.fit()
    assert resumed.timestamp.batch == 20
    assert (folder / "latest-rank0.pt").resolve().name == "ep4-ba20-rank0.pt"  # the batch checkpoint comes before epoch_end
    assert (folder / "ep3-ba14-rank0.pt").is_file()  # every 2 batches from the resume on


def test_no_save_folder_or_save_interval_none_saves_nothing(tmp_path):
    with Trainer(mlp(), loader(32, 8), "2ep", loss_fn=F.cross_entropy, run_dir=tmp_path / "a") as plain:
        plain.fit()
    with _trainer(tmp_path, "2ep", save_interval=None) as off:
        off.fit()
    assert plain.checkpoints == off.checkpoints == []
    with _trainer(tmp_path, "1ep", autoresume=True) as fresh:  # nothing to resume from yet: starts at 0
        assert fresh.timestamp.batch == 0


@pytest.mark.parametrize("kw, message", [
    ({"save_interval": "100sp"}, "save_interval '100sp' must be a positive number of epochs or batches"),
    ({"save_interval": "soon"}, "save_interval: bad duration string 'soon'"),
    ({"save_num_checkpoints_to_keep": -2}, "save_num_checkpoints_to_keep must be an int >= -1"),
    ({"save_filename": 3}, "save_filename must be a str"),
    ({"publish": False}, "needs publish=True"),
])
def test_bad_save_arguments_are_refused_when_the_trainer_is_built(tmp_path, kw, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        _trainer(tmp_path, "1ep", **kw)


def test_autoresume_needs_a_run_name(tmp_path):
    with pytest.raises(ConfigError, match="autoresume=True needs a run_name"):
        Trainer(mlp(), loader(32, 8), "1ep", loss_fn=F.cross_entropy, run_dir=tmp_path / "r",
                save_folder=str(tmp_path / "c"), autoresume=True)
