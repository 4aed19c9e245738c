"""The network each draft method runs (`DraftMethod.network`, model/draft_methods.py): every place that builds a
draft from its config builds it here."""

from __future__ import annotations

from torch import nn

from eagle3_train.model.config import DraftConfig
from eagle3_train.model.dflash import DFlashDraft
from eagle3_train.model.draft import Eagle3Draft
from eagle3_train.model.draft_methods import draft_method

NETWORKS: dict[str, type[nn.Module]] = {"eagle3": Eagle3Draft, "dflash": DFlashDraft}


def build_draft(cfg: DraftConfig) -> nn.Module:
    return NETWORKS[draft_method(cfg.method).network](cfg)
