"""Graph passes: each a function GraphModule -> GraphModule, usable in any custom compiler."""

from .find import Candidate, FindResult, Use, UseKind, capture_graphs, find
from .recognize import contract_reconstructed_tt
from .tensorize import TensorizeSummary, tensorize

__all__ = ["Candidate", "FindResult", "TensorizeSummary", "Use", "UseKind", "capture_graphs",
           "contract_reconstructed_tt", "find", "tensorize"]
