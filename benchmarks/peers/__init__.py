"""Faithful re-implementations of the peers' step planners, for the benchmark.

Each ``plan_<peer>(seq_lens, *, dp, cap, align=1, cost=None) -> plan[r][m]`` lays out ONE step
the way that project does (version in each module's docstring), written from the published
descriptions in ../shared/PEERS.md, never from their source. Plain Python, as upstream: their
speed is part of the comparison. A planner that would crash upstream raises :class:`PeerCrash`.

The plan form (``plan[r][m]`` = int64 sample indices; negative = padding copy) is described in
``_common.py``; benchmarks/metrics.py scores it.
"""

from ._common import PeerCrash, PeerPlan
from .kk import karmarkar_karp
from .nemo_rl import plan_nemo_rl
from .openrlhf import plan_openrlhf
from .skyrl import plan_skyrl
from .slime import plan_slime, plan_slime_rr
from .verl import plan_verl

__all__ = ["PEERS", "PeerCrash", "PeerPlan", "karmarkar_karp", "plan_verl", "plan_slime", "plan_slime_rr",
           "plan_nemo_rl", "plan_skyrl", "plan_openrlhf"]

#: label -> (planner, project and version it follows)
PEERS = {
    "verl": (plan_verl, "verl (verl-project/verl, 2026-08) seqlen_balancing + _balance_batch"),
    "slime": (plan_slime, "slime (THUDM/slime, 2026-08) dp_schedule, --balance-data"),
    "slime-rr": (plan_slime_rr, "slime (THUDM/slime, 2026-08) dp_schedule, round-robin"),
    "nemo-rl": (plan_nemo_rl, "NeMo-RL (NVIDIA-NeMo/RL, 2026-08) FFD sequence packing, bins round-robin"),
    "skyrl": (plan_skyrl, "SkyRL (NovaSky-AI/SkyRL, 2026-08) contiguous slabs + worst-fit decreasing"),
    "openrlhf": (plan_openrlhf, "OpenRLHF (OpenRLHF/OpenRLHF, 2026-08) first-fit count + KK + snake deal"),
}
