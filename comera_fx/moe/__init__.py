"""Mixture-of-experts weights in TT form (docs/moe.md).

The layers that stand for expert weights in TT form; ``tensorize_`` installs them itself (its expert step,
``comera_fx.passes.experts``), and they are public for direct use:

* ``TTExpertBank``: one ``TTMatrix`` per expert (own cores, own gates), standing for a 3D expert parameter.
* ``TTExperts``: the module that replaces a transformers experts module (Mixtral, Qwen2/3-MoE layout).
* ``ExpertWeight``: what a hand-written module reads in place of its 3D parameter (``bmm`` / ``P[e]`` products).

``comera_fx.passes.find_experts`` says which expert weights a model has and how they are read.
"""

from .bank import TTExpertBank
from .experts import TTExperts, is_hf_experts
from .weight import ExpertSlice, ExpertWeight

__all__ = ["ExpertSlice", "ExpertWeight", "TTExpertBank", "TTExperts", "is_hf_experts"]
