"""ImageVisualizer on real runs: the PNG grids it writes decode, have the size their tiles
make, show the published images pixel for pixel, and caption them with the targets and
the predictions the trainer published."""

from __future__ import annotations

import json
import pickle
import struct
import zlib

import numpy as np
import pytest
import torch
from helpers.harness import MemoryLog, run_with_worker
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from offloop.workers.callbacks import ImageVisualizer
from offloop.workers.callbacks.image_visualizer import _PALETTE


def read_png(path):
    """(width, height, pixels (H, W, 3), tEXt) of an 8-bit RGB PNG; checks every CRC."""
    raw = path.read_bytes()
    assert raw[:8] == b"\x89PNG\r\n\x1a\n", f"{path} has no PNG signature"
    pos, chunks = 8, []
    while pos < len(raw):
        (length,) = struct.unpack(">I", raw[pos:pos + 4])
        kind, body = raw[pos + 4:pos + 8], raw[pos + 8:pos + 8 + length]
        (crc,) = struct.unpack(">I", raw[pos + 8 + length:pos + 12 + length])
        assert crc == zlib.crc32(kind + body), f"bad CRC on {kind!r} in {path}"
        chunks.append((kind, body))
        pos += 12 + length
    assert chunks[0][0] == b"IHDR" and chunks[-1][0] == b"IEND"
    width, height, depth, colour, _, _, interlace = struct.unpack(">IIBBBBB", chunks[0][1])
    assert (depth, colour, interlace) == (8, 2, 0)
    data = zlib.decompress(b"".join(body for kind, body in chunks if kind == b"IDAT"))
    rows = np.frombuffer(data, dtype=np.uint8).reshape(height, 1 + width * 3)
    assert not rows[:, 0].any(), "rows use no PNG filter"
    text = dict(body.split(b"\0", 1) for kind, body in chunks if kind == b"tEXt")
    return width, height, rows[:, 1:].reshape(height, width, 3), {k.decode(): v.decode() for k, v in text.items()}


def images(n: int, seed: int) -> TensorDataset:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 3, 8, 8, generator=gen)
    return TensorDataset(x, (x[:, 0].mean(dim=(1, 2)) > 0).long() + (x[:, 1].mean(dim=(1, 2)) > 0).long())


class TinyConv(nn.Module):
    def __init__(self, classes: int = 3):
        super().__init__()
        torch.manual_seed(0)
        self.conv, self.head = nn.Conv2d(3, 4, 3, padding=1), nn.Linear(4, classes)

    def forward(self, x):
        return self.head(self.conv(x).relu().mean(dim=(2, 3)))


def expected_tile(image: torch.Tensor, scale: int = 4) -> np.ndarray:
    """What a (3, H, W) float image looks like in the grid: min-max to 0-255, enlarged."""
    img = image.permute(1, 2, 0).double().numpy()
    img = np.rint((img - img.min()) / (img.max() - img.min()) * 255).astype(np.uint8)
    return np.kron(img, np.ones((scale, scale, 1), dtype=np.uint8))


def test_train_and_eval_grids_with_captions(tmp_path):
    log = MemoryLog()
    eval_set = images(16, seed=2)
    visualizer = ImageVisualizer(interval="4ba", num_images=4, folder=tmp_path / "img")
    trainer, worker = run_with_worker(
        [visualizer], tmp_path, max_duration="2ep", destinations=[log], model=TinyConv(),
        train_dataloader=DataLoader(images(32, seed=1), batch_size=8, shuffle=True),
        eval_dataloader=DataLoader(eval_set, batch_size=8), publish_samples=4, publish_eval_outputs=True)

    names = sorted(p.name for p in (tmp_path / "img").iterdir())
    # 4 batches an epoch: train batches 0 and 4 (ba1, ba5), and the first batch of each eval
    assert names == ["eval_eval_ep1_ba4.png", "eval_eval_ep2_ba8.png",
                     "train_ep0_ba1.png", "train_ep1_ba5.png"]
    assert [e["key"] for e in visualizer.images].count("Images/Eval") == 2
    for name in names:
        width, height, _, _ = read_png(tmp_path / "img" / name)
        # 4 tiles of 8x8 enlarged to 32x32, a 7-pixel caption strip, 2-pixel padding
        assert (width, height) == (2 + 4 * (32 + 2), 2 + (32 + 7 + 2))

    # the last eval's grid shows the first eval images, captioned with the targets and
    # the final model's predictions
    _, _, pixels, text = read_png(tmp_path / "img" / "eval_eval_ep2_ba8.png")
    for i in range(4):
        left = 2 + i * 34
        np.testing.assert_array_equal(pixels[2:34, left:left + 32], expected_tile(eval_set.tensors[0][i]))
    comment = json.loads(text["Comment"])
    with torch.no_grad():
        predicted = trainer.model.eval()(eval_set.tensors[0][:4]).argmax(dim=1).tolist()
    assert comment["images"] == [{"target": t, "prediction": p}
                                 for t, p in zip(eval_set.tensors[1][:4].tolist(), predicted, strict=True)]
    assert (comment["key"], comment["epoch"], comment["batch"]) == ("Images/Eval", 2, 8)
    assert any("Images/Train ->" in t for t in log.texts)


def test_segmentation_mode_draws_input_target_and_prediction(tmp_path):
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(16, 3, 8, 8, generator=gen)
    masks = (x[:, 0] > 0).long()
    torch.manual_seed(0)
    model = nn.Conv2d(3, 2, 1)
    visualizer = ImageVisualizer(interval="1ep", mode="segmentation", num_images=2,
                                 folder=tmp_path / "seg", eval_images=False)
    run_with_worker([visualizer], tmp_path, max_duration="2ep", model=model,
                    train_dataloader=DataLoader(TensorDataset(x, masks), batch_size=8),
                    eval_dataloader=DataLoader(TensorDataset(x[:8], masks[:8]), batch_size=8),
                    loss_fn=F.cross_entropy, publish_samples=2)

    assert sorted(p.name for p in (tmp_path / "seg").iterdir()) == ["train_ep0_ba1.png", "train_ep1_ba3.png"]
    width, height, pixels, _ = read_png(tmp_path / "seg" / "train_ep0_ba1.png")
    assert (width, height) == (2 + 2 * (3 * 32 + 2), 2 + 32 + 2)  # input | target | prediction
    # unshuffled: the first published sample is x[0]; its target panel colours each pixel by class
    np.testing.assert_array_equal(pixels[2:34, 2:34], expected_tile(x[0]))
    target_panel = pixels[2:34, 34:66]
    np.testing.assert_array_equal(target_panel, np.kron(_PALETTE[masks[0].numpy()],
                                                        np.ones((4, 4, 1), dtype=np.uint8)))


def test_says_what_the_trainer_must_publish(tmp_path):
    log = MemoryLog()
    visualizer = ImageVisualizer(interval="1ba", folder=tmp_path / "none")
    run_with_worker([visualizer], tmp_path, max_duration="1ep", destinations=[log],
                    publish_eval_outputs=True)  # no publish_samples; inputs are (N, 8) vectors
    assert not (tmp_path / "none").exists()
    assert visualizer.images == []
    notes = "\n".join(log.texts)
    assert "publish_samples=N" in notes
    assert "(16, 8) are not images" in notes
    assert sum("publish_samples" in t for t in log.texts) == 1  # said once, not at every batch
    assert pickle.loads(pickle.dumps(visualizer)).interval == visualizer.interval  # for Trainer(callbacks=)


@pytest.mark.parametrize("kwargs", [{"mode": "mask"}, {"num_images": 0}, {"interval": "3sp"},
                                    {"interval": "soon"}])
def test_bad_options_fail_early(kwargs):
    with pytest.raises(ValueError, match="ImageVisualizer"):
        ImageVisualizer(**kwargs)
