"""What a compiled program communicates: its collectives, read off its HLO or StableHLO
(for any jitted function; a step's byte ledger over a run is ``lsgd_jax.step``'s)."""

from lsgd_jax.report._records import Collective
from lsgd_jax.report._records import CommunicationReport
from lsgd_jax.report._hlo import parse_hlo as parse_hlo
from lsgd_jax.report._report import communication_report

# Not in __all__: what other rooms use of this one (the step's byte ledger).
_FOR_OTHER_ROOMS = ("parse_hlo",)

__all__ = [
    "Collective",
    "CommunicationReport",
    "communication_report",
]
