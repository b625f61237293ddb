"""Composer's `ImageVisualizer`, drawing in a worker process: PNG grids of published images.

The trainer publishes a few samples of a batch (`Trainer(publish_samples=N)`) and, when
asked (`publish_eval_outputs=True`), each eval batch; this callback turns them into PNG
files written with zlib alone, so it needs no imaging library.
"""

from __future__ import annotations

import json
import os
import struct
import zlib
from pathlib import Path
from typing import Any

import numpy as np

from offloop.bus import Time, TimeUnit
from offloop.workers.callback import Callback
from offloop.workers.callbacks._intervals import batch_or_epoch_interval

__all__ = ["ImageVisualizer", "write_png"]

_MODES = ("input", "segmentation")
_COLUMNS = 8  # images per row of a grid, as torchvision's make_grid
_PAD = 2
_MIN_TILE = 32  # small images are enlarged (nearest neighbour) to at least this many pixels
_BACKGROUND = 32
_PALETTE = np.array([  # class colours for masks and captions (tab20-like; cycled)
    (31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40), (148, 103, 189),
    (140, 86, 75), (227, 119, 194), (127, 127, 127), (188, 189, 34), (23, 190, 207),
    (174, 199, 232), (255, 187, 120), (152, 223, 138), (255, 152, 150), (197, 176, 213),
    (196, 156, 148), (247, 182, 210), (199, 199, 199), (219, 219, 141), (158, 218, 229),
], dtype=np.uint8)
_WHITE, _GREEN, _RED = (235, 235, 235), (60, 200, 60), (230, 60, 60)
# a 3x5 pixel font, enough for class numbers in captions: one string of 15 cells a glyph
_GLYPHS = {
    "0": "111101101101111", "1": "010110010010111", "2": "111001111100111",
    "3": "111001111001111", "4": "101101111001001", "5": "111100111001111",
    "6": "111100111101111", "7": "111001001001001", "8": "111101111101111",
    "9": "111101111001111", "-": "000000111000000", "?": "111001011000010",
    " ": "000000000000000",
}


class ImageVisualizer(Callback):
    """Save grids of the images the trainer publishes, as PNG files (Composer's ImageVisualizer).

    Train images come from the samples published at `batch_end`
    (`Trainer(publish_samples=N)`, N >= num_images); eval images from the first batch of
    each evaluation (`Trainer(publish_eval_outputs=True)`).

    Args:
        interval: how often to save train images: '100ba', '1ep', or an int (batches).
            The first batch of each interval is drawn; eval images once per evaluation.
        mode: 'input' draws the inputs, with a caption strip of target and prediction
            under each when the trainer published classification targets and outputs
            (prediction green when right, red when wrong); 'segmentation' draws each
            input beside its target mask and its predicted mask.
        num_images: how many images per grid (at most as many as were published).
        channels_last: the inputs are (N, H, W, C) rather than (N, C, H, W).
        folder: where the PNG files go; '{run_name}' is filled in.
            Default: '{run_name}/images' under the worker's working directory.
        eval_images: also draw the first batch of each evaluation.
    """

    def __init__(
        self,
        interval: int | str | Time = "100ba",
        mode: str = "input",
        num_images: int = 8,
        channels_last: bool = False,
        folder: str | os.PathLike | None = None,
        *,
        eval_images: bool = True,
    ) -> None:
        if not isinstance(mode, str) or mode.lower() not in _MODES:
            raise ValueError(f"ImageVisualizer: mode {mode!r} is not one of {', '.join(_MODES)}")
        if isinstance(num_images, bool) or not isinstance(num_images, int) or num_images < 1:
            raise ValueError(f"ImageVisualizer: num_images must be an int >= 1, got {num_images!r}")
        self.interval = batch_or_epoch_interval("ImageVisualizer", interval)
        self.mode = mode.lower()
        self.num_images = num_images
        self.channels_last = bool(channels_last)
        self.folder = "{run_name}/images" if folder is None else str(folder)
        self.eval_images = bool(eval_images)
        #: every grid written: {"key": "Images/Train" | "Images/Eval", "path", "epoch", "batch"}
        self.images: list[dict[str, Any]] = []
        self._last_logged: int | None = None
        self._eval_pending: set[str] = set()
        self._notes: set[str] = set()

    def __getstate__(self) -> dict[str, Any]:
        """Picklable (the trainer sends each callback to its worker process) even after a
        run: without its control connection."""
        state = dict(self.__dict__)
        state.pop("_control", None)
        return state

    # ------------------------------------------------------------- events

    def batch_end(self, state, logger) -> None:
        ts = state.timestamp
        if self.interval.unit is TimeUnit.BATCH:
            index = ts.batch - 1  # the batch just trained, counted from 0 as Composer does
            due = index % self.interval.value == 0
        else:
            index = ts.epoch
            due = ts.batch_in_epoch == 1 and index % self.interval.value == 0
        if not due or index == self._last_logged:
            return
        self._last_logged = index
        samples = state.samples
        if not samples or samples.get("inputs") is None:
            self._note(logger, "samples", "ImageVisualizer: the trainer published no sample inputs "
                       "at batch_end; build it with Trainer(publish_samples=N), N >= num_images "
                       f"({self.num_images}), and (input, target) or tensor batches, to see train images")
            return
        self._draw(state, logger, "Images/Train", f"train_ep{ts.epoch}_ba{ts.batch}.png",
                   samples["inputs"], samples.get("targets"), samples.get("outputs"))

    def eval_start(self, state, logger) -> None:
        if self.eval_images:
            self._eval_pending.add(state.dataloader_label or "eval")

    def eval_batch_end(self, state, logger) -> None:
        label = state.dataloader_label or "eval"
        if label not in self._eval_pending:
            return
        self._eval_pending.discard(label)
        inputs = state.data.get("inputs")
        if inputs is None:
            self._note(logger, "eval", "ImageVisualizer: the trainer published no eval inputs; "
                       "build it with Trainer(publish_eval_outputs=True) to see eval images")
            return
        ts = state.timestamp
        self._draw(state, logger, "Images/Eval", f"eval_{_safe(label)}_ep{ts.epoch}_ba{ts.batch}.png",
                   inputs, state.targets, state.outputs)

    # ------------------------------------------------------------- drawing

    def _draw(self, state, logger, key: str, name: str, inputs, targets, outputs) -> None:
        images = _as_numpy(inputs)
        if images.ndim not in (3, 4) or images.size <= images.shape[0]:
            self._note(logger, f"shape{key}", f"ImageVisualizer: {key} inputs of shape "
                       f"{tuple(images.shape)} are not images: expected (N, C, H, W), (N, H, W, C) "
                       "with channels_last=True, or (N, H, W)")
            return
        n = min(self.num_images, images.shape[0])
        if n < self.num_images:
            self._note(logger, f"few{key}", f"ImageVisualizer: {key}: {images.shape[0]} images "
                       f"published, fewer than num_images={self.num_images}")
        tiles = [_to_rgb(img, self.channels_last) for img in images[:n]]
        captions: list[dict[str, Any]] = [{} for _ in range(n)]
        if self.mode == "segmentation":
            tiles = self._segmentation_panels(logger, key, tiles, targets, outputs, n)
        else:
            tiles, captions = _captioned(tiles, _labels(targets, n), _labels(outputs, n, predicted=True))
        path = Path(self.folder.format(run_name=state.run_name or "run")) / name
        ts = state.timestamp
        text = {"Title": f"{key} {state.run_name} epoch {ts.epoch} batch {ts.batch}",
                "Comment": json.dumps({"key": key, "epoch": ts.epoch, "batch": ts.batch,
                                       "images": captions})}
        grid = _grid(tiles)
        write_png(path, grid, text)
        logger.log_images(grid, name=key, channels_last=True)  # to TensorBoard, MLflow, wandb
        self.images.append({"key": key, "path": str(path), "epoch": ts.epoch, "batch": ts.batch})
        logger.log_text(f"ImageVisualizer: {key} -> {path}")

    def _segmentation_panels(self, logger, key, tiles, targets, outputs, n) -> list[np.ndarray]:
        if targets is None or outputs is None:
            self._note(logger, f"seg{key}", f"ImageVisualizer: {key}: mode='segmentation' needs "
                       "published targets and outputs; drawing the inputs alone")
            return tiles
        predicted, truth = _masks(_as_numpy(outputs)[:n], _as_numpy(targets)[:n], self.channels_last)
        panels = []
        for tile, t, p in zip(tiles, truth, predicted, strict=False):
            size = tile.shape[:2]
            panels.append(np.concatenate([tile, _fit(_colour_mask(t), size),
                                          _fit(_colour_mask(p), size)], axis=1))
        return panels

    def _note(self, logger, kind: str, text: str) -> None:
        """Say each problem once, not at every due batch."""
        if kind not in self._notes:
            self._notes.add(kind)
            logger.log_text(text)


# ---------------------------------------------------------------------- helpers




def _safe(text: str) -> str:
    return "".join(c if c.isalnum() or c in "-_" else "_" for c in text)[:60]


def _as_numpy(value: Any) -> np.ndarray:
    if hasattr(value, "detach"):
        value = value.detach().cpu()
        if str(value.dtype) == "torch.bfloat16":
            value = value.float()
        return value.numpy()
    return np.asarray(value)


def _to_rgb(img: np.ndarray, channels_last: bool) -> np.ndarray:
    """One image as (H, W, 3) uint8: channels moved last, grey repeated, scaled to 0-255."""
    if img.ndim == 2:
        img = img[..., None]
    elif not channels_last:
        img = np.moveaxis(img, 0, -1)
    if img.shape[-1] not in (1, 3, 4):
        img = img[..., :1]  # neither grey nor colour: show the first channel
    img = img[..., :3]
    if img.dtype != np.uint8:
        img = img.astype(np.float64)
        img = np.nan_to_num(img, nan=0.0, posinf=0.0, neginf=0.0)
        lo, hi = img.min(), img.max()
        img = (img - lo) / (hi - lo) * 255.0 if hi > lo else np.zeros_like(img)
        img = np.clip(np.rint(img), 0, 255).astype(np.uint8)
    if img.shape[-1] == 1:
        img = np.repeat(img, 3, axis=-1)
    scale = max(1, _MIN_TILE // max(img.shape[0], img.shape[1]))
    return np.kron(img, np.ones((scale, scale, 1), dtype=np.uint8)) if scale > 1 else img


def _fit(mask_rgb: np.ndarray, size: tuple[int, int]) -> np.ndarray:
    """A mask enlarged (nearest neighbour) to the size of its image tile."""
    h, w = size
    rows = np.arange(h) * mask_rgb.shape[0] // h
    cols = np.arange(w) * mask_rgb.shape[1] // w
    return mask_rgb[rows][:, cols]


def _colour_mask(mask: np.ndarray) -> np.ndarray:
    colours = np.zeros((mask.shape[0], mask.shape[1], 3), dtype=np.uint8)
    valid = mask >= 0
    colours[valid] = _PALETTE[mask[valid] % len(_PALETTE)]
    return colours


def _masks(outputs: np.ndarray, targets: np.ndarray, channels_last: bool) -> tuple[np.ndarray, np.ndarray]:
    """Predicted and true class masks (N, H, W), as Composer's _make_segmentation_images."""
    axis = -1 if channels_last else 1
    predicted = outputs.argmax(axis=axis) if outputs.ndim == 4 else outputs.astype(np.int64)
    if targets.ndim == 4:  # one-hot targets
        targets = targets.argmax(axis=axis)
    truth = targets.astype(np.int64)
    num_classes = outputs.shape[axis] if outputs.ndim == 4 else int(predicted.max()) + 1
    truth[truth < 0] = num_classes  # ignored pixels get a colour of their own
    return predicted, truth


def _labels(value: Any, n: int, predicted: bool = False) -> list[int] | None:
    """Class indices of classification targets or outputs; None when they are not that."""
    if value is None:
        return None
    array = _as_numpy(value)[:n]
    if array.ndim == 2 and array.shape[1] > 1:
        return [int(i) for i in array.argmax(axis=1)]
    if array.ndim == 2:
        array = array[:, 0]
    if array.ndim != 1:
        return None
    if np.issubdtype(array.dtype, np.integer) or array.dtype == np.bool_:
        return [int(i) for i in array]
    if predicted:  # one logit or probability a sample: a binary classifier
        threshold = 0.5 if array.min() >= 0 and array.max() <= 1 else 0.0
        return [int(v > threshold) for v in array]
    return None


def _captioned(tiles: list[np.ndarray], targets: list[int] | None,
               predictions: list[int] | None) -> tuple[list[np.ndarray], list[dict[str, Any]]]:
    """Each tile with a strip beneath: the target in white, the prediction green or red."""
    captions: list[dict[str, Any]] = []
    if targets is None and predictions is None:
        return tiles, [{} for _ in tiles]
    out = []
    for i, tile in enumerate(tiles):
        target = targets[i] if targets is not None and i < len(targets) else None
        prediction = predictions[i] if predictions is not None and i < len(predictions) else None
        caption = {k: v for k, v in (("target", target), ("prediction", prediction)) if v is not None}
        captions.append(caption)
        strip = np.full((7, tile.shape[1], 3), _BACKGROUND, dtype=np.uint8)
        x = 1
        if target is not None:
            x = _text(strip, x, str(target), _WHITE) + 4
        if prediction is not None:
            colour = _WHITE if target is None else (_GREEN if prediction == target else _RED)
            _text(strip, x, str(prediction), colour)
        out.append(np.concatenate([tile, strip], axis=0))
    return out, captions


def _text(strip: np.ndarray, x: int, text: str, colour: tuple[int, int, int]) -> int:
    """Draw `text` at column x (clipped at the strip's edge); returns the column after it."""
    for char in text:
        glyph = _GLYPHS.get(char, _GLYPHS["?"])
        for cell, bit in enumerate(glyph):
            col = x + cell % 3
            if bit == "1" and col < strip.shape[1]:
                strip[1 + cell // 3, col] = colour
        x += 4
    return x


def _grid(tiles: list[np.ndarray]) -> np.ndarray:
    h = max(t.shape[0] for t in tiles)
    w = max(t.shape[1] for t in tiles)
    cols = min(_COLUMNS, len(tiles))
    rows = -(-len(tiles) // cols)
    grid = np.full((_PAD + rows * (h + _PAD), _PAD + cols * (w + _PAD), 3), _BACKGROUND, dtype=np.uint8)
    for i, tile in enumerate(tiles):
        top, left = _PAD + (i // cols) * (h + _PAD), _PAD + (i % cols) * (w + _PAD)
        grid[top:top + tile.shape[0], left:left + tile.shape[1]] = tile
    return grid


def write_png(path: str | os.PathLike, rgb: np.ndarray, text: dict[str, str] | None = None) -> Path:
    """Write an (H, W, 3) uint8 array as an 8-bit RGB PNG (with optional tEXt chunks),
    atomically: a reader never sees half a file."""
    rgb = np.ascontiguousarray(rgb, dtype=np.uint8)
    if rgb.ndim != 3 or rgb.shape[2] != 3 or not rgb.shape[0] or not rgb.shape[1]:
        raise ValueError(f"write_png needs an (H, W, 3) array, got shape {rgb.shape}")
    h, w, _ = rgb.shape
    rows = np.concatenate([np.zeros((h, 1), dtype=np.uint8), rgb.reshape(h, w * 3)], axis=1)
    chunks = [_chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0))]
    for keyword, value in (text or {}).items():
        chunks.append(_chunk(b"tEXt", keyword.encode("latin-1") + b"\0"
                             + value.encode("latin-1", errors="replace")))
    chunks += [_chunk(b"IDAT", zlib.compress(rows.tobytes(), 6)), _chunk(b"IEND", b"")]
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(b"\x89PNG\r\n\x1a\n" + b"".join(chunks))
    os.replace(tmp, path)
    return path


def _chunk(kind: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))
