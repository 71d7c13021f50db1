"""Mixture-of-experts weights in TT form (docs/moe.md).

``tensorize_`` calls this package's step itself; the pieces are public for direct use:

* ``TTExpertBank``: one ``TTMatrix`` per expert (own cores, own gates), standing for a 3D expert parameter.
* ``TTExperts``: the module that replaces a transformers experts module (Mixtral, Qwen2/3-MoE layout).
* ``ExpertWeight``: what a hand-written module reads in place of its 3D parameter (``bmm`` / ``P[e]`` products).
* ``find_experts``: which expert weights a model has, and how they are read.
"""

from .bank import TTExpertBank
from .experts import TTExperts, is_hf_experts
from .find import ExpertCandidate, ExpertScan, find_experts
from .weight import ExpertSlice, ExpertWeight

__all__ = ["ExpertCandidate", "ExpertScan", "ExpertSlice", "ExpertWeight", "TTExpertBank", "TTExperts",
           "find_experts", "is_hf_experts"]
