"""The two engines by --engine's name (plumbing): `plain` (infra/passes.py: one ordinary forward per sequence, the
code to read) and `fast` (infra/fast.py: shared prefixes, packing, a cached decoder), chosen here explicitly; and
how a script's settings load a model (`loading`)."""
from __future__ import annotations

from infra.fast import FAST
from infra.passes import PLAIN

ENGINES = {"fast": FAST, "plain": PLAIN}     # --engine's choices (infra.settings.ENGINE_NAMES)


def loading(args) -> dict:
    """The keyword arguments that load π's and μ's backbones as the settings ask (load_backbone,
    load_backbone_checkpoint, RubricModel.load): device, weight dtype, bf16 autocast, the engine."""
    return dict(device=args.device, dtype=args.dtype, autocast=args.autocast, engine=ENGINES[args.engine])
