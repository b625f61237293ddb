"""Composer's model protocol: `from offloop.models import ComposerModel, ComposerClassifier`
(also `from offloop import ComposerModel`). The public home of `offloop.trainer.composer_model`."""

from offloop.trainer.composer_model import ComposerClassifier, ComposerModel

__all__ = ["ComposerClassifier", "ComposerModel"]
