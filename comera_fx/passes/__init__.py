"""Graph passes: each a function GraphModule -> GraphModule, usable in any custom compiler."""

from .dropout import fast_dropout
from .find import Candidate, FindResult, Use, UseKind, capture_graphs, find
from .find_experts import ExpertCandidate, ExpertScan, find_experts
from .recognize import contract_reconstructed_tt
from .randomize import RandomizeSummary, randomize_backward, randomize_backward_, restore_backward_, share_sketches
from .tensorize import TensorizeSummary
from .tensorize_graph import tensorize

__all__ = [
    "Candidate",
    "ExpertCandidate",
    "ExpertScan",
    "FindResult",
    "RandomizeSummary",
    "TensorizeSummary",
    "Use",
    "UseKind",
    "capture_graphs",
    "contract_reconstructed_tt",
    "fast_dropout",
    "find",
    "find_experts",
    "randomize_backward",
    "randomize_backward_",
    "restore_backward_",
    "share_sketches",
    "tensorize",
]
